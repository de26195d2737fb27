"""Pools owned by the backend, commits on the backend (engines/backends/memory.py, pipeline/pools.py),
on ONNX Runtime's CPU provider: after every step each pool equals what the plain numpy commit
gives, bitwise (rows and states, float32 and float16); the pools' and every bucket's buffers keep
their addresses over 100 rounds and are the very memory ONNX Runtime reads; the bytes a round
moves between host and backend do not grow with the pools and stay O(batch x k)."""

from __future__ import annotations

import numpy as np
import pytest

from tandem import contract as c
from tandem.engines.builder import build_engines
from tandem.engines.options import BuildOptions
from tandem.pipeline.allocator import group_tables
from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.sampling_params import SamplingParams
from tandem.pipeline.sequence import Status

from ..pipeline_fixtures import OPTIONS

KIND = "qwen3_5_mtp3"   # paged K/V (attention layers, three heads) and Gated DeltaNet states
PROMPTS = [[5, 17, 33, 200, 7], [9, 120, 77, 301, 15, 2, 88, 91, 14, 250, 3], [44]]
FP16 = BuildOptions(batch_sizes=(2,), spec_k=3, prefill_chunk=OPTIONS.prefill_chunk, max_seq_len=256,
                    page_size=OPTIONS.page_size, dtype="float16")


@pytest.fixture(scope="module")
def fp16_dir(tiny_root, tmp_path_factory):
    path = tmp_path_factory.mktemp("fp16pools") / KIND
    build_engines(tiny_root / KIND, path, FP16, show_progress=False)
    return path


# ---- the reference: today's numpy commits, on shadow copies of the pools ----------------------------
class _NumpyShadow:
    """Copies of the pools, committed with the numpy fancy-index writes the pipeline used before
    the backend owned them (pages[...] , offsets <- out[b, w]; states[slots] <- out[b])."""

    def __init__(self, pools):
        self.pools = pools
        self.paged = {la: {n: a.copy() for n, a in d.items()} for la, d in pools.paged.items()}
        self.states = {la: {n: a.copy() for n, a in d.items()} for la, d in pools.states.items()}

    def write_rows(self, layers, outputs, batch_rows, counts, starts, tables):
        size = self.pools.page_size
        for layer in layers:
            for p in self.pools._specs[layer].paged:
                name = c.block_tables(p.window)
                out = outputs[c.pool_output(p, layer)]
                for b, n, start, t in zip(batch_rows, counts, starts, tables):
                    table = (group_tables(t) or {}).get(name, t)
                    for w in range(n):
                        pos = start + w
                        self.paged[layer][p.name][table[pos // size], pos % size] = out[b, w]

    def commit_decode(self, layers, outputs, inputs, n, burst=None, step=0):
        """Plain decoding: row b went to position context_lens[b] through its bound block table
        (in a burst too: the pools' rows worked out for the whole burst are not consulted)."""
        size = self.pools.page_size
        for layer in layers:
            for p in self.pools._specs[layer].paged:
                table = inputs[c.block_tables(p.window)]
                out = outputs[c.pool_output(p, layer)]
                for b in range(n):
                    pos = int(inputs[c.CONTEXT_LENS][b])
                    self.paged[layer][p.name][table[b, pos // size], pos % size] = out[b, 0]
        if self.states:
            self.commit_states(outputs, range(n), inputs[c.STATE_SLOTS][:n])

    def commit_states(self, outputs, batch_rows, slots):
        for layer, pools in self.states.items():
            for s in self.pools._specs[layer].states:
                pools[s.name][np.asarray(slots)] = outputs[c.pool_output(s, layer)][np.asarray(batch_rows)]

    def clear_slot(self, slot):
        for pools in self.states.values():
            for pool in pools.values():
                pool[slot] = 0

    def mismatches(self) -> list[str]:
        bad = [f"paged {la}/{n}" for la, d in self.paged.items() for n, a in d.items()
               if a.tobytes() != self.pools.paged[la][n].tobytes()]
        return bad + [f"state {la}/{n}" for la, d in self.states.items() for n, a in d.items()
                      if a.tobytes() != self.pools.states[la][n].tobytes()]


def _shadowed(llm: LLM) -> _NumpyShadow:
    """Every commit also runs on the shadow, before the backend commit (same outputs)."""
    pools, shadow = llm.pools, _NumpyShadow(llm.pools)
    for name in ("write_rows", "commit_states", "commit_decode", "clear_slot"):
        real, ref = getattr(pools, name), getattr(shadow, name)

        def both(*args, _real=real, _ref=ref):
            _ref(*args)
            return _real(*args)
        setattr(pools, name, both)
    return shadow


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_backend_commits_equal_the_numpy_commits_bitwise_after_every_step(engine_dirs, fp16_dir, dtype):
    path = engine_dirs[KIND] if dtype == "float32" else fp16_dir
    # three requests on two slots (a slot is cleared and reused); small pools: every step compares them all
    llm = LLM(path, RuntimeConfig(max_num_seqs=2, memory_budget_bytes=2 << 20))
    assert llm.dtype == dtype and any(p.dtype == np.float16 for d in llm.pools.paged.values()
                                      for p in d.values()) == (dtype == "float16")
    shadow = _shadowed(llm)
    # the burst's commits through Pools.commit_decode (its native step is held to them in test_native_burst.py
    # and test_decode_burst.py)
    llm.round_loop.decode.native = None
    params = [SamplingParams(max_tokens=14, ignore_eos=True),
              SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, seed=3),
              SamplingParams(max_tokens=9, ignore_eos=True, speculative=False)]
    seqs = [llm.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    steps = 0
    while any(s.finish_reason is None for s in seqs):
        llm.step()
        steps += 1
        assert shadow.mismatches() == [], f"step {steps}"
    st = llm.round_loop.stats
    assert st.verify_rounds > 0 and any(s.metrics.accepted < s.metrics.drafted for s in seqs[:2])
    assert any(a.any() for d in llm.pools.states.values() for a in d.values())   # states were committed
    assert llm.round_loop.decode.bursts > 0      # the plain request took a burst: its commits are compared too


# ---- no allocation per call, no copy at bind time ------------------------------------------------------
def _addresses(llm: LLM) -> dict[str, int]:
    pools = {f"pool {la}/{n}": a.ctypes.data for d in (llm.pools.paged, llm.pools.states)
             for la, x in d.items() for n, a in x.items()}
    buffers = {f"{key} {n}": a.ctypes.data for key, b in llm.runner.runner._bindings.items()
               for n, a in {**b.inputs, **b.outputs}.items()}
    return {**pools, **buffers}


def test_pool_and_bucket_buffers_keep_their_addresses_over_100_rounds_and_are_what_onnxruntime_reads(engine_dirs):
    # 1: a token a round; a fixed width (the adaptive width's probes, timed, would open buckets of other widths)
    llm = LLM(engine_dirs[KIND], RuntimeConfig(max_num_seqs=2, decode_burst=1, adaptive_width=False))
    seqs = [llm.add_request(p, SamplingParams(max_tokens=400, ignore_eos=True)) for p in PROMPTS[:2]]
    for _ in range(40):    # past prefill, and past a few block-table widths (new buckets)
        llm.step()
    before, buckets = _addresses(llm), set(llm.runner.runner._bindings)
    rounds0 = llm.round_loop.stats.rounds
    while llm.round_loop.stats.rounds < rounds0 + 100:
        assert llm.scheduler.has_work(), "the sequences finished before 100 rounds"
        llm.step()
    assert all(s.finish_reason is None for s in seqs)
    after = _addresses(llm)
    assert {k: after[k] for k in before} == before
    new = set(llm.runner.runner._bindings) - buckets     # only buckets of wider block tables appear
    assert all(key[1][2] > max(k[1][2] for k in buckets) for key in new)
    pools = {id(a): a for d in (llm.pools.paged, llm.pools.states) for x in d.values() for a in x.values()}
    for binding in llm.runner.runner._bindings.values():
        for name, value in binding.values.items():
            array = binding.inputs.get(name, binding.outputs.get(name))
            if array is None:    # a pool: the OrtValue over the pool's own buffer
                array = next(a for a in pools.values() if a.ctypes.data == value.data_ptr())
            assert value.data_ptr() == array.ctypes.data, name
    # a pool is wrapped once: every bucket's binding binds the same OrtValue over it (a new bucket's
    # binding then wraps only its own buffers)
    wrapped = {}
    for binding in llm.runner.runner._bindings.values():
        for name in binding.values.keys() - binding.inputs.keys() - binding.outputs.keys():
            assert wrapped.setdefault(name, binding.values[name]) is binding.values[name], name
    assert len(wrapped) >= len(pools) and len(llm.runner.runner._bindings) > 3


# ---- bytes between host and backend ---------------------------------------------------------------------
def _bytes_per_round(path, budget: int) -> tuple[list[int], LLM]:
    llm = LLM(path, RuntimeConfig(max_num_seqs=4, memory_budget_bytes=budget))
    for p in PROMPTS:
        llm.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True, k=3))   # a fixed width: same calls
    moved = []
    while llm.scheduler.running or llm.scheduler.waiting:
        was_prefill = bool(llm.scheduler.waiting) or any(s.status == Status.PREFILL for s in llm.scheduler.running)
        before = llm.runner.runner.transfers.copy()
        llm.step()
        if not was_prefill:
            moved.append(llm.runner.runner.transfers.since(before).total())
    return moved, llm


def test_bytes_moved_per_round_do_not_grow_with_the_pools_and_are_order_batch_times_width(engine_dirs):
    small, llm = _bytes_per_round(engine_dirs[KIND], 4 << 20)
    large, big = _bytes_per_round(engine_dirs[KIND], 64 << 20)
    assert big.pools.memory_bytes() >= 8 * llm.pools.memory_bytes()
    assert small == large and len(small) > 5
    d = llm.desc
    # what the host reads and fills per round stays under 1.5 rows of logits + hidden per (sequence slot x
    # verify row) of the batch-4, width-4 bucket: measured 21.7 KB; the new K/V rows and states read back
    # on the host as well (the commits' outputs not kept with the backend) make it 80 KB
    batch, width = 4, 4
    bound = 1.5 * batch * width * (d.vocab_size + d.hidden_size) * 4
    assert max(small) <= bound < llm.pools.memory_bytes() / 4

"""State outputs written by the engine straight into their pools' rows (ModelRunner._place_states)
when a call's slots are consecutive, and the slot allocation that makes them so (FreeList with
lowest_first). The commit then skips those states; the tokens are the same as with every state
copied by the commit."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.pipeline.allocator import FreeList
from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.model_runner import ModelRunner
from tandem.pipeline.sampling_params import SamplingParams
from tandem.pipeline.sequence import Status

PROMPTS = [[5, 17, 33, 200, 7], [9, 120, 77, 301, 15, 2, 88, 91, 14, 250, 3], [44, 3], [7, 7, 8, 9, 10, 11]]


def test_lowest_first_hands_out_the_lowest_free_slot():
    slots = FreeList(10, "state slot", lowest_first=True)
    assert slots.allocate(4) == [1, 2, 3, 4]
    slots.free([1])
    slots.free([3])
    assert slots.allocate(1) == [1]                 # last freed, first out would give 3
    assert slots.allocate(3) == [3, 5, 6]           # the freed one, then fresh ones
    assert slots.ever_used == 6 and slots.num_free == 3
    stack = FreeList(10, "KV page")                 # pages keep last freed, first out
    stack.allocate(4)
    stack.free([1])
    stack.free([3])
    assert stack.allocate(2) == [3, 1]


def _placements(llm: LLM, monkeypatch) -> list:
    """Records each call's placement key (None: not placed) on the host runner's bindings; a decode
    burst's later calls (decode_again) keep the placement its first call made, and say so."""
    keys = []
    real, again = ModelRunner._place_states, ModelRunner.decode_again

    def record(self, binding, commits, consecutive=None):
        real(self, binding, commits, consecutive)
        keys.append(getattr(binding, "_placed", "no placement"))

    def record_again(self):
        keys.append(getattr(self._last_decode[1], "_placed", "no placement"))
        return again(self)

    monkeypatch.setattr(ModelRunner, "_place_states", record)
    monkeypatch.setattr(ModelRunner, "decode_again", record_again)
    return keys


@pytest.mark.parametrize("speculative", [False, True])
def test_placed_states_give_the_tokens_of_copied_states(engine_dirs, monkeypatch, speculative):
    params = SamplingParams(max_tokens=16, ignore_eos=True, speculative=speculative)
    with monkeypatch.context() as m:      # every state copied by the commit
        m.setattr(ModelRunner, "_place_states", lambda self, binding, commits, consecutive=None: None)
        copied = [o.token_ids for o in LLM(engine_dirs["qwen3_5_mtp3"]).generate(PROMPTS, params)]
    llm = LLM(engine_dirs["qwen3_5_mtp3"])
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == copied
    keys = _placements(llm, monkeypatch)    # again, on slots freed by the first four
    placed = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert placed == copied
    assert (1, 4) in keys                 # four sequences admitted together hold slots 1..4 again: placed
    pools = llm.pools.state_outputs()
    binding = next(b for b in llm.runner._bindings.values() if b._placed == (1, 4))
    for name, pool in pools.items():
        if name in binding.outputs:
            assert np.shares_memory(binding.outputs[name], pool)


def test_a_padded_batch_is_not_placed(engine_dirs, monkeypatch):
    """Three sequences decode in the batch-4 bucket: its padding row holds the scratch slot."""
    llm = LLM(engine_dirs["qwen3_5_mtp3"])
    sizes = []
    real = ModelRunner._place_states

    def record(self, binding, commits, consecutive=None):
        real(self, binding, commits, consecutive)
        sizes.append((len(binding.inputs["state_slots"]), binding._placed))

    monkeypatch.setattr(ModelRunner, "_place_states", record)
    llm.generate(PROMPTS[:3], SamplingParams(max_tokens=6, ignore_eos=True, speculative=False))
    padded = [key for n, key in sizes if n == 4]
    assert padded and all(key is None for key in padded)


# bursts of their steps whatever the machine's load: the same calls; no prefix cache, whose prefill split
# before a prompt's last token would shift when the sequences join the batch
NO_BUDGET = RuntimeConfig(decode_burst_ms=1e6, prefix_cache=False)


def _four_then_a_fifth(engine_dirs, monkeypatch, second_tokens: int, joins) -> tuple[list, list]:
    """Four sequences decode (the second ends after `second_tokens`), a fifth is added once
    joins(the four) holds; the tokens with placement must equal those with every state copied.
    Returns the placement keys and each call's state slots of the placing run."""
    lengths = [24, second_tokens, 24, 24, 16]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, speculative=False) for n in lengths]
    prompts = PROMPTS + [[3, 1, 4, 1, 5]]

    def run(llm: LLM) -> list[list[int]]:
        requests = [llm.add_request(p, s) for p, s in zip(prompts[:4], params[:4])]
        while llm.scheduler.has_work():
            llm.step()
            if len(requests) == 4 and joins(requests):
                requests.append(llm.add_request(prompts[4], params[4]))
        return [r.tokens[len(p):] for r, p in zip(requests, prompts)]

    with monkeypatch.context() as m:
        m.setattr(ModelRunner, "_place_states", lambda self, binding, commits, consecutive=None: None)
        copied = run(LLM(engine_dirs["qwen3_5_mtp3"], NO_BUDGET))
    llm = LLM(engine_dirs["qwen3_5_mtp3"], NO_BUDGET)
    keys, slots = _placements(llm, monkeypatch), []
    real_run = ModelRunner._run

    def run_and_record(self, graph, binding, commits=False, consecutive=None):
        slots.append(tuple(binding.inputs["state_slots"].tolist()))
        return real_run(self, graph, binding, commits, consecutive)

    monkeypatch.setattr(ModelRunner, "_run", run_and_record)
    assert run(llm) == copied
    return keys, slots


def test_a_refilled_batch_in_slot_order_is_placed(engine_dirs, monkeypatch):
    """Four sequences decode; the second ends early, a fifth takes its slot (the lowest free) and
    joins at the end of the running list. Rows go in slot order, so the refilled batch of four
    holds slots 1..4 again and is placed; the tokens equal copied states'."""
    keys, _ = _four_then_a_fifth(engine_dirs, monkeypatch, 4, lambda four: four[1].status == Status.FINISHED)
    assert keys.count((1, 4)) > 16        # the first four, and the refilled four (slot 2 reused)


def test_a_batch_whose_slots_stop_being_consecutive_is_not_placed(engine_dirs, monkeypatch):
    """Four sequences decode; a fifth arrives while all four run (slot 5), and once the second
    ends the batch of four holds slots 1, 3, 4, 5: the same bucket as before, one row's slot
    changed in place. Its states must not go to pool rows 1..4; the tokens equal copied states'."""
    keys, slots = _four_then_a_fifth(engine_dirs, monkeypatch, 6,
                                        lambda four: all(r.status == Status.DECODE for r in four))
    assert (1, 3, 4, 5) in slots and (1, 4) in keys

"""Cache specs per layer: each layer's mixer declares its pools, and the contract's pool inputs
and outputs, the pipeline's pools, byte budgets and commits all follow from that declaration;
a pool a mixer adds reaches every one of them with no other change."""

from __future__ import annotations

import numpy as np
import pytest

from tandem import contract as c
from tandem.checkpoint import LayerKind, open_checkpoint
from tandem.checkpoint.cache_specs import LayerCache, PagedKVSpec, StateSpec
from tandem.checkpoint.description import AttentionSpec
from tandem.engines.buckets import plan, profile_shapes
from tandem.engines.options import BuildOptions
from tandem.engines.verification import fixed_inputs
from tandem.graph_kinds import TARGET_STEP, GraphKind
from tandem.pipeline.pools import Pools, plan_pools

PAGE, HEADS = 4, 3


@pytest.fixture
def desc(tiny_root):
    return open_checkpoint(tiny_root / "qwen3_5_mtp3").description


def test_qwen_layers_declare_paged_kv_or_states_and_heads_paged_kv(desc):
    caches = desc.layer_caches()
    trunk, heads = caches[: desc.num_layers], caches[desc.num_layers:]
    a, g = desc.attention, desc.linear_attention
    for i, cache in enumerate(trunk):
        assert cache.layer == i and not cache.head
        if desc.layers[i].kind == LayerKind.FULL_ATTENTION:
            assert [(p.name, p.row_shape, p.dtype) for p in cache.pools] == [
                ("key", (a.num_kv_heads, a.head_dim), None), ("value", (a.num_kv_heads, a.head_dim), None)]
        else:
            assert [(s.name, s.shape, s.dtype) for s in cache.pools] == [
                ("recurrent", (g.num_value_heads, g.key_head_dim, g.value_head_dim), "float32"),
                ("conv", (g.conv_kernel - 1, g.conv_dim), None)]
    assert [(h.layer, h.head, [p.name for p in h.paged], h.states) for h in heads] == [
        (j, True, ["key", "value"], ()) for j in range(HEADS)]
    assert len(desc.layer_caches(mtp_layers=1)) == desc.num_layers + 1


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_pools_are_exactly_the_contract_pool_inputs(desc, dtype):
    """Every pool the pipeline allocates is a contract input of the target step or a head, with
    the contract's shape (num_pages / num_slots filled in) and dtype, and the other way round."""
    sizes = plan_pools(desc, PAGE, 8 << 20, 4, HEADS, dtype_bytes=np.dtype(dtype).itemsize)
    pools = Pools(desc, sizes, PAGE, HEADS, dtype)
    dims = {"num_pages": sizes.num_pages, "num_slots": sizes.num_slots, "page_size": PAGE}
    kinds = [TARGET_STEP, *(GraphKind.mtp_head(j) for j in range(HEADS))]
    wanted = {s.name: (tuple(dims.get(d, d) for d in s.shape), s.dtype)
              for k in kinds for s in c.graph_io(desc, k, dtype)[0] if s.shape[0] in ("num_pages", "num_slots")}
    got = {**pools.feeds(pools.paged), **pools.state_feeds()}
    assert {n: (a.shape, str(a.dtype)) for n, a in got.items()} == wanted
    assert sizes.page_bytes == sum(a[0].nbytes for layer in pools.paged.values() for a in layer.values())
    assert sizes.slot_bytes == sum(a[0].nbytes for layer in pools.states.values() for a in layer.values())
    assert sizes.page_bytes == PAGE * desc.kv_bytes_per_token(dtype)
    assert sizes.slot_bytes == desc.state_bytes_per_sequence(dtype)


def test_a_pool_a_mixer_adds_reaches_contract_pools_budget_build_and_commits(desc, monkeypatch):
    """The seam: a third paged pool declared by the attention mixer (as a family would) appears
    in the graphs' inputs and outputs, the pools, the page bytes, the build's profile shapes and
    verification inputs, and write_rows commits it, with no other module changed."""
    before = plan_pools(desc, PAGE, 8 << 20, 4, HEADS)
    declared = AttentionSpec.cache_specs
    monkeypatch.setattr(AttentionSpec, "cache_specs",
                        lambda self: (*declared(self), PagedKVSpec("index", (5,), "indexer keys", dtype="float32")))
    full = desc.layer_indices(LayerKind.FULL_ATTENTION)
    ins, outs = c.graph_io(desc, TARGET_STEP, "float16")
    assert {s.name: (s.shape, s.dtype) for s in ins if s.name.startswith("index_pool.")} == {
        f"index_pool.{i}": (("num_pages", "page_size", 5), "float32") for i in full}
    assert {s.name: s.shape for s in outs if s.name.startswith("new_index.")} == {
        f"new_index.{i}": ("batch", "rows", 5) for i in full}
    assert "index_pool.mtp1" in {s.name for s in c.graph_io(desc, GraphKind.mtp_head(1))[0]}

    sizes = plan_pools(desc, PAGE, 8 << 20, 4, HEADS)
    assert sizes.page_bytes - before.page_bytes == (len(full) + HEADS) * PAGE * 5 * 4
    pools = Pools(desc, sizes, PAGE, HEADS)
    options = BuildOptions(batch_sizes=(2,), spec_k=2, page_size=PAGE, max_seq_len=64)
    bucket = next(b for b in plan(desc, options) if b.graph.is_verify)
    assert profile_shapes(desc, bucket, options)[f"index_pool.{full[0]}"][2][1:] == (PAGE, 5)
    assert fixed_inputs(desc, bucket, options)[f"index_pool.{full[0]}"].shape[1:] == (PAGE, 5)

    new = {f"new_index.{i}": np.arange(2 * 3 * 5, dtype=np.float32).reshape(2, 3, 5) + i for i in full}
    new |= {name: np.zeros((2, 3, *a.shape[2:]), a.dtype) for name, a in
            ((c.pool_output(p, i), pools.paged[i][p.name]) for i in full for p in declared(desc.attention))}
    pools.write_rows(pools.trunk_paged, new, np.array([0, 1]), np.array([2, 1]), np.array([3, 0]), [[1, 2], [3]])
    index = pools.paged[full[0]]["index"]
    # sequence 0: rows 0, 1 at positions 3 (page 1, offset 3) and 4 (page 2, offset 0); sequence 1: row 0 at page 3
    rows = new[f"new_index.{full[0]}"]
    assert (index[1, 3] == rows[0, 0]).all() and (index[2, 0] == rows[0, 1]).all() and (index[3, 0] == rows[1, 0]).all()
    assert not index[3, 1].any() and not index[1, :3].any()


def test_states_commit_to_slots_and_clear(desc):
    sizes = plan_pools(desc, PAGE, 8 << 20, 2, 0)
    pools = Pools(desc, sizes, PAGE, 0)
    outs = {c.pool_output(s, i): np.full((2, *s.shape), i + 1.0, s.dtype_for("float32"))
            for i, states in pools.states.items() for s in desc.layer_caches(0)[i].states}
    pools.commit_states(outs, np.array([1]), np.array([2]))
    for i, states in pools.states.items():
        assert all((a[2] == i + 1).all() and not a[1].any() for a in states.values())
    pools.clear_slot(2)
    assert not any(a.any() for states in pools.states.values() for a in states.values())


def test_head_state_pools_are_refused(desc, monkeypatch):
    monkeypatch.setattr(type(desc), "head_cache",
                        lambda self, j: LayerCache(j, (StateSpec("conv", (2, 3), "conv windows"),), head=True))
    with pytest.raises(ValueError, match="MTP head 0 declares state pools \\(conv\\); the pipeline keeps states"):
        Pools(desc, plan_pools(desc, PAGE, 8 << 20, 2, 1), PAGE, 1)


@pytest.mark.parametrize("make, problem", [
    (lambda: PagedKVSpec("key pool", (2, 4), "keys"), "must be an identifier"),
    (lambda: PagedKVSpec("key", (2, -1), "keys"), "must be non-negative integers"),
    (lambda: StateSpec("conv", (), "conv"), "must be non-negative integers"),
    (lambda: StateSpec("conv", (2, 3), "conv", dtype="int8"), "dtype 'int8' is not one of"),
    (lambda: PagedKVSpec("key", (2, 4), "keys", window=0), "sliding window must be >= 1"),
])
def test_bad_specs_are_refused_saying_what(make, problem):
    with pytest.raises(ValueError, match=problem):
        make()

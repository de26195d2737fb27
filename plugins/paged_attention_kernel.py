"""Triton kernel for `ai.tandem::PagedSparseAttention`, and its launch plan.

Same contract as the op's function body (export/ops/paged_sparse_attention.py). One program per
(new row (b, w), KV head) serves the G = Hq / Hkv query heads of that KV head as one [G, D]
tile (GQA reads each K/V row once), with an online softmax over two passes:

    committed:  positions j of the sequence, read through the page table
                (page block_tables[b, j // S], slot j % S); dense: j in [0, context_lens[b]);
                sparse (K > 0): j from selected[b|0, w|0, :], -1 padded (positions are
                distinct, as a top-k indexer gives them)
    new rows:   w' in [0, w] from the key / value inputs (causal)

    both masked by the sliding window (p - j < window, p = context_lens[b] + w) when it is > 0.
    m = max(m, s);  l = l e^(m_old - m) + sum e^(s - m);  acc = acc e^(m_old - m) + e^(s - m) V

Dot products run in fp32 with IEEE precision (no TF32), so the plugin matches the ONNX body.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tandem.plugins.kernel_plan import KernelPlan, next_power_of_2, pointer_type

_NEG = tl.constexpr(-1.0e30)  # finite: a block with nothing visible yet keeps alpha = exp(0) and adds p = 0


@triton.jit
def _accumulate(q, kt, vt, visible, m_i, l_i, acc, SCALE: tl.constexpr):
    """One block of keys: q [BG, BD], kt [BN, BD], vt [BN, BDV], visible [BN]."""
    s = tl.dot(q, tl.trans(kt), input_precision="ieee") * SCALE          # [BG, BN]
    s = tl.where(visible[None, :], s, _NEG)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.where(visible[None, :], tl.exp(s - m_new[:, None]), 0.0)
    acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision="ieee")
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


@triton.jit
def paged_sparse_attention_kernel(
        q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, tables_ptr, ctx_ptr, sel_ptr,    # inputs
        W, P, SEL_B, SEL_W, SEL_K,                                            # scalar extras
        o_ptr,                                                                # output
        HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, PAGE: tl.constexpr,
        SCALE: tl.constexpr, WINDOW: tl.constexpr,
        BG: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BN: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)                                   # b * W + w
    hk = tl.program_id(1)
    b = row // W
    w = row % W
    G: tl.constexpr = HQ // HKV
    offs_g = tl.arange(0, BG)
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    mg, md, mdv = offs_g < G, offs_d < D, offs_dv < DV
    heads = row * HQ + hk * G + offs_g                                    # [BG] query heads of this KV head
    q = tl.load(q_ptr + heads[:, None] * D + offs_d[None, :], mask=mg[:, None] & md[None, :], other=0.0)
    q = q.to(tl.float32)
    ctx = tl.load(ctx_ptr + b)
    pos = ctx + w
    m_i = tl.full([BG], _NEG, tl.float32)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BDV], tl.float32)

    # committed positions, through the page table
    sparse = SEL_K > 0
    count = tl.where(sparse, SEL_K, ctx)
    sel_row = (tl.where(SEL_B == 1, 0, b) * SEL_W + tl.where(SEL_W == 1, 0, w)) * SEL_K
    for start in range(0, count, BN):
        idx = start + tl.arange(0, BN)
        listed = tl.load(sel_ptr + sel_row + idx, mask=idx < SEL_K, other=-1)  # none when dense
        j = tl.where(sparse, listed, idx)
        visible = (j >= 0) & (j < ctx) & (idx < count)
        if WINDOW > 0:
            visible = visible & (pos - j < WINDOW)
        page = tl.load(tables_ptr + b * P + j // PAGE, mask=visible, other=0)
        slot = (page * PAGE + j % PAGE) * HKV + hk                        # [BN] rows of the [N*S*Hkv, D] pool
        kt = tl.load(kc_ptr + slot[:, None] * D + offs_d[None, :], mask=visible[:, None] & md[None, :], other=0.0)
        vt = tl.load(vc_ptr + slot[:, None] * DV + offs_dv[None, :], mask=visible[:, None] & mdv[None, :], other=0.0)
        m_i, l_i, acc = _accumulate(q, kt.to(tl.float32), vt.to(tl.float32), visible, m_i, l_i, acc, SCALE)

    # the new rows w' <= w of this call
    for start in range(0, w + 1, BN):
        idx = start + tl.arange(0, BN)
        visible = idx <= w
        if WINDOW > 0:
            visible = visible & (w - idx < WINDOW)
        kv_row = (b * W + idx) * HKV + hk
        kt = tl.load(k_ptr + kv_row[:, None] * D + offs_d[None, :], mask=visible[:, None] & md[None, :], other=0.0)
        vt = tl.load(v_ptr + kv_row[:, None] * DV + offs_dv[None, :], mask=visible[:, None] & mdv[None, :],
                     other=0.0)
        m_i, l_i, acc = _accumulate(q, kt.to(tl.float32), vt.to(tl.float32), visible, m_i, l_i, acc, SCALE)

    out = acc / l_i[:, None]                                              # l_i >= 1: every row sees itself
    tl.store(o_ptr + heads[:, None] * DV + offs_dv[None, :], out, mask=mg[:, None] & mdv[None, :])


_INPUTS = ("q_ptr", "k_ptr", "v_ptr", "kc_ptr", "vc_ptr", "tables_ptr", "ctx_ptr", "sel_ptr")


def paged_attention_plan(batch, rows, pages_per_seq, selected_shape, *, num_query_heads: int, num_kv_heads: int,
                         head_dim: int, value_dim: int, page_size: int, scale: float, sliding_window: int,
                         dtype: str = "float32") -> KernelPlan:
    """batch, rows, pages_per_seq and the three dims of `selected` may be ints or TensorRT
    shape expressions; head counts, head dims and the page size are baked into the kernel."""
    if num_query_heads % num_kv_heads:
        raise ValueError(f"PagedSparseAttention: {num_query_heads} query heads are not a multiple of "
                         f"{num_kv_heads} KV heads")
    act, i64 = pointer_type(dtype), pointer_type("int64")
    block_d = max(next_power_of_2(head_dim), next_power_of_2(value_dim))
    block_n = 16 if block_d >= 256 else 32  # K and V blocks staged for tl.dot: keep shared memory < 48 KiB
    signature = dict(zip(_INPUTS, (act,) * 5 + (i64,) * 3))
    signature.update(W="i32", P="i32", SEL_B="i32", SEL_W="i32", SEL_K="i32", o_ptr=act)
    return KernelPlan(
        kernel="paged_sparse_attention_kernel", module=__name__, signature=signature,
        constexprs={"HQ": num_query_heads, "HKV": num_kv_heads, "D": head_dim, "DV": value_dim, "PAGE": page_size,
                    "SCALE": float(scale), "WINDOW": int(sliding_window),
                    "BG": next_power_of_2(num_query_heads // num_kv_heads), "BD": next_power_of_2(head_dim),
                    "BDV": next_power_of_2(value_dim), "BN": block_n},
        grid=(batch * rows, num_kv_heads, 1), extra_args=(rows, pages_per_seq, *selected_shape),
        num_warps=4, num_stages=1, num_inputs=len(_INPUTS))

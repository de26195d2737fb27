"""Triton kernel for `ai.tandem::GatedDeltaNet` (the recurrent form), and its launch plan.

Same contract as the op's function body (export/ops/gated_deltanet.py): W rows per sequence,
rows at or beyond state_rows[b] run with g = 0, beta = 0 (they leave the state unchanged), so
the state after the last row IS the final state. One program per (sequence, value head, block
of BV value columns) keeps its [dk, BV] slice of the state in registers across all W rows:

    S = exp(g_t) S;  u = beta_t (v_t - S^T k_t);  S = S + k_t u^T;  o_t = scale S^T q_t

Launch order of the runtime parameters is TensorRT's AOT plugin order: tensor inputs, scalar
extras, tensor outputs. Two entry points (2 or 3 outputs) share one body, because an AOT
plugin launches exactly one kernel and passes exactly its declared outputs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tandem.plugins.kernel_plan import KernelPlan, next_power_of_2, pointer_type


@triton.jit
def _gdn_rows(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s0_ptr, rows_ptr, W, o_ptr, sf_ptr, rs_ptr,
              HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
              BK: tl.constexpr, BV: tl.constexpr, SCALE: tl.constexpr, EMIT_ROWS: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // HV
    h = bh % HV
    hk = h // (HV // HK)
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
    mk = offs_k < DK
    mv = offs_v < DV
    tile = offs_k[:, None] * DV + offs_v[None, :]                       # [BK, BV] inside one [dk, dv] state
    mtile = mk[:, None] & mv[None, :]
    state_base = bh.to(tl.int64) * DK * DV
    s = tl.load(s0_ptr + state_base + tile, mask=mtile, other=0.0).to(tl.float32)
    n_rows = tl.load(rows_ptr + b)
    for t in range(0, W):
        row = b.to(tl.int64) * W + t                                    # index of (b, t) in [B, W]
        qk = (row * HK + hk) * DK + offs_k
        q = tl.load(q_ptr + qk, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + qk, mask=mk, other=0.0).to(tl.float32)
        vh = row * HV + h
        v = tl.load(v_ptr + vh * DV + offs_v, mask=mv, other=0.0).to(tl.float32)
        active = t < n_rows
        g = tl.where(active, tl.load(g_ptr + vh).to(tl.float32), 0.0)
        beta = tl.where(active, tl.load(beta_ptr + vh).to(tl.float32), 0.0)
        s = s * tl.exp(g)
        u = beta * (v - tl.sum(s * k[:, None], axis=0))                 # [BV]
        s = s + k[:, None] * u[None, :]
        o = tl.sum(s * q[:, None], axis=0) * SCALE
        tl.store(o_ptr + vh * DV + offs_v, o, mask=mv)
        if EMIT_ROWS:
            tl.store(rs_ptr + vh * DK * DV + tile, s, mask=mtile)
    tl.store(sf_ptr + state_base + tile, s, mask=mtile)


@triton.jit
def gated_deltanet_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s0_ptr, rows_ptr, W, o_ptr, sf_ptr,
                          HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                          BK: tl.constexpr, BV: tl.constexpr, SCALE: tl.constexpr):
    _gdn_rows(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s0_ptr, rows_ptr, W, o_ptr, sf_ptr, sf_ptr,
              HK, HV, DK, DV, BK, BV, SCALE, False)


@triton.jit
def gated_deltanet_rows_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s0_ptr, rows_ptr, W, o_ptr, sf_ptr, rs_ptr,
                               HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                               BK: tl.constexpr, BV: tl.constexpr, SCALE: tl.constexpr):
    _gdn_rows(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s0_ptr, rows_ptr, W, o_ptr, sf_ptr, rs_ptr,
              HK, HV, DK, DV, BK, BV, SCALE, True)


_INPUTS = ("q_ptr", "k_ptr", "v_ptr", "g_ptr", "beta_ptr", "s0_ptr", "rows_ptr")


def gated_deltanet_plan(batch, rows, *, num_key_heads: int, num_value_heads: int, key_dim: int, value_dim: int,
                        scale: float, emit_row_states: bool, dtype: str = "float32") -> KernelPlan:
    """batch and rows may be ints or TensorRT shape expressions (they only enter the grid and
    the scalar extras); head counts and dims are build-time constants baked into the kernel."""
    if num_value_heads % num_key_heads:
        raise ValueError(f"GatedDeltaNet: {num_value_heads} value heads are not a multiple of "
                         f"{num_key_heads} key heads")
    bk = next_power_of_2(key_dim)
    bv = min(next_power_of_2(value_dim), max(16, 4096 // bk))          # [BK, BV] fp32 tile: <= 4096 values
    act, state = pointer_type(dtype), pointer_type("float32")
    signature = dict(zip(_INPUTS, (act, act, act, act, act, state, pointer_type("int64"))))
    signature["W"] = "i32"
    signature.update(o_ptr=act, sf_ptr=state)
    if emit_row_states:
        signature["rs_ptr"] = state
    return KernelPlan(
        kernel="gated_deltanet_rows_kernel" if emit_row_states else "gated_deltanet_kernel",
        module=__name__, signature=signature,
        constexprs={"HK": num_key_heads, "HV": num_value_heads, "DK": key_dim, "DV": value_dim,
                    "BK": bk, "BV": bv, "SCALE": float(scale)},
        grid=(batch * num_value_heads, -(-value_dim // bv), 1), extra_args=(rows,), num_warps=4, num_stages=1,
        num_inputs=len(_INPUTS))

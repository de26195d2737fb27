"""The device commit: one Triton kernel that copies rows of an engine output into rows of a pool,
in place, by index. Written like the plugin kernels (plugins/): a KernelPlan says how to launch
it; on a GPU the PTX compiled ahead of time (plugins/ptx.py) is loaded and launched through the
CUDA driver API (engines/backends/cuda_memory.py), so it is captured into a CUDA graph with the
engine call and needs no Python at launch beyond the call itself.

    program (i, c):  pool[dst_rows[i] * row_bytes + c*BLOCK ...]  <-  src[src_rows[i] * row_bytes + c*BLOCK ...]

Bytes, not elements: one kernel serves every pool dtype (float32, float16, bfloat16 rows and
float32 states). Why a kernel rather than a small TensorRT scatter engine: TensorRT binds an
output to its own buffer, so a scatter engine would write a pool-sized copy each commit; the
kernel writes only the accepted rows. Imports Triton only when the kernel itself is asked for.
"""

from __future__ import annotations

from tandem.plugins.kernel_plan import KernelPlan

BLOCK = 1024       # bytes per program: a K/V row of 4 heads x 128 x 2 bytes in one program


def copy_rows_plan(rows: int, row_bytes: int) -> KernelPlan:
    """The launch of `rows` row copies of `row_bytes` bytes each."""
    if rows < 0 or row_bytes <= 0:
        raise ValueError(f"a commit copies rows >= 0 rows of > 0 bytes, got {rows} x {row_bytes}")
    return KernelPlan(kernel="copy_rows", module="tandem.engines.backends.commit_kernel_triton",
                      signature={"src": "*i8", "dst_rows": "*i64", "src_rows": "*i64", "row_bytes": "i32",
                                 "pool": "*i8"},
                      constexprs={"BLOCK": BLOCK}, grid=(rows, -(-row_bytes // BLOCK), 1),
                      extra_args=(row_bytes,), num_warps=4, num_stages=1, num_inputs=3)


def reference(pool, dst_rows, src, src_rows) -> None:
    """What the kernel does, on numpy arrays seen as [rows, row]: the CPU commit (HostMemory)."""
    pool[dst_rows] = src[src_rows]

"""The Triton source of the device commit kernel (commit_kernel.py says how it is launched).
Imported only to compile or interpret it: needs Triton."""

import triton
import triton.language as tl


@triton.jit
def copy_rows(src, dst_rows, src_rows, row_bytes, pool, BLOCK: tl.constexpr):
    i = tl.program_id(0)                       # one (destination, source) row pair
    chunk = tl.program_id(1)                   # BLOCK bytes of that row
    dst = tl.load(dst_rows + i)                # int64: pool offsets exceed 2^31 bytes
    row = tl.load(src_rows + i)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_bytes
    data = tl.load(src + row * row_bytes + offs, mask=mask)
    tl.store(pool + dst * row_bytes + offs, data, mask=mask)

"""The column tiles tandem's int4 / int8 matmul kernel reads (plugins/cpu/matmul_nbits.h), made
from com.microsoft::MatMulNBits' inputs at build time, and the ONNX nodes that undo them.

    MatMulNBits (ONNX Runtime)                    column tiles (T = ceil(N / 16), D = K * bits / 32)
    B       [N, nb, bs * bits / 8] uint8          [T, D, 16, 4]: dword d of the 16 columns side by side
    scales  [N * nb] float32                      [T, nb, 16] float16 (the same values: the
                                                  quantizer makes them so, export/quantize.py)
    zeros   [N * nb] (8 bits), [N * ceil(nb / 2)] [T, nb or ceil(nb / 2), 16]
            (4 bits, two blocks a byte)

Every tensor is its columns' bytes transposed, so a 64-byte load of B is the next dword (4 inputs
at 8 bits, 8 at 4 bits) of 16 columns: one vpdpbusd lane each, no shuffle in the kernel (its
gain over MLAS: docs/performance.md, "tandem's own CPU kernels"). Columns past N are zeros
(weights, scales and zero points).
The build's verification runs ONNX Runtime's node on the untiled tensors (untile_nodes):
Transpose, Reshape and Slice, bytes only, and the scales cast back to float32 (exact), so the copy
reads exactly the values the kernel reads.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

TILE = 16


def _tiles(n: int) -> int:
    return -(-n // TILE)


def _columns_tiled(a: np.ndarray, n: int) -> np.ndarray:
    """[N, ...] -> [T, 16, ...] with zero columns past N."""
    padded = np.zeros((_tiles(n) * TILE, *a.shape[1:]), a.dtype)
    padded[:n] = a
    return padded.reshape(_tiles(n), TILE, *a.shape[1:])


def fits_half(scales: np.ndarray) -> bool:
    """Whether float16 holds every scale exactly (the kernel's tiles keep them as float16)."""
    return bool(np.array_equal(scales.astype(np.float16).astype(scales.dtype), scales))


def tile_weights(B: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, n: int, k: int, bits: int,
                 block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """MatMulNBits' (B, scales, zeros) -> the kernel's column tiles (module docstring)."""
    blocks = k // block
    if B.size != n * k * bits // 8 or scales.size != n * blocks:
        raise ValueError(f"MatMulNBits weights of {B.size} bytes and {scales.size} scales do not fit N {n}, K {k}, "
                         f"{bits} bits, block {block}")
    if not fits_half(scales):
        raise ValueError("MatMulNBits scales that float16 does not hold exactly: quantize with "
                         "export/quantize.py (its scales are rounded to float16 values)")
    b = _columns_tiled(np.ascontiguousarray(B).reshape(n, k * bits // 32, 4), n).transpose(0, 2, 1, 3)
    s = _columns_tiled(scales.reshape(n, blocks).astype(np.float16), n).transpose(0, 2, 1)
    z = None if zeros is None else _columns_tiled(zeros.reshape(n, -1), n).transpose(0, 2, 1)
    return np.ascontiguousarray(b), np.ascontiguousarray(s), None if z is None else np.ascontiguousarray(z)


def untile_nodes(model: onnx.ModelProto, name: str, tiled: str, shape: list[int], n: int, back: list[int],
                 prefix: str, cast: int | None = None) -> list[onnx.NodeProto]:
    """Nodes that make `name` (MatMulNBits' layout, shape `back`) from the tiled tensor `tiled`
    [T, rows, 16(, 4)]: its columns back in front, the padding cut, the node's shape; with `cast`
    (an ONNX element type), cast to it last (the float16 scales to the node's float32)."""
    perm = [0, 2, 1, 3][: len(shape)]
    columns = [shape[0] * TILE, shape[1] * (shape[3] if len(shape) == 4 else 1)]
    consts = {f"{prefix}/columns": columns, f"{prefix}/n": [n], f"{prefix}/zero": [0], f"{prefix}/back": back}
    model.graph.initializer.extend(numpy_helper.from_array(np.array(v, np.int64), k) for k, v in consts.items())
    return [helper.make_node("Transpose", [tiled], [f"{prefix}/t"], perm=perm, name=f"{prefix}/transpose"),
            helper.make_node("Reshape", [f"{prefix}/t", f"{prefix}/columns"], [f"{prefix}/c"], name=f"{prefix}/flat"),
            helper.make_node("Slice", [f"{prefix}/c", f"{prefix}/zero", f"{prefix}/n", f"{prefix}/zero"],
                             [f"{prefix}/s"], name=f"{prefix}/slice"),
            helper.make_node("Reshape", [f"{prefix}/s", f"{prefix}/back"], [f"{prefix}/r" if cast else name],
                             name=f"{prefix}/shape"),
            *([helper.make_node("Cast", [f"{prefix}/r"], [name], to=cast, name=f"{prefix}/cast")] if cast else [])]


def untiled_inputs(model: onnx.ModelProto, node: onnx.NodeProto, attrs: dict) -> list[onnx.NodeProto]:
    """Rewire tandem's node to MatMulNBits' layout for its weights, scales and zero points (inputs
    1-3): the untiling nodes, to go before it."""
    dims = {t.name: list(t.dims) for t in model.graph.initializer}
    n, k, bits, block = attrs["N"], attrs["K"], attrs["bits"], attrs["block_size"]
    blocks = k // block
    backs = [[n, blocks, block * bits // 8], [n * blocks], [-1]]
    nodes = []
    for i, back in zip((1, 2, 3), backs):
        if i >= len(node.input) or not node.input[i]:
            continue
        untiled = f"{node.name or node.output[0]}/untiled_{i}"
        cast = onnx.TensorProto.FLOAT if i == 2 else None      # the scales: float16 tiles
        nodes += untile_nodes(model, untiled, node.input[i], dims[node.input[i]], n, back, untiled, cast)
        node.input[i] = untiled
    return nodes

"""Weight-only quantization of the linear layers: symmetric, per block of `block` input rows.

    W^T [K, N] (x @ W^T) -> q [K, N] int8 or int4, scale [K/block, N] (activation dtype)
    scale = max |W^T[block rows, n]| / qmax      q = round(W^T / scale) in [-qmax, qmax]
    graph:  DequantizeLinear(q, scale, axis=0, block_size=block) -> MatMul(x, .)

Standard ONNX (opset 21 blocked DequantizeLinear), so every runtime reads it: ONNX Runtime's CPU
provider fuses DequantizeLinear + MatMul into its MatMulNBits kernel (weights read as 8 or 4 bits,
activations quantized to int8 per block: session option `session.qdq_matmulnbits_accuracy_level`,
default 4), which is where the decode speed comes from (docs/performance.md); TensorRT reads the
same pattern as weight-only quantization. Embeddings, norms, MoE expert stacks and the router stay
in the activation dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

WEIGHT_FORMATS = ("float", "int8", "int4")   # "float": the activation dtype (no quantization)
_BITS = {"int8": 8, "int4": 4}
_NUMPY = {"int8": np.int8, "int4": ml_dtypes.int4}


@dataclass(frozen=True)
class WeightQuant:
    format: str            # "int8" or "int4"
    block: int = 32        # input rows (K) per scale

    def __post_init__(self):
        if self.format not in _BITS:
            raise ValueError(f"weight format {self.format!r} is not one of {', '.join(WEIGHT_FORMATS)}")
        if self.block < 16 or self.block & (self.block - 1):
            raise ValueError(f"quantization block {self.block}: use a power of two >= 16 (32 is typical)")

    @property
    def qmax(self) -> int:
        return 2 ** (_BITS[self.format] - 1) - 1

    def applies(self, shape: tuple[int, ...]) -> bool:
        """Whether a W^T of this shape is quantized: 2-D with whole blocks of input rows."""
        return len(shape) == 2 and shape[0] % self.block == 0

    def quantize(self, wt: np.ndarray, scale_dtype) -> tuple[np.ndarray, np.ndarray]:
        """W^T [K, N] float -> (q [K, N] int8/int4, scale [K/block, N] in scale_dtype)."""
        k, n = wt.shape
        blocks = wt.astype(np.float32).reshape(k // self.block, self.block, n)
        scale = np.abs(blocks).max(axis=1) / self.qmax                    # [K/block, N]
        scale = np.where(scale > 0, scale, 1.0).astype(scale_dtype)      # an all-zero block: any scale
        q = np.clip(np.rint(blocks / scale.astype(np.float32)[:, None, :]), -self.qmax, self.qmax)
        return q.reshape(k, n).astype(_NUMPY[self.format]), scale

    def dequantize(self, q: np.ndarray, scale: np.ndarray) -> np.ndarray:
        """The float W^T the graph computes with (float32)."""
        return q.astype(np.float32) * np.repeat(scale.astype(np.float32), self.block, axis=0)


def weight_quant(fmt: str, block: int = 32) -> WeightQuant | None:
    """The quantization a `--weights` value asks for; None for "float"."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"--weights {fmt!r} is not one of {', '.join(WEIGHT_FORMATS)}")
    return None if fmt == "float" else WeightQuant(fmt, block)

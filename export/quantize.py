"""Weight-only quantization of the linear layers, per block of `block` input rows.

    W^T [K, N] (x @ W^T) -> q [K, N], scale [K/block, N] (activation dtype, values float16 holds:
                            half_scales), zero point [K/block, N]
    int8 (symmetric):   scale = max |w| / 127             q = round(w / scale) in [-127, 127]
    int4 (asymmetric):  scale = (max(w, 0) - min(w, 0)) / 15, zero = round(-min(w, 0) / scale),
                        q = round(w / scale) + zero in [0, 15]   (uint4: 16 levels over the block's
                        range, as llama.cpp's Q4_1; the 15 of a symmetric int4 lost 6-13% more)
    graph:  DequantizeLinear(q, scale[, zero], axis=0, block_size=block) -> MatMul(x, .)

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

WEIGHT_FORMATS = ("float", "bf16", "int8", "int4")   # "float": the activation dtype (no quantization)
_BITS = {"int8": 8, "int4": 4}
_NUMPY = {"int8": np.int8, "int4": ml_dtypes.uint4}


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

    @property
    def asymmetric(self) -> bool:
        return self.format == "int4"

    def applies(self, shape: tuple[int, ...]) -> bool:
        """Whether a W^T of this shape is quantized: 2-D with whole blocks of input rows."""
        return len(shape) == 2 and shape[0] % self.block == 0

    def quantize(self, wt: np.ndarray, scale_dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """W^T [K, N] float -> (q [K, N] int8 / uint4, scale [K/block, N] in scale_dtype, zero point
        [K/block, N] uint4 or None)."""
        k, n = wt.shape
        blocks = wt.astype(np.float32).reshape(k // self.block, self.block, n)
        if self.asymmetric:
            lo, hi = np.minimum(blocks.min(axis=1), 0.0), np.maximum(blocks.max(axis=1), 0.0)
            scale = (hi - lo) / 15
        else:
            scale = np.abs(blocks).max(axis=1) / self.qmax                # [K/block, N]
        scale = half_scales(np.where(scale > 0, scale, 1.0)).astype(scale_dtype)   # an all-zero block: any scale
        s32 = scale.astype(np.float32)
        if not self.asymmetric:
            q = np.clip(np.rint(blocks / s32[:, None, :]), -self.qmax, self.qmax)
            return q.reshape(k, n).astype(_NUMPY[self.format]), scale, None
        zero = np.clip(np.rint(-lo / s32), 0, 15)
        q = np.clip(np.rint(blocks / s32[:, None, :]) + zero[:, None, :], 0, 15)
        return q.reshape(k, n).astype(ml_dtypes.uint4), scale, zero.astype(ml_dtypes.uint4)

    def dequantize(self, q: np.ndarray, scale: np.ndarray, zero: np.ndarray | None = None) -> np.ndarray:
        """The float W^T the graph computes with (float32)."""
        shift = 0.0 if zero is None else np.repeat(zero.astype(np.float32), self.block, axis=0)
        return (q.astype(np.float32) - shift) * np.repeat(scale.astype(np.float32), self.block, axis=0)


def half_scales(scale: np.ndarray) -> np.ndarray:
    """Positive scales rounded up to the nearest float16 (float32 values): ONNX Runtime's kernel
    stores them as float16 (plugins/cpu/matmul_nbits.h), half the scale bytes (an int4 engine's
    weights 10% smaller, as llama.cpp's Q4_0 / Q8_0 keep theirs), and exactly. Up, so the block's
    largest |w| (its range, int4) still fits the levels; the relative change is at most 2^-10 in
    float16's normal range, far below the 4- or 8-bit rounding of the weights."""
    clipped = np.clip(scale.astype(np.float32), np.finfo(np.float16).smallest_subnormal, np.finfo(np.float16).max)
    half = clipped.astype(np.float16)
    low = half.astype(np.float32) < clipped
    half[low] = np.nextafter(half[low], np.float16(np.inf))
    return half.astype(np.float32)


@dataclass(frozen=True)
class Bf16Weights:
    """`--weights bf16`: the linear layers' W^T rounded to bfloat16 (nearest even), kept as float32
    values in the exported graph (a plain MatMul every runtime reads); tandem's CPU matmul stores
    them as bfloat16 panels (export/cpu_matmul_lowering.py), half the bytes a token reads. For a
    bfloat16 checkpoint (as the Hub ships Qwen3.5 and the others) the rounding changes nothing: the
    engine computes with the checkpoint's own weights, as a float32 one does."""

    format: str = "bf16"

    @staticmethod
    def round(wt: np.ndarray) -> np.ndarray:
        return wt.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def weight_quant(fmt: str, block: int = 32) -> WeightQuant | Bf16Weights | None:
    """The weight form a `--weights` value asks for; None for "float"."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"--weights {fmt!r} is not one of {', '.join(WEIGHT_FORMATS)}")
    if fmt == "float":
        return None
    return Bf16Weights() if fmt == "bf16" else WeightQuant(fmt, block)

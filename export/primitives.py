"""What every layer builder shares: the checkpoint's canonical tensors as export-dtype numpy
(`Weights`) and the one-node helpers (cast, RMSNorm, SiLU, nn.Linear). No layer logic here.

Norms are zero-centred RMSNorm, so the exporter stores the scale 1 + w and uses the standard
RMSNormalization op (fp32 stash).
"""

from __future__ import annotations

import numpy as np

from tandem.export.builder import ONNX_DTYPES, GraphBuilder
from tandem.export.quantize import WeightQuant


class Weights:
    """Canonical checkpoint tensors as export-dtype numpy, with the derived forms graphs use."""

    def __init__(self, checkpoint, dtype: str = "float32", quant: WeightQuant | None = None):
        self.ckpt = checkpoint
        self.dtype = dtype              # the graphs' activation dtype (contract spelling)
        self.np_dtype = np.dtype(dtype)
        self.quant = quant              # weight-only quantization of the linear layers (None: float)
        self._derived: dict[str, np.ndarray] = {}  # graphs share weights: derive each once

    def raw(self, name: str) -> np.ndarray:
        return np.asarray(self.ckpt.weight(name)).astype(np.float32)

    def derived(self, b: GraphBuilder, name: str, make) -> str:
        if name not in self._derived:
            self._derived[name] = np.ascontiguousarray(make())
        return b.weight(name, self._derived[name])

    def matmul_t(self, b: GraphBuilder, name: str) -> str:
        """W^T [in, out] for x @ W^T (nn.Linear); with `quant`, the blocked DequantizeLinear of its
        int8 / int4 form (export/quantize.py)."""
        if self.quant is None:
            return self.derived(b, name + ".T", lambda: self.raw(name).T.astype(self.np_dtype))
        q_name = f"{name}.T.{self.quant.format}"
        parts = (q_name, q_name + ".scale", q_name + ".zero")
        if q_name not in self._derived:
            wt = self.raw(name).T
            if not self.quant.applies(wt.shape):   # too few input rows for one block: stays float
                return self.derived(b, name + ".T", lambda: wt.astype(self.np_dtype))
            for part, array in zip(parts, self.quant.quantize(wt, self.np_dtype)):
                if array is not None:
                    self._derived[part] = array
        inputs = [b.weight(part, self._derived[part]) for part in parts if part in self._derived]
        return b.op("DequantizeLinear", *inputs, axis=0, block_size=self.quant.block)

    def plus_one(self, b: GraphBuilder, name: str) -> str:
        """1 + w: zero-centred RMSNorm scale."""
        return self.derived(b, name + ".plus_one", lambda: (1.0 + self.raw(name)).astype(self.np_dtype))

    def plain(self, b: GraphBuilder, name: str, dtype=None) -> str:
        return self.derived(b, name, lambda: self.raw(name).astype(dtype or self.np_dtype))


def cast(b: GraphBuilder, x: str, src: str, dst: str) -> str:
    """x (of dtype `src`) as `dst`; no node when they agree, so float32 graphs are unchanged."""
    return x if src == dst else b.op("Cast", x, to=ONNX_DTYPES[dst])


def rms_norm(b: GraphBuilder, x: str, scale: str, eps: float, name: str) -> str:
    return b.op("RMSNormalization", x, scale, axis=-1, epsilon=eps, stash_type=1, name=name)


def silu(b: GraphBuilder, x: str) -> str:
    return b.op("Mul", x, b.op("Sigmoid", x))


def linear(b: GraphBuilder, w: Weights, x: str, name: str, scope: str) -> str:
    return b.op("MatMul", x, w.matmul_t(b, name), name=f"{scope}/MatMul")

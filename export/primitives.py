"""What every layer builder shares: the checkpoint's canonical tensors as export-dtype numpy
(`Weights`) and the one-node helpers (cast, RMSNorm, SiLU, nn.Linear). No layer logic here.

Norms are zero-centred RMSNorm, so the exporter stores the scale 1 + w and uses the standard
RMSNormalization op (fp32 stash).
"""

from __future__ import annotations

import copy

import numpy as np

from tandem.export.builder import ONNX_DTYPES, GraphBuilder
from tandem.export.quantize import Bf16Weights, WeightQuant


class Weights:
    """Canonical checkpoint tensors as export-dtype numpy, with the derived forms graphs use."""

    def __init__(self, checkpoint, dtype: str = "float32", quant: WeightQuant | Bf16Weights | None = None,
                 draft_quant: WeightQuant | Bf16Weights | None | str = "same", sink=None):
        self.ckpt = checkpoint
        self.dtype = dtype              # the graphs' activation dtype (contract spelling)
        self.np_dtype = np.dtype(dtype)
        self.quant = quant              # weight-only quantization of the linear layers (None: float)
        # the linear layers the MTP heads draft with, theirs and the lm_head ("same": as the others)
        self.draft_quant = quant if draft_quant == "same" else draft_quant
        self._derived: dict[str, np.ndarray] = {}  # graphs share weights: derive each once
        self._stored: dict[str, tuple] = {}        # derived and written to `sink`: name -> (shape, dtype)
        self.sink = sink    # exporter._SharedWeights: where each weight goes as it is derived (None: kept here)

    def drafting(self) -> Weights:
        """These weights as the MTP heads draft with them: every linear layer in `draft_quant`'s
        form (the derived arrays shared, each form derived once). Drafts only propose, so the heads
        may read cheaper weights than the target (engines/options.py BuildOptions.draft_quant)."""
        view = copy.copy(self)
        view.quant = self.draft_quant
        return view

    def raw(self, name: str) -> np.ndarray:
        return np.asarray(self.ckpt.weight(name)).astype(np.float32)

    def derived(self, b: GraphBuilder, name: str, make) -> str:
        """The weight `name` (made by make() on first use) for graph `b`: the array itself, or with a
        sink a reference to where the sink stored it (the array is written and dropped at once)."""
        if not self._known(name):
            self._keep(name, make())
        if name in self._stored:
            return b.stored_weight(name, *self._stored[name])
        return b.weight(name, self._derived[name])

    def _keep(self, name: str, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array)
        if self.sink is None:
            self._derived[name] = array
        else:
            self.sink.write(name, array)
            self._stored[name] = (array.shape, array.dtype)

    def _known(self, name: str) -> bool:
        return name in self._derived or name in self._stored

    def matmul_t(self, b: GraphBuilder, name: str | tuple[str, ...]) -> str:
        """W^T [in, out] for x @ W^T (nn.Linear); with `quant` (the heads' passes read `draft_quant`
        through drafting()), the blocked DequantizeLinear of its int8 / int4 form
        (export/quantize.py). Both forms of one weight may exist: each is derived once.
        A tuple of names (linears that read the same input): their W^T side by side, [in, sum out].
        Quantization blocks run along `in`, so each column is quantized as it would be alone."""
        names = (name,) if isinstance(name, str) else tuple(name)
        key = fused_name(names)
        quant = self.quant

        def wt() -> np.ndarray:
            return np.concatenate([self.raw(n).T for n in names], axis=1) if len(names) > 1 else self.raw(key).T

        if quant is None:
            return self.derived(b, key + ".T", lambda: wt().astype(self.np_dtype))
        if isinstance(quant, Bf16Weights):
            return self.derived(b, key + ".T.bf16", lambda: quant.round(wt()).astype(self.np_dtype))
        q_name = f"{key}.T.{quant.format}"
        parts = (q_name, q_name + ".scale", q_name + ".zero")
        if not self._known(q_name):
            array = wt()
            if not quant.applies(array.shape):   # too few input rows for one block: stays float
                return self.derived(b, key + ".T", lambda: array.astype(self.np_dtype))
            for part, quantized in zip(parts, quant.quantize(array, self.np_dtype)):
                if quantized is not None:
                    self._keep(part, quantized)
        inputs = [self.derived(b, part, None) for part in parts if self._known(part)]
        return b.op("DequantizeLinear", *inputs, axis=0, block_size=quant.block)

    def out_features(self, name: str) -> int:
        """Rows of the [out, in] linear weight `name` (its header's shape: no data converted)."""
        return int(np.shape(self.ckpt.weight(name))[0])

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


def linears(b: GraphBuilder, w: Weights, x: str, names: tuple[str, ...], scope: str) -> list[str]:
    """x @ W_i^T for every name, as one MatMul over the weights side by side and a Split of its
    last axis into each W_i's output rows. At batch 1 every MatMul node is a pass over the
    input, a thread-pool dispatch and (int8 / int4) a quantization of x: one node for the
    projections that share an input costs less than one each."""
    if len(names) == 1:
        return [linear(b, w, x, names[0], scope)]
    y = b.op("MatMul", x, w.matmul_t(b, tuple(names)), name=f"{scope}/MatMul")
    return list(b.op("Split", y, b.const([w.out_features(n) for n in names], np.int64), axis=-1, outputs=len(names),
                     name=f"{scope}/Split"))


def fused_name(names: tuple[str, ...]) -> str:
    """One weight name for linears side by side: ("l.a.weight", "l.b.weight") -> "l.{a,b}.weight"."""
    if len(names) == 1:
        return names[0]
    parts = [n.split(".") for n in names]
    head = 0
    while all(len(p) > head + 1 and p[head] == parts[0][head] for p in parts):
        head += 1
    tail = 0
    while all(len(p) > head + tail + 1 and p[-1 - tail] == parts[0][-1 - tail] for p in parts):
        tail += 1
    middles = [".".join(p[head:len(p) - tail]) for p in parts]
    return ".".join(parts[0][:head] + ["{" + ",".join(middles) + "}"] + parts[0][len(parts[0]) - tail:])

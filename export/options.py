"""What the exporter makes of a checkpoint, in one value (`tandem build-engines` derives it from its
BuildOptions, `tandem export` from its flags)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.export.quantize import WeightQuant
from tandem.graph_kinds import GraphKind

EXPORT_DTYPES = ("float32", "float16")  # weights and activations; see export/layers.py for what stays fp32


@dataclass(frozen=True)
class ExportOptions:
    dtype: str = "float32"
    quant: WeightQuant | None = None            # weight-only int8 / int4 linear layers; None: in `dtype`
    draft_quant: WeightQuant | None | str = "same"  # the linear layers the MTP heads draft with ("same": as quant)
    extra: tuple[GraphKind, ...] = ()           # unified round graphs and multi-step decode graphs to add
    index_share: bool = False                   # the rounds' sparse-MLA draft steps reuse the first step's top-k
    gdn_chunk_size: int = 0                     # the target step's Gated DeltaNet chunk (0: per token)

    def __post_init__(self):
        if self.dtype not in EXPORT_DTYPES:
            raise ValueError(f"export dtype {self.dtype!r} is not supported; use one of {', '.join(EXPORT_DTYPES)}")

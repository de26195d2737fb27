"""Build options for `tandem build-engines`, validated at construction (before anything heavy).

Contradictions and out-of-range values raise OptionsError with a message that says which
option and what to pass instead.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from tandem.checkpoint.validation import MAX_SPEC_K, MIN_SPEC_K
from tandem.export.options import ExportOptions
from tandem.export.quantize import WEIGHT_FORMATS, weight_quant
from tandem.graph_kinds import MAX_DECODE_STEPS

BACKENDS = ("onnxruntime", "tensorrt")
SUPPORTED_DTYPES = ("float32", "float16")  # engine dtype: weights, activations, KV and conv pools
MAX_BATCH = 256
DRAFT_WEIGHTS = ("auto", "same", "int8")
DRAFT_INT8_PARAMS = 1 << 20   # "auto" drafts in int8 where the draft passes read this many weights (4 MiB fp32) or more


class OptionsError(ValueError):
    pass


@dataclass(frozen=True)
class BuildOptions:
    backend: str = "onnxruntime"
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    spec_k: int = 3
    verify_widths: tuple[int, ...] | None = None  # None: from spec_k and the per-batch defaults
    max_seq_len: int = 4096
    page_size: int = 16
    prefill_chunk: int = 64
    dtype: str = "float32"
    weights: str = "float"        # linear layers: "float" (= dtype), "bf16" (bfloat16 values; float32 compute),
                                  # or weight-only "int8" / "int4"
    quant_block: int = 32         # input rows per quantization scale
    draft: str | None = None
    no_mtp: bool = False
    unified_round: bool = True    # also build the one-call round graph per (batch, verify width)
    draft_weights: str = "auto"   # the linear layers the MTP heads draft with (their own and the lm_head): "same"
                                  # (as --weights), "int8", or "auto": int8 where the engines are float and the
                                  # draft passes read >= DRAFT_INT8_PARAMS weights
    index_share: bool = False     # sparse-MLA heads (DeepSeek-V3.2 / GLM-5): the round graph's draft steps after
                                  # the first reuse its top-k instead of running the lightning indexer again; off:
                                  # it cost 2-3% accept length on a trained model (docs/families/deepseek_v32.md)
    decode_steps: int = 1         # > 1: also build the multi-step decode graph (n greedy tokens per call,
                                  # export/decode_graph.py); plain greedy decoding runs it where it pays
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise OptionsError(f"--backend {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if not self.batch_sizes or any(not isinstance(b, int) or not 1 <= b <= MAX_BATCH for b in self.batch_sizes):
            raise OptionsError(f"--batch-sizes {list(self.batch_sizes)}: give integers in 1..{MAX_BATCH}, e.g. 1,2,4,8")
        object.__setattr__(self, "batch_sizes", tuple(sorted(set(self.batch_sizes))))
        if self.no_mtp:
            if self.draft:
                raise OptionsError("--draft and --no-mtp contradict each other: a draft folder is only read for "
                                   "speculative decoding. Drop one of them.")
            if self.verify_widths:
                raise OptionsError("--verify-widths and --no-mtp contradict each other: without MTP there is no "
                                   "verify step. Drop one of them.")
        elif not MIN_SPEC_K <= self.spec_k <= MAX_SPEC_K:
            raise OptionsError(f"--spec-k {self.spec_k} is out of range: draft tokens per round must be in "
                               f"{MIN_SPEC_K}..{MAX_SPEC_K}")
        if self.verify_widths is not None:
            widths = tuple(sorted(set(self.verify_widths)))
            if not widths or any(not 2 <= w <= MAX_SPEC_K + 1 for w in widths):
                raise OptionsError(f"--verify-widths {list(self.verify_widths)}: each width is k+1 for k drafts, "
                                   f"so it must be in 2..{MAX_SPEC_K + 1}")
            object.__setattr__(self, "verify_widths", widths)
        if not isinstance(self.decode_steps, int) or not 1 <= self.decode_steps <= MAX_DECODE_STEPS:
            raise OptionsError(f"--decode-steps {self.decode_steps}: greedy tokens per plain decode call, 1..."
                               f"{MAX_DECODE_STEPS} (1: one per call, no multi-step graph)")
        if self.page_size < 1 or self.page_size & (self.page_size - 1) or self.page_size > 1024:
            raise OptionsError(f"--page-size {self.page_size}: use a power of two in 1..1024 (16 is typical)")
        if self.max_seq_len < self.page_size:
            raise OptionsError(f"--max-seq-len {self.max_seq_len} is smaller than one page ({self.page_size})")
        if not 1 <= self.prefill_chunk <= self.max_seq_len:
            raise OptionsError(f"--prefill-chunk {self.prefill_chunk}: use 1..--max-seq-len ({self.max_seq_len})")
        if self.dtype == "bfloat16":
            raise OptionsError("--dtype bfloat16: ONNX Runtime's CPU provider has no bfloat16 kernels (MatMul, Add, "
                               "... fail with NOT_IMPLEMENTED); use --dtype float16 or float32")
        if self.dtype not in SUPPORTED_DTYPES:
            raise OptionsError(f"--dtype {self.dtype} is not supported yet; use {' or '.join(SUPPORTED_DTYPES)}")
        if self.draft_weights not in DRAFT_WEIGHTS:
            raise OptionsError(f"--draft-weights {self.draft_weights!r}: use one of {', '.join(DRAFT_WEIGHTS)}")
        if self.weights not in WEIGHT_FORMATS:
            raise OptionsError(f"--weights {self.weights!r}: use one of {', '.join(WEIGHT_FORMATS)} (int8 / int4: "
                               "weight-only quantization of the linear layers)")
        if self.weights == "bf16" and self.dtype != "float32":
            raise OptionsError(f"--weights bf16 with --dtype {self.dtype}: bfloat16 weights compute in float32; "
                               "drop --dtype or use --weights float")
        try:
            weight_quant(self.weights, self.quant_block)
        except ValueError as e:
            raise OptionsError(f"--quant-block {self.quant_block}: {e}") from e

    @property
    def quant(self):
        """The weight quantization the export applies (None: float weights)."""
        return weight_quant(self.weights, self.quant_block)

    def draft_quant(self, draft_params: int):
        """The quantization of the linear layers the MTP heads draft with (each head's own and the lm_head
        they project with), for draft passes that read `draft_params` weights. Drafts only propose: the
        verify pass decides with the target's own weights, so speculative == plain whatever the drafts'
        form. A round runs k draft passes, each reading all of a head's weights for one row: on a
        bandwidth-bound CPU decode they are a round's largest read after the verify step's trunk. int8
        reads a quarter of float32 (shipped model, 3.7M draft weights, 2-core Xeon: speculation 1.14x ->
        1.42x plain, accept length 3.41 -> 3.40; 150M layout: 94 MiB fp32 lm_head per pass). Below
        DRAFT_INT8_PARAMS a pass is per-node overhead and "auto" keeps the weights as they are."""
        if self.draft_weights == "int8" or (self.draft_weights == "auto" and self.weights in ("float", "bf16")
                                            and draft_params >= DRAFT_INT8_PARAMS):
            return weight_quant("int8", self.quant_block) if self.weights != "int8" else self.quant
        return self.quant

    def export_options(self, draft_params: int, extra: tuple = ()) -> ExportOptions:
        """What the exporter makes for this build: `draft_params` weights the draft passes read
        (Checkpoint.draft_parameter_count), `extra` the round and multi-step graphs the buckets need."""
        return ExportOptions(dtype=self.dtype, quant=self.quant, draft_quant=self.draft_quant(draft_params),
                             extra=tuple(extra), index_share=self.index_share)

    def to_json(self) -> dict:
        out = asdict(self)
        out.pop("extra")
        out["batch_sizes"], out["verify_widths"] = list(self.batch_sizes), (
            list(self.verify_widths) if self.verify_widths else None)
        return out


def parse_int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise OptionsError(f"{flag} {text!r}: give comma-separated integers, e.g. 1,2,4,8") from e

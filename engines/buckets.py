"""Which engines a build makes: the (graph, batch, rows) buckets, the default verify width per
batch size, and the optimization-profile shapes a static-shape backend (TensorRT) needs.
Backend-neutral and pure: tested without any runtime.

Buckets per batch size B:
    decode        target_step   rows 1
    prefill       target_step   rows = prefill chunk
    verify        verify_greedy / verify_sample at each verify width W = k+1 in use
    heads         mtp_head_j    rows 1 .. max(prefill chunk, max W)   (re-anchor and draft steps)
    round         round_{greedy,sample}[_reused]_k{W-1}   rows W   (unified round, see unified_round_kinds)
    decode steps  decode_greedy_n{n}   rows 1 in, n out   (--decode-steps n > 1: n greedy tokens per call)

Default verify width per batch size (seed 003's idea): drafting pays off less as the batch
grows, because the target's verify of W rows costs about W x the decode at large B. Until
`tandem profile` measures it, the default is k+1 up to B = 2, at most 3 up to B = 8, 2 beyond.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem import contract as c
from tandem.checkpoint.description import ModelDescription
from tandem.graph_kinds import TARGET_STEP, VERIFY_GREEDY, VERIFY_SAMPLE, GraphKind, round_kinds

if TYPE_CHECKING:     # build options: the engine dir's runtime reads none of them
    from tandem.engines.options import BuildOptions


@dataclass(frozen=True)
class Bucket:
    graph: GraphKind
    batch: int
    rows: int          # W (or R for heads): the largest rows count this bucket serves
    min_rows: int = 0  # smallest rows count (0: same as rows)
    role: str = ""     # decode / prefill / verify / head

    @property
    def name(self) -> str:
        return f"{self.graph.name}.b{self.batch}.w{self.rows}" + (f"-{self.min_rows}" if self.min_rows else "")


def default_verify_width(batch: int, spec_k: int) -> int:
    if batch <= 2:
        return spec_k + 1
    if batch <= 8:
        return min(spec_k + 1, 3)
    return 2


def verify_width_per_batch(options: BuildOptions) -> dict[int, int]:
    """The width the pipeline uses for each batch size (profile can tune it later)."""
    if options.no_mtp:
        return {}
    if not options.verify_widths:
        return {b: default_verify_width(b, options.spec_k) for b in options.batch_sizes}
    widths = options.verify_widths
    out = {}
    for b in options.batch_sizes:  # the widest listed width within the default, else the narrowest
        fitting = [w for w in widths if w <= default_verify_width(b, max(widths) - 1)]
        out[b] = max(fitting) if fitting else min(widths)
    return out


def verify_widths(options: BuildOptions) -> tuple[int, ...]:
    """Widths to build: every width 2..k+1 by default, so a round can verify fewer drafts (a
    request's own k, or drafting stopped early by the probability floor) without padding."""
    if options.no_mtp:
        return ()
    if options.verify_widths:
        return options.verify_widths
    return tuple(range(2, options.spec_k + 2))


def unified_round_kinds(desc: ModelDescription, options: BuildOptions) -> tuple[list[GraphKind], str | None]:
    """The unified round graphs a build makes, and why there are none when there are none. One head
    mode: the pipeline's default (chained with several heads, else reused); chained rounds draft at
    most one token per head, so their widths stop at heads + 1."""
    if options.no_mtp or not options.unified_round:
        return [], "not asked for (--no-mtp or --no-unified-round)"
    from tandem.export.round_graph import unified_refusal  # planning a build: the exporter decides

    reason = unified_refusal(desc)
    if reason:
        return [], reason
    heads = desc.mtp.num_layers
    reused = heads == 1
    widths = [w for w in verify_widths(options) if reused or w - 1 <= heads]
    return round_kinds(reused, widths), None


def decode_kinds(options: BuildOptions) -> list[GraphKind]:
    """The multi-step decode graph a build makes (export/decode_graph.py): none unless asked for."""
    return [GraphKind.decode(options.decode_steps)] if options.decode_steps > 1 else []


def plan(desc: ModelDescription, options: BuildOptions) -> list[Bucket]:
    out = []
    widths = verify_widths(options)
    heads = 0 if options.no_mtp or desc.mtp is None else desc.mtp.num_layers
    rounds = unified_round_kinds(desc, options)[0]
    for b in options.batch_sizes:
        out.append(Bucket(TARGET_STEP, b, 1, role="decode"))
        if options.prefill_chunk > 1:
            out.append(Bucket(TARGET_STEP, b, options.prefill_chunk, min_rows=2, role="prefill"))
        for w in widths:
            out.append(Bucket(VERIFY_GREEDY, b, w, role="verify"))
            out.append(Bucket(VERIFY_SAMPLE, b, w, role="verify"))
        for j in range(heads):
            out.append(Bucket(GraphKind.mtp_head(j), b, max([options.prefill_chunk, *widths]), min_rows=1, role="head"))
        for kind in rounds:
            out.append(Bucket(kind, b, kind.drafts + 1, role="round"))
        for kind in decode_kinds(options):
            out.append(Bucket(kind, b, 1, role="decode_steps"))
    return out


def _dim(d, bucket: Bucket, options: BuildOptions, desc: ModelDescription, which: str) -> int:
    """One symbolic contract dim at the min / opt / max point of a bucket's profile."""
    max_pages = -(-options.max_seq_len // options.page_size)
    if isinstance(d, int):
        return d
    if d == "batch":
        return bucket.batch
    if d == "rows":
        lo = bucket.min_rows or bucket.rows
        return {"min": lo, "opt": bucket.rows, "max": bucket.rows}[which]
    if d == "max_pages":
        return {"min": 1, "opt": max_pages, "max": max_pages}[which]
    if d == "num_pages":  # the pool: at least one sequence's worth, at most the whole batch's
        return {"min": 1, "opt": bucket.batch * max_pages, "max": bucket.batch * max_pages + 1}[which]
    if d == "page_size":
        return options.page_size
    if d == "num_slots":
        return {"min": 1, "opt": bucket.batch, "max": bucket.batch * 2 + 1}[which]
    if d == "edits":    # a verify row's logit edits: prompt and output tokens, and logit_bias entries
        return {"min": 1, "opt": 1, "max": options.max_seq_len + c.MAX_LOGIT_BIAS_ENTRIES}[which]
    raise ValueError(f"unknown symbolic dim {d!r}")


def io_specs(desc: ModelDescription, graph: GraphKind, dtype: str = "float32") -> list[c.TensorSpec]:
    """Inputs of a graph kind for engines of `dtype` (the build's --dtype)."""
    return c.graph_io(desc, graph, dtype)[0]


def profile_shapes(desc: ModelDescription, bucket: Bucket, options: BuildOptions) -> dict[str, tuple]:
    """input name -> (min, opt, max) shapes of the bucket's optimization profile."""
    out = {}
    for spec in io_specs(desc, bucket.graph, options.dtype):
        out[spec.name] = tuple(tuple(_dim(d, bucket, options, desc, which) for d in spec.shape)
                               for which in ("min", "opt", "max"))
    return out

"""Checkpoints and engine dirs for bench/ cases: a checkpoint folder as given, or a random tiny /
bench kind (e.g. qwen3_5_mtp3, qwen3_5_150m, step3p5) written on the fly with
tandem.testing.tiny_checkpoints (nothing is downloaded), and engine dirs built from one with
tandem.engines.builder (an up-to-date dir is kept, as `tandem build-engines` keeps it)."""

from __future__ import annotations

import tempfile
from pathlib import Path


def workdir(given: str | Path | None, prefix: str = "tandem-bench-") -> Path:
    """`given` (made if missing), else a new temporary folder."""
    work = Path(given) if given else Path(tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    return work


def default_dtype(kind: str | Path) -> str:
    """The dtype a written kind's weights are stored in: bfloat16 for the ~150M-parameter bench kinds
    (as a released checkpoint stores them), float32 for the tiny ones."""
    return "bfloat16" if "150m" in str(kind) else "float32"


def checkpoint(kind: str | Path, work: Path, dtype: str | None = None) -> Path:
    """The checkpoint folder `kind` where it is one, else the tiny / bench kind of that name written
    into `work` (once: a folder with a config.json there is reused). dtype: the written weights'
    (default: default_dtype(kind))."""
    if Path(kind).is_dir():
        return Path(kind)
    src = Path(work) / str(kind)
    if not (src / "config.json").exists():
        from tandem.testing.tiny_checkpoints import write_tiny_checkpoint

        write_tiny_checkpoint(src, str(kind), dtype=dtype or default_dtype(kind))
    return src


def build(src: str | Path, out: str | Path, **options):
    """Engine dir `out` built from checkpoint `src` with BuildOptions(**options), quietly: the
    builder's BuildResult (engine_dir, status "built" / "up-to-date", seconds, size_bytes)."""
    from tandem.engines.builder import build_engines
    from tandem.engines.options import BuildOptions

    return build_engines(src, out, BuildOptions(**options), show_progress=False)


def tiny_engines(work: Path, kind: str = "qwen3_5_mtp3", **options) -> Path:
    """An engine dir of a tiny kind written into `work` (batch sizes 1, 2, 4, 8, k = 3, unless
    `options` say otherwise): its path."""
    options = {"batch_sizes": (1, 2, 4, 8), "spec_k": 3, "prefill_chunk": 64, "max_seq_len": 1024, **options}
    return build(checkpoint(kind, work), Path(work) / f"{kind}-engines", **options).engine_dir

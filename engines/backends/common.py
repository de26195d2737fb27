"""What every backend module shares."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


class BackendUnavailable(RuntimeError):
    """The backend's runtime library is not importable here; the message says how to get it."""


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link when possible (same filesystem: no copy of gigabytes), else copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def rewrite_in_large_writes(path: Path, chunk: int = 8 << 20) -> None:
    """Write `path` anew (the same bytes) from offset 0 in `chunk`-byte writes, into a file that then
    replaces it; a failure leaves `path` as it was.

    Why: the page cache keeps a file the way it was written. A weights file the build wrote tensor by
    tensor (4 KiB-aligned pieces, while its sessions fragmented memory) lay in 4 KiB pages scattered
    over physical memory (runs of 1.2 pages on average, no large folio: Linux 6.18, ext4, AMD EPYC
    Zen 4); written again in 8 MiB pieces it lies in 2 MiB folios, and the 150M model decoded 1.05-1.09x
    faster at int4 and 1.05-1.08x at int8 from it (float32: the same). A dir built and then served
    on one machine, as the README's commands do, is served from those pages (docs/performance.md)."""
    fresh = path.with_name(f".{path.name}.rewritten")
    try:
        with open(path, "rb") as src, open(fresh, "wb") as dst:
            while block := src.read(chunk):
                dst.write(block)
        shutil.copymode(path, fresh)
        os.replace(fresh, path)
    finally:
        fresh.unlink(missing_ok=True)

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

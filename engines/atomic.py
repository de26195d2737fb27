"""Build a directory in a temporary sibling and move it into place at the end.

An interrupted or failed build leaves no directory that looks valid: the final name appears
only by rename, after the manifest (the last file) is written. A stale temporary sibling from a
killed build has no manifest and a name no reader opens; the next build removes it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from pathlib import Path

_TMP_PREFIX = ".tandem-build-"


class OutputError(OSError):
    pass


def check_writable(out: Path, need_bytes: int) -> None:
    """Refuse up front: parent not writable, or not enough free space for the build."""
    parent = out.resolve().parent
    if not parent.exists():
        raise OutputError(f"{parent} does not exist; create it or pass another --out")
    if not parent.is_dir():
        raise OutputError(f"{parent} is not a directory; pass another --out")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{parent} is not writable; pass an --out folder you can write to")
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out} exists and is not a directory; pass another --out")
    free = shutil.disk_usage(parent).free
    if free < need_bytes:
        raise OutputError(f"{parent} has {free / 2**20:.0f} MiB free but the build needs about "
                          f"{need_bytes / 2**20:.0f} MiB; free some space or pass another --out")


@contextlib.contextmanager
def staged_directory(out: Path):
    """Yield a fresh temporary sibling of `out`; on success, it replaces `out` atomically."""
    out = Path(out)
    for stale in out.parent.glob(f"{_TMP_PREFIX}{out.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{out.name}-", dir=out.parent))
    try:
        yield tmp
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno == errno.ENOSPC:
            raise OutputError(f"no space left on the device of {out.parent} while building; free some space "
                              "and run the build again (nothing was left behind)") from e
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if out.exists():
        old = out.parent / f"{_TMP_PREFIX}{out.name}-old-{os.getpid()}"
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)

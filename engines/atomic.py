"""Build a directory in a temporary sibling and move it into place at the end, replacing only
what is safe to replace.

An interrupted or failed build leaves no directory that looks valid: the final name appears
only by rename, after the manifest (the last file) is written. `--out` may name a new path, an
empty folder, or a tandem engine directory (its manifest.json says so) holding only what tandem
wrote there; anything else, and any folder that is, holds or sits inside the checkpoint or draft
folder, is refused before work starts and again just before the swap. A stale temporary sibling
from a killed build is removed by the next build only when it is provably this code's: a folder
(not a link) with the temporary prefix holding the marker file of a process that no longer runs,
or a displaced engine directory, or nothing at all.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import tempfile
from pathlib import Path

from tandem.engines.manifest import FORMAT, MANIFEST

_TMP_PREFIX = ".tandem-build-"
MARKER = ".tandem-build.json"  # inside a temporary build folder: who is building it
_OWN_HIDDEN = ".tandem-"       # tandem's hidden files in an engine dir (this marker, the load-verification cache)
_OWN_EXTRAS = ("runtime_settings.json",)  # written into an engine dir by `tandem profile` (pipeline/llm.py)
_LISTED = 5                    # entries named when refusing a folder


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


def is_engine_dir(folder: Path) -> bool:
    """A folder whose manifest.json is a tandem engine manifest (of any format version)."""
    return _engine_manifest(folder) is not None


def _engine_manifest(folder: Path) -> dict | None:
    try:
        data = json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == FORMAT else None


def check_replaceable(out: Path, sources: dict[str, Path | None]) -> None:
    """Refuse an `out` that a build must not replace. sources: role ("checkpoint", "draft") -> folder."""
    out = Path(out)
    target = out.resolve()
    for role, folder in sources.items():
        if folder is None:
            continue
        src = Path(folder).resolve()
        fix = f"pass a separate folder for the engines, e.g. --out {src.parent / (src.name + '-engines')}"
        if target == src:
            raise OutputError(f"--out {out} is the {role} folder; building there would replace the {role}. "
                              f"Nothing was written: {fix}.")
        if src in target.parents:
            raise OutputError(f"--out {out} is inside the {role} folder {src}; the {role} folder stays "
                              f"read-only to tandem. Nothing was written: {fix}.")
        if target in src.parents:
            raise OutputError(f"--out {out} holds the {role} folder {src}; replacing it would delete the "
                              f"{role}. Nothing was written: {fix}.")
    if out.is_symlink() and not out.exists():
        raise OutputError(f"--out {out} is a broken symbolic link; remove it or pass another --out.")
    if not out.is_dir():
        return  # a new path (a file there is refused by check_writable)
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    manifest = _engine_manifest(out)
    if manifest is None:
        raise OutputError(f"--out {out} exists and is not a tandem engine directory (no tandem manifest.json; it "
                          f"holds {_shown(entries)}); build-engines replaces only engine directories it made, or "
                          "empty folders. Nothing was written: pass a new or empty folder as --out, or move that "
                          "folder away yourself.")
    files = manifest.get("files")
    own = {MANIFEST, *_OWN_EXTRAS, *(files if isinstance(files, dict) else ())}
    foreign = [e for e in entries if e not in own and not e.startswith(_OWN_HIDDEN)]
    if foreign:
        raise OutputError(f"--out {out} is a tandem engine directory but also holds what tandem did not write there "
                          f"({_shown(foreign)}); a rebuild replaces the whole directory. Nothing was written: move "
                          "those out, or pass another --out.")


def _shown(names: list[str]) -> str:
    return ", ".join(names[:_LISTED]) + (f" and {len(names) - _LISTED} more" if len(names) > _LISTED else "")


@contextlib.contextmanager
def staged_directory(out: Path, sources: dict[str, Path | None] | None = None):
    """Yield a fresh temporary sibling of `out`; on success, it replaces `out` atomically
    (after check_replaceable once more: the folder may have changed during the build)."""
    out = Path(out)
    final = out.resolve() if out.is_symlink() else out.parent.resolve() / out.name  # a link keeps pointing there
    _remove_stale(final)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{final.name}-", dir=final.parent))
    _mark(tmp)
    try:
        yield tmp
        check_replaceable(out, sources or {})
    except OSError as e:
        _remove(tmp)
        if e.errno == errno.ENOSPC:
            raise OutputError(f"no space left on the device of {final.parent} while building; free some space "
                              "and run the build again (nothing was left behind)") from e
        raise
    except BaseException:
        _remove(tmp)
        raise
    old = None
    if final.exists():
        old = final.parent / f"{_TMP_PREFIX}{final.name}-old-{os.getpid()}"
        os.rename(final, old)
        _mark(old)
    try:
        os.rename(tmp, final)
    except OSError:
        if old is not None:
            os.rename(old, final)
        _remove(tmp)
        raise
    (final / MARKER).unlink(missing_ok=True)
    if old is not None:
        _remove(old)


def _mark(folder: Path) -> None:
    (folder / MARKER).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))


def _remove(folder: Path) -> None:
    """Delete a temporary folder with its marker last, so a removal cut short stays recognisable."""
    for p in folder.iterdir() if folder.is_dir() else ():
        if p.name == MARKER:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    (folder / MARKER).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        folder.rmdir()


def _remove_stale(final: Path) -> None:
    for stale in final.parent.glob(f"{_TMP_PREFIX}{final.name}-*"):
        if _ours_and_abandoned(stale, final.name):
            _remove(stale)


def _ours_and_abandoned(folder: Path, name: str) -> bool:
    """A temporary folder of a build that no longer runs: marked by this code, a displaced engine
    directory (renamed aside just before a swap, not yet marked), or empty (killed between
    mkdtemp and the marker)."""
    if folder.is_symlink() or not folder.is_dir():
        return False
    try:
        marker = json.loads((folder / MARKER).read_text())
    except FileNotFoundError:
        suffix = folder.name[len(_TMP_PREFIX) + len(name) + 1:]
        if suffix.startswith("old-") and suffix[4:].isdigit() and is_engine_dir(folder):
            return not _running(int(suffix[4:]), socket.gethostname())
        return not any(folder.iterdir())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and not _running(marker.get("pid"), marker.get("host"))


def _running(pid, host) -> bool:
    """Whether `pid` may still be building: alive here, or on another host (a shared filesystem)."""
    if host != socket.gethostname():
        return True
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True

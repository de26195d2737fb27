"""Build a directory in a temporary sibling and move it into place at the end, replacing only
what is safe to replace.

An interrupted or failed build leaves no directory that looks valid: the final name appears
only by rename, after the manifest (the last file) is written. `--out` may name a new path, an
empty folder, or a tandem engine directory holding only what tandem wrote there (its manifest.json
proves it: the manifest's own sha256, or for a manifest older than that digest every file's);
anything else, and any folder that is, holds or sits inside the checkpoint or draft folder, is
refused before work starts and again just before the swap. Missing parents of `out` are created
(and removed again if the build fails). Every build first sweeps its parent folder: a temporary
sibling of a killed build, whatever `--out` it was for, is removed only when it is provably this
code's: a folder (not a link) with the temporary prefix holding the marker file of a process that
no longer runs, or a displaced engine directory, or nothing at all. A displaced engine directory
whose name is free again (the build was killed mid-swap) is put back instead.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

from tandem.engines.integrity import verify_engine_dir
from tandem.engines.manifest import FORMAT, MANIFEST, ManifestError, check_files, digest_ok, read_manifest

_TMP_PREFIX = ".tandem-build-"
MARKER = ".tandem-build.json"  # inside a temporary build folder: who is building it
_DISPLACED = re.compile(rf"^{re.escape(_TMP_PREFIX)}(.+)-old-(\d+)$")  # an engine dir set aside by a swap: name, pid
_OWN_HIDDEN = ".tandem-"       # tandem's hidden files in an engine dir (this marker, the load-verification cache)
_OWN_EXTRAS = ("runtime_settings.json",)  # written into an engine dir by `tandem profile` (pipeline/llm.py)
_LISTED = 5                    # entries named when refusing a folder


class OutputError(OSError):
    pass


def check_writable(out: Path, need_bytes: int) -> None:
    """Refuse up front: the nearest existing folder above `out` not writable (missing parents are
    created by staged_directory, as `mkdir -p` would), or not enough free space for the build."""
    out = Path(out)
    parent = _nearest_existing(out.absolute().parent)
    if not parent.is_dir():
        raise OutputError(f"{parent} is not a directory, so --out {out} cannot be created under it; pass another --out")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{parent} is not writable; pass an --out folder you can write to")
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out} exists and is not a directory; pass another --out")
    free = shutil.disk_usage(parent).free
    if free < need_bytes:
        raise OutputError(f"{parent} has {free / 2**20:.0f} MiB free but the build needs about "
                          f"{need_bytes / 2**20:.0f} MiB; free some space or pass another --out")


def _nearest_existing(folder: Path) -> Path:
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    return folder


def is_engine_dir(folder: Path) -> bool:
    """A folder whose manifest.json proves tandem wrote it (the only folders a build replaces or a
    sweep deletes): a tandem manifest whose own sha256 matches it, or, for a manifest written before
    manifests carried that digest, one that names files which all exist with the recorded sha256.
    A hand-made `{"format": "tandem-engines"}` proves nothing."""
    return _engine_manifest(folder) is not None


def _engine_manifest(folder: Path) -> dict | None:
    try:
        data = json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return None
    proven = digest_ok(data)
    if proven is None:  # an older build's manifest: its files must be the ones it records
        files = data.get("files")
        proven = (isinstance(files, dict) and bool(files) and all(isinstance(v, str) for v in files.values())
                  and not check_files(folder, data))
    return data if proven else None


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
        raise OutputError(f"--out {out} exists and is not a tandem engine directory (no manifest.json that proves "
                          f"tandem wrote it; it holds {_shown(entries)}); build-engines replaces only engine "
                          "directories it made, or "
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
    (after check_replaceable once more: the folder may have changed during the build).
    Missing parents of `out` are created, and removed again (only those, only while empty) if
    the build fails."""
    out = Path(out)
    created = _make_parents(out.absolute().parent)
    final = out.resolve() if out.is_symlink() else out.parent.resolve() / out.name  # a link keeps pointing there
    try:
        sweep_stale(final.parent)
        tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{final.name}-", dir=final.parent))
    except BaseException:
        _remove_parents(created)
        raise
    _mark(tmp)
    try:
        yield tmp
        check_replaceable(out, sources or {})
    except OSError as e:
        _remove(tmp)
        _remove_parents(created)
        if e.errno == errno.ENOSPC:
            raise OutputError(f"no space left on the device of {final.parent} while building; free some space "
                              "and run the build again (nothing was left behind)") from e
        raise
    except BaseException:
        _remove(tmp)
        _remove_parents(created)
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


def _make_parents(folder: Path) -> list[Path]:
    """mkdir -p; the folders it made, deepest first."""
    made = []
    while not folder.exists() and folder.parent != folder:
        made.append(folder)
        folder = folder.parent
    for f in reversed(made):
        try:
            f.mkdir()
        except FileExistsError:
            made.remove(f)  # another process made it meanwhile: not ours to remove
        except OSError as e:
            _remove_parents(made[made.index(f) + 1:])
            raise OutputError(f"cannot create {f} ({e.strerror}); create it yourself or pass another --out") from e
    return made


def _remove_parents(made: list[Path]) -> None:
    for f in made:  # deepest first; a folder something else wrote into stays
        with contextlib.suppress(OSError):
            f.rmdir()


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


def sweep_stale(parent: Path) -> list[str]:
    """Clear `parent` of every dead build's temporary folder (whatever --out it was for); what was
    done, in words, for the build to report. A displaced engine directory whose name is free again
    is put back: the build that set it aside was killed before its replacement moved in."""
    done = []
    try:
        candidates = sorted(Path(parent).glob(f"{_TMP_PREFIX}*"))
    except OSError:
        return done
    for stale in candidates:
        displaced = _DISPLACED.match(stale.name)
        if not _ours_and_abandoned(stale, displaced):
            continue
        home = stale.parent / displaced[1] if displaced else None
        if home is not None and not os.path.lexists(home) and _whole(stale):
            (stale / MARKER).unlink(missing_ok=True)
            os.rename(stale, home)
            done.append(f"put back {home} (a killed build had set it aside to replace it)")
        else:
            _remove(stale)
            done.append(f"removed {stale} (the temporary folder of a build that no longer runs)")
    return done


def _whole(folder: Path) -> bool:
    """Every file its manifest names is there with the recorded size (not half removed)."""
    try:
        verify_engine_dir(folder, read_manifest(folder), hashes=False)
    except (ManifestError, OSError):
        return False
    return True


def _ours_and_abandoned(folder: Path, displaced: re.Match | None) -> bool:
    """A temporary folder of a build that no longer runs: marked by this code, a displaced engine
    directory (renamed aside just before a swap, not yet marked), or empty (killed between
    mkdtemp and the marker)."""
    if folder.is_symlink() or not folder.is_dir():
        return False
    try:
        marker = json.loads((folder / MARKER).read_text())
    except FileNotFoundError:
        if displaced and is_engine_dir(folder):
            return not _running(int(displaced[2]), socket.gethostname())
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

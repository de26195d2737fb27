"""Load-time check of an engine directory against its manifest.json.

    the manifest itself: its own sha256 (engines/manifest.py read_manifest)   (always)
    every file in the directory: one the manifest names, or tandem's own
        (the verification cache, runtime_settings.json)                     (always: one listing)
    every file the manifest names: exists, is a regular file (not a link),
        has the recorded size                                                (always: one lstat each)
    its sha256 equals the recorded one                                        (first load, and again for
                                                                               a file whose stat changed;
                                                                               not with verify=False)

What a load verified is cached per file as (size, mtime_ns, ctime_ns, sha256): a file whose stat
still matches its entry, and whose entry's sha256 is the manifest's, is not read again. The cache
is `.tandem-verified.json` inside the engine directory when it is writable (it goes wherever the
directory goes and disappears with it), else a file in the user's cache folder keyed by the
directory's resolved path (read-only mounts, shared installs). docs/pipeline.md says what the
cache can and cannot detect. Files the manifest does not name (runtime_settings.json, the cache
itself) are allowed; any other file is refused (a file the runtime would read without a record: one
copied in, or one whose entry was taken out of the manifest). No torch, no ONNX Runtime: stat,
hashlib and json only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tandem.engines.manifest import MANIFEST, ManifestError, file_sha256

CACHE_FILE = ".tandem-verified.json"
CACHE_FORMAT = "tandem-verified"
_HASH_THREADS = 4  # hashlib releases the GIL on large buffers: files hash in parallel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FileStat:
    size: int
    mtime_ns: int
    ctime_ns: int   # set by the kernel on every write or utime call; a program cannot set it back

    @classmethod
    def of(cls, st: os.stat_result) -> FileStat:
        return cls(st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True)
class Verification:
    files: int                 # files the manifest names; all present, with the recorded size and sha256
    hashed: tuple[str, ...]    # those whose sha256 this load computed (first load, or their stat changed)
    cache: Path | None         # where the verified stats are kept (None: nowhere writable)


def verify_engine_dir(engine_dir: str | Path, manifest: dict, hashes: bool = True) -> Verification:
    """Refuse (ManifestError naming each file and what differs) an engine directory whose files
    are not the ones its manifest records. `hashes` False: sizes only (`--no-verify`)."""
    engine_dir = Path(engine_dir)
    recorded: dict[str, str] = manifest["files"]
    sizes: dict[str, int] = manifest.get("file_sizes", {})  # absent in manifests written before sizes were kept
    stats: dict[str, FileStat] = {}
    problems = [f"{name}: not a file the manifest records (copied in, or its entry taken out of the manifest)"
                for name in sorted(_unrecorded(engine_dir, recorded))]
    for name in sorted(recorded):
        path = engine_dir / name
        try:
            st = path.lstat()
        except FileNotFoundError:
            problems.append(f"{name}: missing")
            continue
        except OSError as e:
            problems.append(f"{name}: cannot be read ({e.strerror})")
            continue
        if stat.S_ISLNK(st.st_mode):
            problems.append(f"{name}: a symbolic link (an engine directory holds its own files: copy it with "
                            "`cp -rL`, which copies what links point to)")
        elif not stat.S_ISREG(st.st_mode):
            problems.append(f"{name}: not a regular file")
        elif name in sizes and st.st_size != sizes[name]:
            problems.append(f"{name}: size differs ({st.st_size:,} bytes, the manifest records {sizes[name]:,})")
        else:
            stats[name] = FileStat.of(st)
    if problems:
        raise _refusal(engine_dir, problems)

    if not hashes:
        return Verification(len(recorded), (), None)
    in_dir, per_user = engine_dir / CACHE_FILE, user_cache_file(engine_dir)
    cached = [_read_cache(in_dir), _read_cache(per_user)]
    entries = {n: _entry(st, recorded[n]) for n, st in stats.items()}
    stale = [n for n, e in entries.items() if all(c.get(n) != e for c in cached)]
    digests = _hash(engine_dir, stale)
    problems = [f"{n}: content differs (sha256 {d[:16]}..., the manifest records {recorded[n][:16]}...)"
                for n, d in digests.items() if d != recorded[n]]
    if problems:
        raise _refusal(engine_dir, problems)
    where = None
    if stale:
        where = _write_cache(in_dir, entries) or _write_cache(per_user, entries)
        if where is None:
            log.warning("%s: cannot write the verification cache there or in %s; every load will hash the "
                        "engine files again", engine_dir, per_user.parent)
    else:
        where = in_dir if all(cached[0].get(n) == e for n, e in entries.items()) else per_user
    return Verification(len(recorded), tuple(stale), where)


# what tandem itself writes into a built engine directory besides the files the manifest records
TANDEM_EXTRAS = (MANIFEST, CACHE_FILE, "runtime_settings.json")


def _unrecorded(engine_dir: Path, recorded: dict) -> list[str]:
    """Files and folders of the directory that are neither recorded nor tandem's own (its hidden
    files: the verification cache and a build's marker; `tandem profile`'s runtime_settings.json)."""
    try:
        names = [p.name for p in engine_dir.iterdir()]
    except OSError:
        return []           # (the recorded files' own checks say what is wrong)
    return [n for n in names if n not in recorded and n not in TANDEM_EXTRAS and not n.startswith(".tandem-")]


def user_cache_file(engine_dir: Path) -> Path:
    """The per-user cache of a directory that cannot hold its own (XDG_CACHE_HOME, else ~/.cache)."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    key = hashlib.sha256(str(Path(engine_dir).resolve()).encode()).hexdigest()[:32]
    return root / "tandem" / "verified" / f"{key}.json"


def _entry(fs: FileStat, sha256: str) -> dict:
    return {"size": fs.size, "mtime_ns": fs.mtime_ns, "ctime_ns": fs.ctime_ns, "sha256": sha256}


def _hash(engine_dir: Path, names: list[str]) -> dict[str, str]:
    if len(names) <= 1:
        return {n: file_sha256(engine_dir / n) for n in names}
    with ThreadPoolExecutor(min(_HASH_THREADS, len(names))) as pool:
        return dict(zip(names, pool.map(lambda n: file_sha256(engine_dir / n), names)))


def _read_cache(path: Path) -> dict[str, dict]:
    """Entries by file name; an unreadable or foreign cache is no cache (the files get hashed)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT or not isinstance(data.get("files"), dict):
        return {}
    return data["files"]


def _write_cache(path: Path, entries: dict[str, dict]) -> Path | None:
    """Atomic (temporary sibling + rename), so concurrent loads never read half a file."""
    text = json.dumps({"format": CACHE_FORMAT, "files": entries}, indent=1, sort_keys=True) + "\n"
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide it from other users of a shared engine dir
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
        return path
    except OSError:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        return None


def _refusal(engine_dir: Path, problems: list[str]) -> ManifestError:
    return ManifestError(f"{engine_dir} does not match its {MANIFEST}: {'; '.join(problems)}. The directory changed "
                         "after it was built (edited, truncated or copied incompletely); rebuild it with "
                         f"`tandem build-engines MODEL_DIR --out {engine_dir}`.")

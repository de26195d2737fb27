"""What an engine build is made from, and what changed since the last one.

    fingerprint = {"inputs":   {name: {sha256, size, mtime_ns, ctime_ns}}   the files the reader used
                   "options":  the build options that shape the engines (not the draft's path)
                   "tandem", "backend", "contract_version": the versions that made them}

Inputs are keyed by their name relative to their folder ("draft/..." for the draft folder's), and
compared by content: moving or copying the checkpoint, or adding an unrelated file to it, changes
nothing; a weight file rewritten with the same size does. A file's sha256 is reused from the
previous manifest when its size, mtime_ns and ctime_ns are unchanged, so a no-op rerun hashes
nothing (ctime cannot be set back by a program, so a rewrite with its mtime restored is hashed).
"""

from __future__ import annotations

import os
from pathlib import Path

from tandem import __version__, contract
from tandem.engines.manifest import file_sha256

_STAT_KEYS = ("size", "mtime_ns", "ctime_ns")
_NOT_COMPARED = ("draft",)  # the draft folder's path: its files are inputs, its location is not


def input_files(ckpt, copied: tuple[str, ...]) -> dict[str, Path]:
    """Name relative to its folder -> path, for every file the reader used plus the `copied`
    ones (tokenizer files and configs the engine directory carries) that exist."""
    files = dict(ckpt.input_files())
    for name in copied:
        if (ckpt.path / name).is_file():
            files[name] = ckpt.path / name
    return dict(sorted(files.items()))


def hash_inputs(files: dict[str, Path], previous: dict | None) -> dict[str, dict]:
    """name -> {sha256, size, mtime_ns, ctime_ns}; `previous` is the last build's fingerprint."""
    old = (previous or {}).get("inputs")
    old = old if isinstance(old, dict) else {}
    out = {}
    for name, path in files.items():
        st = os.stat(path)
        record = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}
        known = old.get(name)
        if isinstance(known, dict) and all(known.get(k) == record[k] for k in _STAT_KEYS) and known.get("sha256"):
            record["sha256"] = known["sha256"]
        else:
            record["sha256"] = file_sha256(path)
        out[name] = record
    return out


def fingerprint(inputs: dict[str, dict], options: dict, backend_versions: dict) -> dict:
    return {"inputs": inputs, "options": {k: v for k, v in options.items() if k not in _NOT_COMPARED},
            "tandem": __version__, "backend": backend_versions, "contract_version": contract.CONTRACT_VERSION}


def digests(fp: dict) -> dict[str, str | None] | None:
    """Input name -> sha256 (None for a fingerprint of an older form, which recorded no content)."""
    inputs = fp.get("inputs")
    if not isinstance(inputs, dict):
        return None
    return {name: r.get("sha256") if isinstance(r, dict) else None for name, r in inputs.items()}


def changes(old: dict, new: dict) -> list[str]:
    """What differs between two fingerprints, one phrase each ("model.safetensors changed",
    "option page_size 16 -> 8"); empty when the engines would come out the same."""
    before, after = digests(old), digests(new)
    if before is None:
        return ["the previous build recorded its inputs in an older form"]
    out = []
    for name in sorted(before.keys() | after.keys()):
        if name not in before:
            out.append(f"{name} added")
        elif name not in after:
            out.append(f"{name} removed")
        elif before[name] != after[name]:
            out.append(f"{name} changed")
    out += _diff("option ", old.get("options"), new["options"])
    if old.get("tandem") != new["tandem"]:
        out.append(f"tandem version {old.get('tandem')} -> {new['tandem']}")
    out += _diff("", old.get("backend"), new["backend"])
    if old.get("contract_version") != new["contract_version"]:
        out.append(f"graph contract version {old.get('contract_version')} -> {new['contract_version']}")
    return out


def _diff(prefix: str, old, new: dict) -> list[str]:
    old = old if isinstance(old, dict) else {}
    return [f"{prefix}{k} {_show(old.get(k))} -> {_show(new.get(k))}"
            for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)]


def _show(value) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value))
    return "none" if value is None else str(value)

"""manifest.json of an engine directory: what was built, from what, and how it was verified.
Written last, inside the temporary build directory, so a directory with a manifest is complete.
The pipeline reads only this file and the files it names."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tandem.export.exporter import file_sha256  # noqa: F401 (re-exported: the builder hashes with it)

MANIFEST = "manifest.json"
FORMAT = "tandem-engines"
FORMAT_VERSION = 1
# files copied from the checkpoint: the runtime needs them and never reads the checkpoint
CHECKPOINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "chat_template.jinja")


class ManifestError(ValueError):
    pass


def checkpoint_fingerprint(*folders: Path | None) -> dict[str, list[int]]:
    """(size, mtime_ns) of every file the build reads: touching a file changes it, so the next
    build rebuilds; hashing gigabytes on every no-op run would not be cheap."""
    out = {}
    for folder in folders:
        if folder is None:
            continue
        for path in sorted(Path(folder).iterdir()):
            if path.is_file() and (path.suffix in (".json", ".safetensors", ".jinja", ".model")):
                st = os.stat(path)
                out[str(path.resolve())] = [st.st_size, st.st_mtime_ns]
    return out


def read_manifest(engine_dir: Path) -> dict:
    path = Path(engine_dir) / MANIFEST
    if not path.exists():
        raise ManifestError(f"{engine_dir}: no {MANIFEST}; this is not a complete engine directory. "
                            "Build one with `tandem build-engines MODEL_DIR --out DIR`.")
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise ManifestError(f"{path} is not valid JSON ({e}); rebuild the engine directory.") from e
    if data.get("format") != FORMAT:
        raise ManifestError(f"{path} is not a tandem engine manifest")
    if data.get("format_version") != FORMAT_VERSION:
        raise ManifestError(f"{path}: manifest format {data.get('format_version')} but this tandem reads "
                            f"{FORMAT_VERSION}; rebuild the engine directory with this version.")
    return data


def write_manifest(folder: Path, manifest: dict) -> None:
    (Path(folder) / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def check_files(engine_dir: Path, manifest: dict) -> list[str]:
    """Files the manifest names that are missing or whose hash differs."""
    bad = []
    for name, digest in manifest.get("files", {}).items():
        path = Path(engine_dir) / name
        if not path.exists() or file_sha256(path) != digest:
            bad.append(name)
    return bad

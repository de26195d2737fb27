"""manifest.json of an engine directory: what was built, from what, and how it was verified.
Written last, inside the temporary build directory, so a directory with a manifest is complete.
The pipeline reads only this file and the files it names."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tandem.graph_kinds import GraphKind

MANIFEST = "manifest.json"
WEIGHTS_FILE = "weights.bin"   # the export's (and the engines') external weights, one file
FORMAT = "tandem-engines"
FORMAT_VERSION = 1
DIGEST = "manifest_sha256"     # the manifest's own hash: of its canonical JSON without this key
# files copied from the checkpoint: the runtime needs them and never reads the checkpoint
CHECKPOINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "chat_template.jinja")


# what a load reads (engines/integrity.py, pipeline/llm.py)
_SHAPE = {"backend": str, "description": dict, "options": dict, "runtime": dict, "engines": list, "files": dict}
_RUNTIME_KEYS = ("page_size", "max_seq_len", "prefill_chunk", "batch_sizes", "spec_k", "verify_widths")


class ManifestError(ValueError):
    pass


def read_manifest(engine_dir: Path) -> dict:
    path = Path(engine_dir) / MANIFEST
    if not path.exists():
        raise ManifestError(f"{engine_dir}: no {MANIFEST}; this is not a complete engine directory. "
                            "Build one with `tandem build-engines MODEL_DIR --out DIR`.")
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise ManifestError(f"{path} is not valid JSON ({e}); rebuild the engine directory.") from e
    except OSError as e:
        raise ManifestError(f"{path} cannot be read ({e.strerror})") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ManifestError(f"{path} is not a tandem engine manifest")
    if data.get("format_version") != FORMAT_VERSION:
        raise ManifestError(f"{path}: manifest format {data.get('format_version')} but this tandem reads "
                            f"{FORMAT_VERSION}; rebuild the engine directory with this version.")
    if digest_ok(data) is False:
        raise ManifestError(f"{path} was edited after the build (its own sha256 no longer matches it): the files it "
                            f"names may not be the ones built. Rebuild the engine directory with `tandem "
                            f"build-engines MODEL_DIR --out {engine_dir}`.")
    _check_shape(path, data)
    return data


def digest(manifest: dict) -> str:
    """sha256 of the manifest's canonical JSON, its own DIGEST left out."""
    text = json.dumps({k: v for k, v in manifest.items() if k != DIGEST}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def signed(manifest: dict) -> dict:
    """The manifest with its own DIGEST (as write_manifest writes it)."""
    manifest = {k: v for k, v in manifest.items() if k != DIGEST}
    return {**manifest, DIGEST: digest(manifest)}


def digest_ok(manifest: dict) -> bool | None:
    """Whether the manifest is as tandem wrote it; None for one written before manifests had a digest."""
    if DIGEST not in manifest:
        return None
    return manifest[DIGEST] == digest(manifest)


def _check_shape(path: Path, data: dict) -> None:
    """The keys a load reads, with their types, so a damaged manifest is refused naming it
    rather than failing later with a KeyError."""
    wrong = [f"{key} (expected {kind.__name__})" for key, kind in _SHAPE.items() if not isinstance(data.get(key), kind)]
    runtime = data.get("runtime") if isinstance(data.get("runtime"), dict) else {}
    wrong += [f"runtime.{key}" for key in _RUNTIME_KEYS if key not in runtime]
    files = data.get("files") if isinstance(data.get("files"), dict) else {}
    wrong += [f"files[{name!r}] (a plain file name with its sha256)" for name, digest in files.items()
              if Path(name).name != name or name in ("", ".", "..") or not isinstance(digest, str)]
    sizes = data.get("file_sizes", {})
    if not isinstance(sizes, dict) or not all(type(v) is int for v in sizes.values()):
        wrong.append("file_sizes (byte counts by file name)")
    engines = data.get("engines") if isinstance(data.get("engines"), list) else []
    wrong += [f"engines[{i}] (a graph kind, rows and a file listed in files)" for i, e in enumerate(engines)
              if not (isinstance(e, dict) and {"graph", "rows"} <= e.keys() and _is_graph_kind(e["graph"])
                      and type(e["rows"]) is int and isinstance(e.get("file"), str) and e["file"] in files)]
    if wrong:
        raise ManifestError(f"{path} is damaged: missing or wrong {', '.join(wrong)}; rebuild the engine directory "
                            "with `tandem build-engines MODEL_DIR --out DIR`.")


def _is_graph_kind(name) -> bool:
    try:
        GraphKind.parse(name)
    except ValueError:
        return False
    return True


def family_chat_formats(architecture: str) -> dict:
    """What the model's family declares (CHAT_FORMATS): {"tool_calls": format or None, "reasoning": ...}."""
    from tandem.checkpoint.families import FAMILIES  # here: the manifest reader stays light to import

    module = FAMILIES.get(architecture)
    return dict(getattr(module, "CHAT_FORMATS", {}).get(architecture, {"tool_calls": None, "reasoning": None}))


def chat_formats(manifest: dict) -> dict:
    """The tool-call and reasoning formats the server parses for an engine dir: the manifest's
    "chat_formats" (the build writes them), else its model family's (engine dirs built before)."""
    formats = manifest.get("chat_formats")
    if isinstance(formats, dict):
        return formats
    return family_chat_formats(manifest.get("description", {}).get("architecture", ""))


def write_manifest(folder: Path, manifest: dict) -> None:
    """Also records each named file's size next to its sha256 (a load checks sizes with a stat) and the
    manifest's own sha256 (a manifest edited by hand is refused: engines/integrity.py)."""
    sizes = {name: (Path(folder) / name).stat().st_size for name in manifest.get("files", {})}
    text = json.dumps(signed({**manifest, "file_sizes": sizes}), indent=2, sort_keys=True)
    (Path(folder) / MANIFEST).write_text(text + "\n")


def check_files(engine_dir: Path, manifest: dict) -> list[str]:
    """Files the manifest names that are missing or whose hash differs."""
    bad = []
    for name, digest in manifest.get("files", {}).items():
        path = Path(engine_dir) / name
        if not path.exists() or file_sha256(path) != digest:
            bad.append(name)
    return bad


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()

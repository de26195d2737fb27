"""`tandem build-engines`: checkpoint -> engine directory, safely.

    validate checkpoint + options (config time) -> may --out be replaced? -> fingerprint the inputs
    -> up to date? stop -> room to write? -> [temporary sibling] export once -> build engines per
    bucket (reusing unchanged ones) -> run each engine once and compare with the un-lowered graph
    -> copy tokenizer/config -> manifest.json (last) -> rename into place

A failure anywhere removes the temporary directory; an existing engine directory stays as it was.
Only an engine directory or an empty folder is ever replaced (engines/atomic.py), and a build
says why it ran: what changed since the previous one (engines/fingerprint.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from tandem import contract
from tandem.checkpoint import open_checkpoint
from tandem.checkpoint.description import DTYPE_BYTES, description_to_dict
from tandem.checkpoint.summary import summarize
from tandem.engines import buckets as bucket_plan
from tandem.engines.atomic import MARKER, check_replaceable, check_writable, staged_directory, sweep_stale
from tandem.engines.backends import get_builder
from tandem.engines.backends.common import link_or_copy
from tandem.engines.fingerprint import changes, digests, fingerprint, hash_inputs, input_files
from tandem.engines.integrity import verify_engine_dir
from tandem.engines.malloc import return_large_blocks
from tandem.engines.manifest import (
    CHECKPOINT_FILES,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    ManifestError,
    family_chat_formats,
    file_sha256,
    read_manifest,
    signed,
    write_manifest,
)
from tandem.engines.options import BuildOptions, OptionsError
from tandem.engines.progress import Progress
from tandem.engines.verification import compare, fixed_inputs, sampled_rows, timed
from tandem.export.exporter import export_checkpoint

_EXPORT_OPTIONS = ("dtype", "weights", "quant_block", "no_mtp", "page_size", "unified_round",  # change the graphs
                   "index_share", "draft_weights", "decode_steps")
_SAME_TOOLS = ("tandem", "backend", "contract_version")


class BuildError(RuntimeError):
    pass


@dataclass(frozen=True)
class BuildResult:
    engine_dir: Path
    status: str                 # "built" or "up-to-date"
    seconds: float
    size_bytes: int
    rebuilt: list[str] = field(default_factory=list)
    reused: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)  # why it was built: what changed since the last build
    swept: list[str] = field(default_factory=list)    # dead builds' temporary folders cleared from --out's parent


def build_engines(model_dir: str | Path, out: str | Path, options: BuildOptions | None = None,
                  show_progress: bool = True) -> BuildResult:
    start = time.perf_counter()
    options = options or BuildOptions()
    out = Path(out)
    ckpt = open_checkpoint(model_dir, speculative=not options.no_mtp, spec_k=options.spec_k, draft=options.draft)
    desc = ckpt.description
    if options.max_seq_len > desc.max_position_embeddings:
        raise OptionsError(f"--max-seq-len {options.max_seq_len} exceeds the model's max_position_embeddings "
                           f"({desc.max_position_embeddings})")
    backend = get_builder(options.backend)
    sources = {"checkpoint": Path(model_dir), "draft": Path(options.draft) if options.draft else None}
    check_replaceable(out, sources)
    swept = sweep_stale(out.absolute().parent) if out.absolute().parent.is_dir() else []
    previous, no_previous = _previous_manifest(out)
    old = previous.get("fingerprint", {}) if previous else {}
    fp = fingerprint(hash_inputs(input_files(ckpt, CHECKPOINT_FILES), old), options.to_json(), backend.versions())
    damaged = _damaged(out, previous)
    reasons = [no_previous] if previous is None else changes(old, fp) + ([damaged] if damaged else [])
    if not reasons:
        if fp != old:  # same contents, new stats (a copied checkpoint): record them, or every rerun hashes again
            _refresh_fingerprint(out, previous, fp)
        return BuildResult(out, "up-to-date", time.perf_counter() - start, _dir_size(out), swept=swept)

    params = ckpt.parameter_count() + (ckpt.parameter_count(mtp=True) if desc.mtp else 0)
    check_writable(out, need_bytes=int(params * DTYPE_BYTES[options.dtype] * 1.2) + (64 << 20))
    plan = bucket_plan.plan(desc, options)
    reusable = _reusable_engines(previous, old, fp) if not damaged else {}
    with staged_directory(out, sources) as tmp:
        export_dir = tmp / "_export"
        with Progress("export", 1, show_progress) as bar:
            extra = (*bucket_plan.unified_round_kinds(desc, options)[0], *bucket_plan.decode_kinds(options))
            export_checkpoint(ckpt, export_dir, options.export_options(ckpt.draft_parameter_count(), extra))
            ckpt.release()      # the export read every weight: 150M fp32 checkpoint, 0.6 GB of RSS until unmapped
            bar.step()
        for name in {e["file"] for e in reusable.values()} | ({"weights.bin"} if reusable else set()):
            if (out / name).exists():
                link_or_copy(out / name, tmp / name)
        with Progress("build", len(plan), show_progress) as bar:
            files = backend.build(export_dir, tmp, plan, desc=desc, options=options, progress=bar)
        verified, rebuilt, reused = {}, [], []
        return_large_blocks()       # the verification's activations, freed, leave the process (malloc.py)
        checker = backend.Checker(tmp, export_dir)
        # one engine file at a time, so the checker holds few sessions (the ONNX Runtime one: one at a time)
        run_group = getattr(checker, "run_group", None) or (lambda items: [_timed_run(checker, *i) for i in items])
        by_file: dict[str, list] = {}
        for bucket in plan:
            by_file.setdefault(files[bucket.name][0], []).append(bucket)
        with Progress("verify", len(plan), show_progress) as bar:
            for group in by_file.values():
                todo = []
                for bucket in group:
                    kept = reusable.get(bucket.name)
                    if kept and (kept["file"], kept.get("profile", 0)) == files[bucket.name]:
                        verified[bucket.name] = kept["verification"]
                        reused.append(bucket.name)
                        bar.step(bucket.name)
                    else:
                        todo.append((bucket, files[bucket.name], fixed_inputs(desc, bucket, options)))
                # the checker's results first: zip then runs it to its end (a generator closes its session there)
                for (ref, got, seconds), (bucket, _, feeds) in zip(run_group(todo) if todo else [], todo):
                    verified[bucket.name] = compare(ref, got, options.dtype, seconds, sampled_rows(feeds)).to_json()
                    rebuilt.append(bucket.name)
                    bar.step(bucket.name)
        records = [{"name": b.name, "graph": b.graph.name, "role": b.role, "batch": b.batch, "rows": b.rows,
                    "min_rows": b.min_rows or b.rows, "file": files[b.name][0], "profile": files[b.name][1],
                    "verification": verified[b.name]} for b in plan]
        failed = [r["name"] for r in records if not r["verification"]["passed"]]
        if failed:
            raise BuildError(f"{len(failed)} engine(s) disagree with the un-lowered graphs beyond the tolerance: "
                             f"{', '.join(failed)}. Nothing was written; report this with the model's config.json.")
        shutil.rmtree(export_dir)
        for name in CHECKPOINT_FILES:
            if (Path(model_dir) / name).exists():
                shutil.copyfile(Path(model_dir) / name, tmp / name)
        manifest = _manifest(ckpt, options, backend, fp, records, tmp, time.perf_counter() - start)
        write_manifest(tmp, manifest)
    return BuildResult(out, "built", time.perf_counter() - start, _dir_size(out), rebuilt, reused, reasons, swept)


def _timed_run(checker, bucket, engine: tuple[str, int], feeds) -> tuple[dict, dict, float]:
    (reference, got), seconds = timed(lambda: checker.run(bucket, engine, feeds))
    return reference, got, seconds


def _previous_manifest(out: Path) -> tuple[dict | None, str]:
    """(the previous build's manifest, or None with why there is none to compare with)."""
    if not out.is_dir():
        return None, f"no previous build at {out}"
    if not any(out.iterdir()):
        return None, f"no previous build at {out} (an empty folder)"
    try:
        return read_manifest(out), ""
    except ManifestError as e:
        return None, f"previous build has no usable manifest ({e})"


def _refresh_fingerprint(out: Path, previous: dict, fp: dict) -> None:
    """Rewrite manifest.json with the inputs' current stats (temporary file + rename, so a reader
    never sees half a manifest); an engine directory that is not writable keeps the old ones."""
    tmp = out / f".tandem-{MANIFEST}.tmp"
    try:
        tmp.write_text(json.dumps(signed({**previous, "fingerprint": fp}), indent=2, sort_keys=True) + "\n")
        os.replace(tmp, out / MANIFEST)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def _damaged(out: Path, previous: dict | None) -> str | None:
    """Why the previous build's files no longer match its manifest, if they do not."""
    if previous is None:
        return None
    try:
        verify_engine_dir(out, previous)
    except ManifestError as e:
        return f"the previous build's files changed ({e})"
    return None


def _reusable_engines(previous: dict | None, old: dict, new: dict) -> dict[str, dict]:
    """Engines of the previous build (its files intact) that this one can keep: same input
    contents, export options, backend and versions."""
    if not previous:
        return {}
    same = (digests(old) == digests(new) and all(old.get(k) == new[k] for k in _SAME_TOOLS)
            and all(old.get("options", {}).get(k) == new["options"][k] for k in _EXPORT_OPTIONS))
    if not same:
        return {}
    return {e["name"]: e for e in previous.get("engines", []) if e["verification"]["passed"]}


def _manifest(ckpt, options: BuildOptions, backend, fp: dict, records: list[dict], folder: Path,
              seconds: float) -> dict:
    desc = ckpt.description
    files = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MARKER)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "contract_version": contract.CONTRACT_VERSION,
        "tandem_version": fp["tandem"],
        "backend": backend.NAME,
        "versions": backend.versions(),
        "model": summarize(ckpt, None if options.no_mtp else options.spec_k),
        "description": description_to_dict(desc),
        "chat_formats": family_chat_formats(desc.architecture),   # the server's tool-call / reasoning parsing
        "options": options.to_json(),
        "fingerprint": fp,
        "runtime": {"page_size": options.page_size, "max_seq_len": options.max_seq_len,
                    "prefill_chunk": options.prefill_chunk, "batch_sizes": list(options.batch_sizes),
                    "spec_k": None if options.no_mtp else options.spec_k,
                    "verify_widths": list(bucket_plan.verify_widths(options)),
                    "verify_width_per_batch": {str(b): w for b, w in
                                               bucket_plan.verify_width_per_batch(options).items()},
                    "unified_round": _unified_round(desc, options),
                    "decode_steps": options.decode_steps},
        "engines": records,
        "files": {name: file_sha256(folder / name) for name in files},
        "build_seconds": round(seconds, 2),
    }


def _unified_round(desc, options: BuildOptions) -> dict:
    """What the manifest says of the unified round graphs: their head mode and widths, or why none."""
    kinds, reason = bucket_plan.unified_round_kinds(desc, options)
    if not kinds:
        return {"built": False, "reason": reason}
    return {"built": True, "mode": "reused" if kinds[0].reused else "chained",
            "widths": sorted({k.drafts + 1 for k in kinds})}


def _dir_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())

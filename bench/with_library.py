"""An engine dir that differs from another only in its CPU kernel library, for A/B runs of kernel
changes (bench/decode_ab.py, bench/engine_ab.py, bench/bandwidth_bound.py).

    .venv/bin/python bench/with_library.py ENGINE_DIR LIBRARY OUT_DIR

Every file of ENGINE_DIR but the library and the manifest is hard-linked into OUT_DIR (a new
folder), the library copied in, and the manifest's hash and size of it rewritten. Why links, not
copies: two copies of the weights lie on other physical pages, and on a 2-core AMD EPYC (Zen 4)
that alone moved a copy's decode speed against its source by several percent, more than the
kernel changes measured: an int4 prefetch and guided tasks looked 1.02-1.11x faster on copies and
measured 0.94-1.00x with both dirs on the same pages (docs/performance.md). Both dirs
then read one set of pages (the page cache's), so what differs between them is the library.

LIBRARY: a built kernel library, e.g. the path `tandem.plugins.cpu_kernels.library()` returns after
a change to plugins/cpu (it builds the tree's sources into the kernel cache). OUT_DIR must not
exist; on any failure the half-made folder is removed (nothing else is touched).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tandem.engines.manifest import MANIFEST, file_sha256, read_manifest, write_manifest  # noqa: E402
from tandem.plugins import cpu_kernels  # noqa: E402


def with_library(engine_dir: Path, library: Path, out: Path) -> Path:
    engine_dir, library, out = Path(engine_dir), Path(library), Path(out)
    manifest = read_manifest(engine_dir)
    name = cpu_kernels.LIBRARY_FILE
    if name not in manifest.get("files", {}):
        raise SystemExit(f"{engine_dir} carries no kernel library ({name}): nothing to swap")
    if not library.is_file():
        raise SystemExit(f"{library}: no such library file")
    if out.exists():
        raise SystemExit(f"{out} exists: give a new folder (nothing was changed)")
    out.mkdir(parents=True)
    try:
        for path in engine_dir.iterdir():
            if path.name in (name, MANIFEST) or not path.is_file():
                continue
            os.link(path, out / path.name)     # the same inode: the same pages in memory
        shutil.copyfile(library, out / name)
        write_manifest(out, {**manifest, "files": {**manifest["files"], name: file_sha256(out / name)}})
    except BaseException:
        shutil.rmtree(out)
        raise
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine_dir", type=Path)
    parser.add_argument("library", type=Path)
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    try:
        out = with_library(args.engine_dir, args.library, args.out_dir)
    except OSError as e:         # a link across file systems, say
        raise SystemExit(f"cannot make {args.out_dir}: {e} (put it on the engine dir's file system)") from e
    print(out)
    return {"engine_dir": str(out)}


if __name__ == "__main__":
    main()

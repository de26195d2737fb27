"""Export time and graph sizes for a tiny checkpoint and a ~150M-parameter random Qwen3.5.

    .venv/bin/python bench/export.py [--workdir DIR]

Writes the random checkpoints itself (nothing is downloaded).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.checkpoints import checkpoint, workdir  # noqa: E402
from bench.common import machine  # noqa: E402
from tandem.checkpoint import open_checkpoint  # noqa: E402
from tandem.export.exporter import export_checkpoint  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    work = workdir(args.workdir)
    print(f"machine: {machine()}")
    figures = {}
    for kind, dtype in (("qwen3_5_mtp3", "float32"), ("qwen3_5_150m", "bfloat16")):
        src = checkpoint(kind, work, dtype=dtype)
        t = time.perf_counter()
        ckpt = open_checkpoint(src)
        t_open = time.perf_counter() - t
        result = export_checkpoint(ckpt, work / f"{kind}-onnx")
        params = ckpt.parameter_count() + ckpt.parameter_count(mtp=True)
        print(f"\n{kind}: {params / 1e6:.1f}M parameters ({dtype} checkpoint), open+validate {t_open * 1e3:.0f} ms, "
              f"export {result.seconds:.2f} s, weights.bin {result.weights_bytes / 2**20:.1f} MiB (fp32)")
        figures[kind] = {"parameters": params, "open_ms": t_open * 1e3, "export_seconds": result.seconds,
                         "weights_mib": result.weights_bytes / 2**20, "graph_kib": {}}
        for file in result.graphs.values():
            size = (result.folder / file).stat().st_size
            figures[kind]["graph_kib"][file] = size / 1024
            print(f"  {file:<22} {size / 1024:8.1f} KiB graph")
    return figures


if __name__ == "__main__":
    main()

"""Two engine dirs' graph, call by call, interleaved: which one is faster, robust to a noisy machine.

    .venv/bin/python bench/engine_ab.py DIR_A DIR_B [--graph target_step] [--batch 1 8] [--rows 1]
                                        [--context 64] [--calls 300] [--threads N] [--no-kernel-times]

Both dirs must come from the same checkpoint (same contract inputs). For each batch size, opens the
graph of each dir as the pipeline opens it (the saved optimized graph, with the dir's kernel
library) on the process-wide thread pool, feeds both the same inputs (random
pools, scattered pages, every sequence at `--context` committed positions, `--rows` new rows), and
times A and B alternately, call after call, so both see the same machine state. Prints the median
ms per call of each and the ratio of medians A / B (> 1: B faster), and checks that both give the
same outputs (to 1e-4): an engine that is faster but different is not a speed-up. Then, per op of
tandem's CPU kernels, each dir's busy µs per call by its own library's timers (plugins/cpu/kernel_times.cc;
`--no-kernel-times` leaves them off): which kernel a change moved, where the whole call's ratio is
within the machine's noise. A dir without the timers (or both on one library file) shows none.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ and tests/ helpers
from bench.common import machine  # noqa: E402
from tandem import contract as c  # noqa: E402
from tandem.checkpoint.description import description_from_dict  # noqa: E402
from tandem.engines.backends.onnxruntime_backend import open_served, serving_files  # noqa: E402
from tandem.engines.backends.onnxruntime_files import engine_library  # noqa: E402
from tandem.engines.manifest import read_manifest  # noqa: E402
from tandem.plugins import cpu_kernels  # noqa: E402
from tests.paged_driver import PagedState, relaxed_off  # noqa: E402


def engine_file(engine_dir: Path, graph: str, rows: int) -> Path:
    """The graph's lowered engine file; of a per-width graph (verify, round), the one of `rows` rows."""
    files = sorted(f for f in read_manifest(engine_dir)["files"]
                   if f.endswith(".onnx") and not f.endswith(".opt.onnx") and Path(f).stem.split(".")[0] == graph
                   and Path(f).suffixes[:-1] in ([], [f".w{rows}"]))
    if not files:
        raise SystemExit(f"{engine_dir}: no engine file for graph {graph!r}")
    return engine_dir / files[0]


def _served(engine_dir: Path, graph: str, rows: int, threads: int | None):
    """The graph's session as the pipeline opens it: the saved optimized graph (with the engine
    dir's kernel library) where the dir has one for this runtime and CPU, else the lowered graph."""
    name = engine_file(engine_dir, graph, rows).name
    return open_served(engine_dir, serving_files(engine_dir, [name])[name], threads)


def feeds(sess, desc, batch: int, rows: int, context: int, page_size: int) -> dict:
    pages = -(-(context + rows) // page_size)
    state = PagedState(desc, batch, page_size=page_size, pages_per_seq=1 << max(0, pages - 1).bit_length())
    state.lens[:] = context
    rng = np.random.default_rng(0)
    extra = {c.INPUT_IDS: rng.integers(0, desc.vocab_size, (batch, rows)), c.STATE_ROWS: np.full(batch, rows),
             c.LAST_ROW: np.full(batch, rows - 1)}
    names = [i.name for i in sess.get_inputs()]
    f = {**state.feeds(names), **{k: np.asarray(v, np.int64) for k, v in extra.items()}}
    f.update(relaxed_off((batch, rows)))
    f = {k: v for k, v in f.items() if k in names}
    pages = {"num_pages": state.tables.size + 3, "page_size": page_size}     # (PagedState's pools: an MTP head's)
    return {**f, **_rest(sess, f, rng, pages)}


def _rest(sess, given: dict, rng, dims: dict) -> dict:
    """The inputs PagedState does not make (the heads' pools, hidden_in, the grammar mask): random
    tensors / all-allowed masks, their symbolic dims read off the inputs already given (and `dims`)."""
    for i in sess.get_inputs():
        if i.name in given:
            dims.update({d: n for d, n in zip(i.shape, given[i.name].shape) if isinstance(d, str)})
    out = {}
    for i in sess.get_inputs():
        if i.name in given:
            continue
        shape = [dims[d] if isinstance(d, str) else d for d in i.shape]
        if "float" in i.type:
            out[i.name] = rng.standard_normal(shape).astype(np.float32)
        else:   # a bitmask: every bit set, every token allowed
            out[i.name] = np.full(shape, -1, np.int32 if "int32" in i.type else np.int64)
    return out


def _as_declared(x: np.ndarray, shape) -> np.ndarray:
    """x, or x with its last two axes swapped where that is the layout `shape` declares (a state
    pool whose layout changed between the two dirs, e.g. the conv windows [C, K-1] -> [K-1, C]):
    both then compute on the same values."""
    fixed = [(i, d) for i, d in enumerate(shape) if isinstance(d, int)]
    if x.ndim >= 2 and any(x.shape[i] != d for i, d in fixed):
        swapped = x.swapaxes(-1, -2)
        if all(swapped.shape[i] == d for i, d in fixed):
            return np.ascontiguousarray(swapped)
    return x


def kernel_busy(library: Path | None, reset: bool = False) -> dict[str, float]:
    """Op -> busy µs of `library`'s kernels since its timers' last reset ({} without the timers)."""
    if library is None:
        return {}
    try:
        return {op: t["busy_us"] for op, t in cpu_kernels.kernel_times(library, reset=reset).items()}
    except AttributeError:      # a library built before the timers
        return {}


def op_rows(busy_a: dict[str, float], busy_b: dict[str, float], calls: int) -> list[str]:
    """Per op, A's and B's busy µs per call and their ratio A / B (> 1: B's kernel faster), the
    largest first."""
    rows = []
    for op in sorted(busy_a.keys() | busy_b.keys(), key=lambda o: -max(busy_a.get(o, 0.0), busy_b.get(o, 0.0))):
        a, b = busy_a.get(op, 0.0) / calls, busy_b.get(op, 0.0) / calls
        ratio = f"{a / b:.2f}x" if a > 0 and b > 0 else "-"
        rows.append(f"    {op:<22} A {a:9.1f} µs, B {b:9.1f} µs per call, A/B {ratio}")
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir_a", type=Path)
    parser.add_argument("dir_b", type=Path)
    parser.add_argument("--graph", default="target_step")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--threads", type=int, default=None,
                        help="ONNX Runtime threads (default: every core; 1 when another job holds a core)")
    parser.add_argument("--no-kernel-times", dest="kernel_times", action="store_false",
                        help="leave tandem's kernel timers off (no per-op table)")
    args = parser.parse_args(argv)
    if args.kernel_times:   # before any session runs a kernel: the library reads it once
        os.environ.setdefault(cpu_kernels.TIMES_ENV, "1")
    libraries = [engine_library(d) if args.kernel_times else None for d in (args.dir_a, args.dir_b)]
    if libraries[0] is not None and libraries[1] is not None and libraries[0].resolve() == libraries[1].resolve():
        libraries = [None, None]        # one library's timers would count both dirs' calls
    manifest = read_manifest(args.dir_a)
    desc = description_from_dict(manifest["description"])
    page_size = manifest["options"]["page_size"]
    a, b = (_served(d, args.graph, args.rows, args.threads) for d in (args.dir_a, args.dir_b))
    print(f"{machine()}; {args.graph}, {args.rows} row(s), context {args.context}, {args.calls} calls each, "
          f"interleaved\n  A = {args.dir_a}\n  B = {args.dir_b}")
    figures = {"graph": args.graph, "rows": args.rows, "context": args.context, "batches": {}}
    for batch in args.batch:
        # one set of inputs; each session takes the ones it has (an optional input one lacks: the
        # grammar mask, all ones, or relaxed acceptance, off, so both compute the same)
        f = {**feeds(a, desc, batch, args.rows, args.context, page_size),
             **feeds(b, desc, batch, args.rows, args.context, page_size)}
        f_of = {s: {i.name: _as_declared(f[i.name], i.shape) for i in s.get_inputs()} for s in (a, b)}
        out_a, out_b = a.run(None, f_of[a]), b.run(None, f_of[b])
        diff = max(float(np.abs(x.astype(np.float64) - _as_declared(y, x.shape)).max())
                   for x, y in zip(out_a, out_b) if x.size)
        times = {"a": [], "b": []}
        for library in libraries:
            kernel_busy(library, reset=True)
        for i in range(args.calls):
            for key, sess in (("a", a), ("b", b)) if i % 2 else (("b", b), ("a", a)):
                t = time.perf_counter()
                sess.run(None, f_of[sess])
                times[key].append(time.perf_counter() - t)
        ma, mb = (statistics.median(times[k][10:]) * 1e3 for k in "ab")
        print(f"  batch {batch}: A {ma:.3f} ms, B {mb:.3f} ms per call, A/B {ma / mb:.2f}x; "
              f"largest output difference {diff:.1e}" + ("" if diff < 1e-4 else "  <-- outputs differ"))
        busy = [kernel_busy(library) for library in libraries]
        for row in op_rows(*busy, args.calls):
            print(row)
        figures["batches"][batch] = {"a_ms": ma, "b_ms": mb, "a_over_b": ma / mb, "largest_difference": diff,
                                     "op_us_per_call": {side: {op: us / args.calls for op, us in b.items()}
                                                        for side, b in zip("ab", busy)}}
    return figures


if __name__ == "__main__":
    main()

"""bench/engine_ab.py's per-op table: each dir's kernel times come from its own library's timers,
reset before the timed calls, per call."""

from __future__ import annotations

import sys

from tandem.bench import engine_ab
from tandem.bench.with_library import with_library
from tandem.plugins import cpu_kernels


def test_each_dirs_ops_are_read_from_its_own_library(engine_dirs, tmp_path, monkeypatch, capsys):
    """Fake timers: each call of A's graph adds 250 µs of MatMul busy to A's library, each of B's
    1000 µs to B's, so the table must read A 250.0, B 1000.0 µs per call, A/B 0.25x. Reading one
    dir's library for the other, or not resetting the timers before the timed calls (the calls
    before them, and a stale 1e6 µs, would count), fails it."""
    a = engine_dirs["qwen3_5_mtp3"]
    b = with_library(a, a / cpu_kernels.LIBRARY_FILE, tmp_path / "b")
    per_call = {a / cpu_kernels.LIBRARY_FILE: 250.0, b / cpu_kernels.LIBRARY_FILE: 1000.0}
    busy = dict.fromkeys(per_call, 1e6)

    def kernel_times(library, reset=False):
        times = {"MatMul": {"calls": 1, "busy_us": busy[library], "gaps": 0, "gap_us": 0.0}}
        if reset:
            busy[library] = 0.0
        return times

    real_served = engine_ab._served

    def served(engine_dir, graph, rows, threads):
        sess, library = real_served(engine_dir, graph, rows, threads), engine_dir / cpu_kernels.LIBRARY_FILE

        class Timed:     # the session, each run adding its dir's per-call busy time
            def __getattr__(self, name):
                return getattr(sess, name)

            def run(self, *args, **kwargs):
                busy[library] += per_call[library]
                return sess.run(*args, **kwargs)
        return Timed()

    monkeypatch.setattr(cpu_kernels, "kernel_times", kernel_times)
    monkeypatch.setattr(engine_ab, "_served", served)
    monkeypatch.setattr(sys, "argv", ["engine_ab.py", str(a), str(b), "--batch", "1", "--calls", "12"])
    engine_ab.main()
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.strip().startswith("MatMul"))
    assert "A     250.0 µs, B    1000.0 µs per call, A/B 0.25x" in row, out

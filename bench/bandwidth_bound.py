"""Plain decoding against this machine's memory bandwidth, measured in the same run.

    .venv/bin/python bench/bandwidth_bound.py ENGINE_DIR [ENGINE_DIR ...] [--tokens 64] [--rounds 3]
                                              [--gemv-mib 256] [--in-place]

Decoding at batch 1 reads every weight of the target step once per token, so weight bytes x tokens/s
is the bandwidth decoding achieves; the bound is what one large fp32 GEMV reaches in ONNX Runtime on
all threads (a [1, K] x [K, N] MatMul over a `--gemv-mib` weight, far larger than the caches): the
faster of ONNX Runtime's MatMul and, where the build uses it here, tandem's (ai.tandem.cpu::MatMul
over the weight panels; it streams faster than MLAS, so the bound is the better of the two). Per
engine dir: the target step's weight bytes per token (the initializers of the graph it runs, the
saved optimized one; those only gathered from, the embedding table, count one row), decode tokens/s (plain
greedy, batch 1, prompt 32, prefill excluded), and achieved / bound. The machine's memory speed
moves by 1.5-2x within seconds, so decoding (`--tokens` per decode, `--rounds` decodes per dir, the
dirs in turn) is timed in segments of `--segment` tokens (an engine step may take several: a decode
burst), host work included, each divided by the GEMV run just before and just after it (their mean,
one call each); the figure is the median over the segments. Then the same against
ONNX Runtime's GEMV alone (its own MatMul, which tandem's GEMV outruns). The bound for int8 / int4
engines is the same bytes/s: fewer bytes per token should give proportionally more tokens/s.

Where the shortfall is, from tandem's kernel timers (plugins/cpu/kernel_times.cc; on unless
`--no-kernel-times`) over the timed segments: the share of decode time the matmul kernels take,
the share the other kernels take (Gated DeltaNet, attention, norms; the rest is ONNX Runtime's
executor between nodes and the host), and the matmuls' own speed (weight bytes over their busy
time) against the bound. Achieved / bound is about matmul share x matmul speed / bound: the second
factor is what the kernel loses on the model's shapes (calls of 3-94 MiB against the bound's one
call of 256 MiB), the first what the rest of the step costs. "-" where the matmuls are ONNX
Runtime's or the dir's library predates the timers.

Each engine dir is decoded from a fresh copy (a temporary dir, removed at exit; `--in-place` reads it
where it lies), so its weights sit in memory written in this run, as the GEMV's do. The memory a
page lies in can stream slower than freshly written memory: on the sandbox's VM (restored from a
snapshot), a 150M float dir written before the VM was restored decoded at 78% of the bound (76-82%) and
its fresh copy at 90% (86-92%), alternated in one run; the 48 matmuls alone, run over the old file's
pages, a fresh copy's and a file written in one go, streamed at 22.0, 24.8 and 25.3 GB/s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import decode_speed as tokens_per_s  # noqa: E402
from bench.common import interleaved, machine  # noqa: E402
from tandem.engines.backends.onnxruntime_backend import session  # noqa: E402
from tandem.export.cpu_kernel_lowering import CPU_DOMAIN  # noqa: E402
from tandem.export.cpu_matmul_lowering import weight_panels  # noqa: E402
from tandem.pipeline.llm import LLM, RuntimeConfig  # noqa: E402
from tandem.pipeline.sampling_params import SamplingParams  # noqa: E402
from tandem.plugins import cpu_kernels  # noqa: E402

_SIZES = {TensorProto.FLOAT: 4, TensorProto.FLOAT16: 2, TensorProto.UINT16: 2, TensorProto.UINT8: 1,
          TensorProto.INT8: 1, TensorProto.UINT4: 0.5, TensorProto.INT4: 0.5, TensorProto.INT64: 8,
          TensorProto.INT32: 4}   # (UINT16: bfloat16 panels)


def weight_bytes_per_token(engine_dir: Path) -> float:
    """Bytes of the target step's initializers one decode step reads: all of each, except tensors
    only ever gathered from (embedding tables), which give one row. Of the graph the runtime runs:
    the saved optimized one where the build made it (the int4 / int8 kernel's float16 scales are half
    the portable graph's float32 ones), else the exported one."""
    optimized = engine_dir / "target_step.opt.onnx"
    graph = optimized if optimized.is_file() else engine_dir / "target_step.onnx"
    model = onnx.load(str(graph), load_external_data=False)
    consumers: dict[str, set[str]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, set()).add(node.op_type)
    total = 0.0
    for init in model.graph.initializer:
        size = float(np.prod(init.dims)) * _SIZES.get(init.data_type, 4)
        if consumers.get(init.name) == {"Gather"} and len(init.dims) == 2:
            size /= init.dims[0]
        total += size
    return total


class GemvProbe:
    """One large [1, K] x [K, N] float32 GEMV (a `mib` MiB weight, far larger than the caches) on
    ONNX Runtime's MatMul and, with `kernels` (the library), on tandem's over the same weights as
    panels; sessions made once, so the bound can be measured right before and after each decode."""

    def __init__(self, mib: int, kernels: Path | None):
        k = 4096
        n = mib * 2**20 // (4 * k)
        w = np.random.default_rng(0).standard_normal((k, n), dtype=np.float32)
        self.nbytes, self.x = w.nbytes, {"x": np.ones((1, k), np.float32)}
        self.sessions = {"onnxruntime": session(self._model(w, None))}
        if kernels is not None:
            self.sessions["tandem"] = session(self._model(w, kernels), kernels=kernels)
        for sess in self.sessions.values():
            for _ in range(3):
                sess.run(None, self.x)

    @staticmethod
    def _model(w: np.ndarray, kernels: Path | None) -> onnx.ModelProto:
        k, n = w.shape
        attrs, opsets = ({"domain": CPU_DOMAIN, "N": n}, [helper.make_opsetid(CPU_DOMAIN, 1)]) if kernels else ({}, [])
        graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], **attrs)], "gemv",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
                                  [numpy_helper.from_array(weight_panels(w) if kernels else w, "w")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), *opsets])
        model.ir_version = 10
        return model

    def measure(self, calls: int = 20) -> dict[str, float]:
        """Bytes/s each GEMV reads now, median over `calls` calls."""
        speeds = {}
        for name, sess in self.sessions.items():
            times = []
            for _ in range(calls):
                t = time.perf_counter()
                sess.run(None, self.x)
                times.append(time.perf_counter() - t)
            speeds[name] = self.nbytes / statistics.median(times)
        return speeds

    def bound(self) -> tuple[float, float]:
        """Bytes/s now (one call each) of the faster GEMV, and of ONNX Runtime's (its own MatMul,
        which tandem's GEMV outruns)."""
        speeds = self.measure(calls=1)
        return max(speeds.values()), speeds["onnxruntime"]


def decode_speed(llm: LLM, tokens: int) -> float:
    """Tokens/s of one plain greedy decode at batch 1 (32-token prompt; the first token not counted)."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, speculative=False)
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, llm.desc.vocab_size, 32)]
    return tokens_per_s(llm.generate([prompt], params))


MATMUL_OPS = ("MatMul", "MatMulNBits")      # tandem's matmul kernels (float32 / bf16, int8 / int4)


class Segment(NamedTuple):
    """A run of decode tokens between two GEMVs: seconds per token; the bound and ONNX Runtime's
    GEMV (bytes/s, the mean of right before and right after); per token, the busy seconds of
    tandem's matmul kernels and of its other kernels (0 without the timers)."""
    seconds_per_token: float
    bound: float
    onnxruntime: float
    matmul_per_token: float
    other_per_token: float


def _busy(kernels: Path | None) -> tuple[float, float]:
    """Seconds tandem's matmul kernels and its other kernels have been busy, per the timers of the
    library the engine dir's sessions loaded (0, 0 without one)."""
    if kernels is None:
        return 0.0, 0.0
    times = cpu_kernels.kernel_times(kernels)
    matmul = sum(t["busy_us"] for op, t in times.items() if op in MATMUL_OPS)
    return matmul / 1e6, sum(t["busy_us"] for t in times.values()) / 1e6 - matmul / 1e6


def decode_steps(llm: LLM, tokens: int, probe: GemvProbe, segment: int,
                 kernels: Path | None = None) -> tuple[float, list[Segment]]:
    """One plain decode at batch 1 in segments of at least `segment` tokens, a bound measured right
    before and right after each: (tokens/s, the segments). An engine step may take several tokens (a
    decode burst), so segments count tokens, not steps. A GEMV evicts the caches, so the first token
    after one starts colder than decoding does; a segment of 8 dilutes that to 1/8. `kernels`: the
    library whose timers to read around each segment (the GEMVs between segments are left out)."""
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=tokens + 1, ignore_eos=True, speculative=False)
    seq = llm.add_request([int(t) for t in rng.integers(3, llm.desc.vocab_size, 32)], params)
    while seq.num_generated == 0:                  # the prefill and first token: not timed
        llm.step()
    segments, before, total, made = [], probe.bound(), 0.0, 0
    while seq.finish_reason is None:
        busy = _busy(kernels)
        t, start = time.perf_counter(), seq.num_generated
        while seq.finish_reason is None and seq.num_generated - start < segment:
            llm.step()
        dt, n = time.perf_counter() - t, seq.num_generated - start
        matmul, other = (b - a for a, b in zip(busy, _busy(kernels)))
        after = probe.bound()
        segments.append(Segment(dt / n, (before[0] + after[0]) / 2, (before[1] + after[1]) / 2, matmul / n, other / n))
        before, total, made = after, total + dt, made + n
    return made / total, segments


def timers_of(llm: LLM) -> Path | None:
    """The library whose kernel timers cover the dir's matmuls: its sessions', where tandem's kernels
    run and the library has timers (and the timers are on); else None."""
    library = llm.runner.runner.host_kernels
    if library is None or os.environ.get(cpu_kernels.TIMES_ENV) != "1":
        return None
    try:
        cpu_kernels.kernel_times(library)
    except AttributeError:                  # built before the timers
        return None
    return library


def shares(segments: list[Segment], bytes_per_token: float) -> str:
    """'matmul share | other kernels' share | matmul speed / bound', medians over the segments;
    dashes where the timers saw no matmul (ONNX Runtime's MatMuls, or no timers)."""
    timed = [seg for seg in segments if seg.matmul_per_token > 0]
    if not timed:
        return "- | - | -"
    matmul = statistics.median(seg.matmul_per_token / seg.seconds_per_token for seg in timed)
    other = statistics.median(seg.other_per_token / seg.seconds_per_token for seg in timed)
    speed = statistics.median(bytes_per_token / seg.matmul_per_token / seg.bound for seg in timed)
    return f"{matmul:.0%} | {other:.0%} | {speed:.0%}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine_dirs", type=Path, nargs="+")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gemv-mib", type=int, default=256)
    parser.add_argument("--segment", type=int, default=8, help="decode tokens (at least) between two GEMVs")
    parser.add_argument("--in-place", action="store_true",
                        help="decode each engine dir where it lies instead of from a fresh copy")
    parser.add_argument("--no-kernel-times", dest="kernel_times", action="store_false",
                        help="leave tandem's kernel timers off (no shares columns)")
    args = parser.parse_args(argv)
    if args.kernel_times:
        os.environ[cpu_kernels.TIMES_ENV] = "1"     # read when the process first runs a kernel
    with tempfile.TemporaryDirectory(prefix="tandem-bandwidth-") as scratch:
        dirs = args.engine_dirs if args.in_place else [
            Path(shutil.copytree(d, Path(scratch) / f"{i}-{d.name}")) for i, d in enumerate(args.engine_dirs)]
        return measure(dict(zip(args.engine_dirs, dirs)), args)


def measure(dirs: dict[Path, Path], args: argparse.Namespace) -> dict:
    """Decode each engine dir (named by its key, read from its value) against the GEMV bound: the
    figures printed, per dir and of the bound."""
    llms = {d: LLM(at, RuntimeConfig(speculative=False)) for d, at in dirs.items()}
    probe = GemvProbe(args.gemv_mib, cpu_kernels.library() if cpu_kernels.f32_matmul() else None)
    timers = {d: timers_of(llm) for d, llm in llms.items()}
    for d, llm in llms.items():
        decode_steps(llm, 8, probe, args.segment, timers[d])   # warm-up: sessions, bindings
    print(f"machine: {machine()}; onnxruntime {ort.__version__}; plain decoding, batch 1, {args.tokens} tokens")
    got = interleaved({d: lambda _, d=d, llm=llm: decode_steps(llm, args.tokens, probe, args.segment, timers[d])
                       for d, llm in llms.items()}, args.rounds)
    speeds = {d: [speed for speed, _ in runs] for d, runs in got.items()}
    segments = {d: [seg for _, steps in runs for seg in steps] for d, runs in got.items()}
    bounds = [seg.bound for steps in segments.values() for seg in steps]
    gemvs = probe.measure()
    print(f"GEMV bound: {statistics.median(bounds) / 1e9:.1f} GB/s (median over {len(bounds)} segments; "
          f"{min(bounds) / 1e9:.1f}-{max(bounds) / 1e9:.1f}); at the end " + ", ".join(
              f"{name}'s GEMV {g / 1e9:.1f}" for name, g in gemvs.items()))
    print("engine dir | weight MiB per token | tokens/s | bound tokens/s | achieved / bound (median segment; "
          "quartiles) | achieved / ONNX Runtime's GEMV | matmul kernels' share of decode time | other "
          "kernels' share | matmuls' speed / bound")
    figures = {"bound_gb_s": statistics.median(bounds) / 1e9,
               "bound_range_gb_s": [min(bounds) / 1e9, max(bounds) / 1e9],
               "gemv_at_end_gb_s": {name: g / 1e9 for name, g in gemvs.items()}, "dirs": {}}
    for d, steps in segments.items():
        per_token = weight_bytes_per_token(d)
        q1, q2, q3 = statistics.quantiles([per_token / seg.seconds_per_token / seg.bound for seg in steps], n=4)
        row = {"weight_mib_per_token": per_token / 2**20, "tokens_per_s": statistics.median(speeds[d]),
               "bound_tokens_per_s": statistics.median(bounds) / per_token, "achieved_over_bound": q2,
               "achieved_over_bound_quartiles": [q1, q3],
               "achieved_over_onnxruntime": statistics.median(per_token / seg.seconds_per_token / seg.onnxruntime
                                                              for seg in steps),
               "shares": shares(steps, per_token)}
        figures["dirs"][str(d)] = row
        print(f"{d} | {row['weight_mib_per_token']:.1f} | {row['tokens_per_s']:.1f} | "
              f"{row['bound_tokens_per_s']:.1f} | {q2:.0%} ({q1:.0%}-{q3:.0%}) | "
              f"{row['achieved_over_onnxruntime']:.0%} | {row['shares']}")
    return figures


if __name__ == "__main__":
    main()

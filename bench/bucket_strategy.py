"""ONNX Runtime bucket strategy: one optimised static-shape model per (batch, width) bucket vs one
dynamic model bound per bucket with preallocated buffers (IOBinding). Prints load time and
per-call latency for both.

    .venv/bin/python bench/bucket_strategy.py [--kind qwen3_5_150m] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.checkpoints import checkpoint, workdir  # noqa: E402
from bench.common import machine, timeit  # noqa: E402
from tandem import contract as c  # noqa: E402
from tandem.checkpoint import open_checkpoint  # noqa: E402
from tandem.export.exporter import export_checkpoint  # noqa: E402
from tandem.export.lowering import lower_for_onnxruntime  # noqa: E402
from tandem.graph_kinds import TARGET_STEP, VERIFY_GREEDY  # noqa: E402


def feeds_for(desc, sess, batch, rows, ctx=256, page=16):
    pages = ctx // page + 1
    dims = {"num_pages": batch * pages + 1, "page_size": page, "num_slots": batch}
    f = {c.INPUT_IDS: np.ones((batch, rows), np.int64), c.CONTEXT_LENS: np.full(batch, ctx, np.int64),
         c.BLOCK_TABLES: np.arange(batch * pages, dtype=np.int64).reshape(batch, pages),
         c.STATE_ROWS: np.full(batch, rows, np.int64), c.STATE_SLOTS: np.arange(batch, dtype=np.int64)}
    for spec in c.graph_io(desc, TARGET_STEP)[0]:  # the pools, zero, in the contract's shapes
        if spec.shape[0] in dims:
            f[spec.name] = np.zeros(tuple(dims.get(d, d) for d in spec.shape), spec.dtype)
    for i in sess.get_inputs():  # the rest (the verify's flags, want_logprobs): zeros, batch and rows filled in
        if i.name not in f:
            shape = [batch if d == "batch" else rows if d in ("rows", "width") else d if isinstance(d, int) else 1
                     for d in i.shape]
            f[i.name] = np.zeros(shape, {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": bool}
                                 .get(i.type, np.float32))
    names = {i.name for i in sess.get_inputs()}
    return {k: v for k, v in f.items() if k in names}


def options(level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL, save_to=None):
    o = ort.SessionOptions()
    o.graph_optimization_level = level
    o.intra_op_num_threads = 2
    o.log_severity_level = 3
    if save_to:
        o.optimized_model_filepath = str(save_to)
        o.add_session_config_entry("session.optimized_model_external_initializers_file_name", save_to.name + ".data")
        o.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    return o


def fix_shapes(model: onnx.ModelProto, batch: int, rows: int) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for inp in out.graph.input:
        for d in inp.type.tensor_type.shape.dim:
            if d.dim_param == "batch":
                d.dim_value = batch
            elif d.dim_param == "rows":
                d.dim_value = rows
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="qwen3_5_150m")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    work = workdir(args.workdir, prefix="tandem-bucket-")
    src = checkpoint(args.kind, work, dtype="bfloat16")
    ckpt = open_checkpoint(src)
    exp = work / f"{args.kind}-onnx"
    if not (exp / "export.json").exists():
        export_checkpoint(ckpt, exp)
    print(f"machine: {machine()}; onnxruntime {ort.__version__}; {args.kind}")
    print(f"{'graph':<14}{'B':>3}{'W':>3}  {'static: build+save s':>21} {'load s':>7} {'call ms (p90)':>16}"
          f"  {'dynamic: load s':>16} {'call ms (p90)':>16}")
    dynamic_cache, table = {}, []
    for graph, rows in ((TARGET_STEP.name, 1), (VERIFY_GREEDY.name, 4)):
        base = onnx.load(str(exp / f"{graph}.onnx"), load_external_data=False)
        lowered = lower_for_onnxruntime(base, rows=rows)
        lowered_path = exp / f"{graph}.lowered{rows}.onnx"
        onnx.save(lowered, str(lowered_path))
        for batch in (1, 8):
            t = time.perf_counter()
            static_path = exp / f"{graph}.b{batch}w{rows}.opt.onnx"
            fixed = exp / f"{graph}.b{batch}w{rows}.fixed.onnx"
            onnx.save(fix_shapes(lowered, batch, rows), str(fixed))
            ort.InferenceSession(str(fixed), options(save_to=static_path), providers=["CPUExecutionProvider"])
            t_build = time.perf_counter() - t
            t = time.perf_counter()
            static = ort.InferenceSession(str(static_path), options(ort.GraphOptimizationLevel.ORT_DISABLE_ALL),
                                          providers=["CPUExecutionProvider"])
            t_load_static = time.perf_counter() - t
            t = time.perf_counter()
            if graph not in dynamic_cache:
                dynamic_cache[graph] = ort.InferenceSession(str(lowered_path), options(),
                                                            providers=["CPUExecutionProvider"])
            t_load_dyn = time.perf_counter() - t
            dyn = dynamic_cache[graph]
            results = []
            for sess in (static, dyn):
                feeds = feeds_for(ckpt.description, sess, batch, rows)
                binding = sess.io_binding()
                for k, v in feeds.items():
                    binding.bind_cpu_input(k, v)
                for o in sess.get_outputs():
                    binding.bind_output(o.name)
                results.append(timeit(lambda s=sess, b=binding: s.run_with_iobinding(b), warmup=3, runs=15))
            table.append({"graph": graph, "batch": batch, "width": rows, "static_build_s": t_build,
                          "static_load_s": t_load_static, "static_call_ms": results[0], "dynamic_load_s": t_load_dyn,
                          "dynamic_call_ms": results[1]})
            print(f"{graph:<14}{batch:>3}{rows:>3}  {t_build:>21.2f} {t_load_static:>7.2f} "
                  f"{results[0][0]:>9.2f} ({results[0][1]:5.2f})  {t_load_dyn:>16.2f} "
                  f"{results[1][0]:>9.2f} ({results[1][1]:5.2f})")
    return {"kind": args.kind, "rows": table}


if __name__ == "__main__":
    main()

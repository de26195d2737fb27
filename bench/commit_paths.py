"""How to commit accepted rows into a pool on ONNX Runtime's CPU provider: the candidates, timed.

    numpy      pool[dst_rows] = out[src_rows], on the very buffers ONNX Runtime reads (HostMemory.scatter)
    ort-graph  a commit graph, Gather(out, src_rows) -> ScatterND(pool, dst_rows) -> pool', whose
               output is bound to the pool's own buffer (in place when ONNX Runtime sees the alias)

Per commit of N rows (batch x width) into a pool of R rows, for two pool sizes: a time that grows
with R means a pool-sized copy. Also checks each candidate wrote the same bytes.

    .venv/bin/python bench/commit_paths.py [--rows 32] [--row 256] [--repeat 300]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from tandem.engines.backends.memory import HostMemory


def commit_graph(row: int, dtype=TensorProto.FLOAT) -> onnx.ModelProto:
    nodes = [helper.make_node("Gather", ["src", "src_rows"], ["rows"], axis=0),
             helper.make_node("Unsqueeze", ["dst_rows", "axis"], ["dst"]),
             helper.make_node("ScatterND", ["pool", "dst", "rows"], ["pool_out"])]
    graph = helper.make_graph(
        nodes, "commit",
        [helper.make_tensor_value_info("pool", dtype, ["R", row]),
         helper.make_tensor_value_info("src", dtype, ["S", row]),
         helper.make_tensor_value_info("dst_rows", TensorProto.INT64, ["N"]),
         helper.make_tensor_value_info("src_rows", TensorProto.INT64, ["N"])],
        [helper.make_tensor_value_info("pool_out", dtype, ["R", row])],
        [helper.make_tensor("axis", TensorProto.INT64, [1], [-1])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def time_it(fn, repeat: int, batches: int = 7) -> float:
    """Microseconds per call: the best of `batches` batches (the least disturbed by other load)."""
    fn()
    best = float("inf")
    for _ in range(batches):
        t = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, time.perf_counter() - t)
    return best / repeat * 1e6


def measure(pool_rows: int, rows: int, row: int, repeat: int) -> dict:
    rng = np.random.default_rng(0)
    memory = HostMemory()
    pool = memory.allocate("pool", (pool_rows, row), np.float32)
    pool2 = memory.allocate("pool2", (pool_rows, row), np.float32)
    src = rng.standard_normal((rows, row)).astype(np.float32)
    dst_rows = rng.choice(pool_rows, rows, replace=False).astype(np.int64)
    src_rows = np.arange(rows, dtype=np.int64)
    numpy_us = time_it(lambda: memory.scatter(pool, 1, dst_rows, src, 1, src_rows), repeat)

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(commit_graph(row).SerializeToString(), opts, providers=["CPUExecutionProvider"])
    io = sess.io_binding()
    for name, arr in (("pool", pool2), ("src", src), ("dst_rows", dst_rows), ("src_rows", src_rows)):
        io.bind_input(name, "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)
    io.bind_output("pool_out", "cpu", 0, pool2.dtype, pool2.shape, pool2.ctypes.data)   # the pool's own buffer
    graph_us = time_it(lambda: sess.run_with_iobinding(io), repeat)
    return {"pool_MiB": pool.nbytes / 2**20, "numpy_us": numpy_us, "ort_graph_us": graph_us,
            "same_bytes": pool.tobytes() == pool2.tobytes()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32, help="rows per commit (batch 8 x width 4)")
    ap.add_argument("--row", type=int, default=256, help="floats per row (2 KV heads x 128)")
    ap.add_argument("--repeat", type=int, default=300)
    args = ap.parse_args(argv)
    results = []
    for pool_rows in (1 << 14, 1 << 17):
        r = measure(pool_rows, args.rows, args.row, args.repeat)
        results.append({"pool_rows": pool_rows, **r})
        print(f"pool {r['pool_MiB']:7.1f} MiB  {args.rows} rows x {args.row}: numpy {r['numpy_us']:7.1f} us   "
              f"ORT commit graph {r['ort_graph_us']:8.1f} us   same bytes: {r['same_bytes']}")
    return {"rows": args.rows, "row": args.row, "pools": results}


if __name__ == "__main__":
    main()

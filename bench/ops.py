"""Per-op ONNX Runtime CPU timings: each `ai.tandem` op's function body vs its lowering.

    .venv/bin/python bench/ops.py

Prints median / p90 ms per call; the ratio column is body / lowered (> 1: lowering faster).
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import numpy as np
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ and tests/ helpers
from bench.common import machine, timeit  # noqa: E402
from tandem.export.lowering import lower_for_onnxruntime  # noqa: E402
from tandem.export.ops import gated_deltanet, paged_sparse_attention  # noqa: E402
from tests.op_harness import single_op_model  # noqa: E402


def session(model, threads: int):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def gdn_case(b, w, hk, hv, d, emit):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((b, w, hk, d)).astype(np.float32)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k = q.copy()
    v = rng.standard_normal((b, w, hv, d)).astype(np.float32)
    g = -rng.uniform(0.01, 1, (b, w, hv)).astype(np.float32)
    beta = rng.uniform(0, 1, (b, w, hv)).astype(np.float32)
    s0 = rng.standard_normal((b, hv, d, d)).astype(np.float32)
    inputs = [q, k, v, g, beta, s0, np.full(b, w, np.int64)]
    model = single_op_model(gated_deltanet.make_function(emit), "GatedDeltaNet", inputs, [4, 4, 5] if emit else [4, 4],
                            scale=d ** -0.5, num_key_heads=hk, num_value_heads=hv)
    return model, inputs


def main(argv: list[str] | None = None) -> dict:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    threads = 2
    figures = {"gated_deltanet": [], "gated_deltanet_prefill": [], "paged_sparse_attention": []}
    print(f"machine: {machine()}; onnxruntime {ort.__version__}, {threads} threads")
    print("\nGatedDeltaNet (dk = dv = 128)                  body ms (p90)     lowered ms (p90)   body/lowered")
    for hk, hv in ((4, 8), (16, 32)):
        for b, w, emit in ((1, 1, False), (8, 1, False), (1, 4, True), (8, 4, True), (1, 64, False)):
            model, inputs = gdn_case(b, w, hk, hv, 128, emit)
            feeds = {f"in{j}": a for j, a in enumerate(inputs)}
            body = session(model, threads)
            low = session(lower_for_onnxruntime(model, rows=w if emit else None), threads)
            tb = timeit(partial(body.run, None, feeds))
            tl = timeit(partial(low.run, None, feeds))
            label = f"Hk={hk:2d} Hv={hv:2d} B={b} W={w:2d}" + (" row states" if emit else "")
            print(f"  {label:<44} {tb[0]:7.3f} ({tb[1]:6.3f})  {tl[0]:7.3f} ({tl[1]:6.3f})   {tb[0] / tl[0]:5.2f}x")
            figures["gated_deltanet"].append({"case": label, "body_ms": tb, "lowered_ms": tl})
    print("\nGatedDeltaNet prefill, recurrent body vs chunked body (C=64) vs lowered       ms (p90)")
    for hk, hv in ((4, 8), (16, 32)):
        for w in (64, 256):
            model, inputs = gdn_case(1, w, hk, hv, 128, False)
            feeds = {f"in{j}": a for j, a in enumerate(inputs)}
            chunked = model.__class__()
            chunked.CopyFrom(model)
            del chunked.functions[:]
            chunked.functions.append(gated_deltanet.make_function(chunk_size=64))
            times = [timeit(partial(session(m, threads).run, None, feeds), runs=10)
                     for m in (model, chunked, lower_for_onnxruntime(model))]
            print(f"  Hk={hk:2d} Hv={hv:2d} B=1 W={w:3d}   recurrent {times[0][0]:8.2f} ({times[0][1]:7.2f})   "
                  f"chunked {times[1][0]:7.2f} ({times[1][1]:7.2f})   lowered {times[2][0]:6.2f} ({times[2][1]:6.2f})")
            figures["gated_deltanet_prefill"].append({"case": f"Hk={hk} Hv={hv} B=1 W={w}", "recurrent_ms": times[0],
                                                      "chunked_ms": times[1], "lowered_ms": times[2]})
    print("\nPagedSparseAttention, function body (Hq=8, Hkv=2, D=128, page 16)   ms (p90)")
    rng = np.random.default_rng(0)
    for b, w, ctx in ((1, 1, 512), (1, 4, 512), (8, 1, 512), (8, 4, 512), (1, 1, 4096), (1, 64, 0)):
        pages = max(1, -(-ctx // 16))
        kc = rng.standard_normal((b * pages + 1, 16, 2, 128)).astype(np.float32)
        inputs = [rng.standard_normal((b, w, 8, 128)).astype(np.float32),
                  rng.standard_normal((b, w, 2, 128)).astype(np.float32),
                  rng.standard_normal((b, w, 2, 128)).astype(np.float32), kc, kc.copy(),
                  np.arange(b * pages, dtype=np.int64).reshape(b, pages), np.full(b, ctx, np.int64),
                  np.zeros((1, 1, 0), np.int64)]
        model = single_op_model(paged_sparse_attention.make_function(), "PagedSparseAttention", inputs, [4],
                                scale=128 ** -0.5, sliding_window=0)
        sess = session(model, threads)
        feeds = {f"in{j}": a for j, a in enumerate(inputs)}
        t = timeit(partial(sess.run, None, feeds))
        print(f"  B={b} W={w:2d} context={ctx:5d}                                     {t[0]:7.3f} ({t[1]:6.3f})")
        figures["paged_sparse_attention"].append({"case": f"B={b} W={w} context={ctx}", "body_ms": t})
    return figures


if __name__ == "__main__":
    main()

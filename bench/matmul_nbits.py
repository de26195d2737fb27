"""tandem's int4 / int8 matmul kernel (ai.tandem.cpu::MatMulNBits) and its float32 one
(ai.tandem.cpu::MatMul, --bits 32) against ONNX Runtime's (MLAS), node by node, with weights
streamed from memory as in a decode step.

    .venv/bin/python bench/matmul_nbits.py [--shapes 768x3088,1024x768,768x4096,2048x768,768x32000]
                                           [--bits 4|8|32] [--rows 1 4] [--mib 48] [--rounds 7]

Per K x N shape: a graph of as many such nodes as make --mib MiB of packed weights (each its own
random weights, so they come from memory, not the caches: the engine's 49 matmuls of the 150M
int4 model are 72 MiB), every node reading the same input rows; once with tandem's op, once with
ONNX Runtime's at accuracy level 4 (int8 activations: the same math); with --bits 32 float32
MatMuls, tandem's reading the weight panels the build writes, ONNX Runtime's its own packed copy.
Both run on the process-wide thread pool the engines use, timed alternately --rounds times (5 runs
each, best kept: the machine is shared). Prints ms per graph, the packed weights' GB/s and
MLAS / tandem (> 1: tandem faster).
The engine-level figures (`bench/engine_ab.py`, docs/performance.md) are what decided the lowering.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine  # noqa: E402
from tandem.engines.backends.onnxruntime_backend import session  # noqa: E402
from tandem.export.builder import MS_DOMAIN  # noqa: E402
from tandem.export.cpu_kernel_lowering import CPU_DOMAIN  # noqa: E402
from tandem.export.cpu_matmul_lowering import bf16_bits, weight_panels  # noqa: E402
from tandem.export.nbits_tiles import tile_weights  # noqa: E402
from tandem.export.quantize import Bf16Weights, half_scales  # noqa: E402
from tandem.plugins import cpu_kernels  # noqa: E402

BLOCK = 32


def graph(domain: str, K: int, N: int, bits: int, nodes: int, seed: int = 0):
    """`nodes` MatMulNBits over the same input A [M, K], each with its own random weights in
    MatMulNBits' layout (4 bits: asymmetric with zero points, as tandem's int4; 8 bits: none)."""
    rng = np.random.default_rng(seed)
    nb, inits, ops, outs = K // BLOCK, [], [], []
    for i in range(nodes):
        q = rng.integers(0, 2**bits, size=(N, nb, BLOCK), dtype=np.uint8)
        packed = q if bits == 8 else (q[..., 0::2] | (q[..., 1::2] << 4))
        scales = half_scales(rng.random(N * nb, dtype=np.float32) * 0.02)
        zeros = rng.integers(0, 256, N * ((nb + 1) // 2), dtype=np.uint8) if bits == 4 else None
        weights = tile_weights(packed, scales, zeros, N, K, bits, BLOCK) if domain == CPU_DOMAIN else \
            (packed, scales, zeros)
        ins = ["A", f"B{i}", f"s{i}", f"z{i}"][: 3 if zeros is None else 4]
        inits += [numpy_helper.from_array(w, name) for w, name in zip(weights, ins[1:])]
        extra = {"accuracy_level": 4} if domain == MS_DOMAIN else {}
        ops.append(helper.make_node("MatMulNBits", ins, [f"Y{i}"], domain=domain, K=K, N=N, bits=bits,
                                    block_size=BLOCK, **extra))
        outs.append(helper.make_tensor_value_info(f"Y{i}", TensorProto.FLOAT, ["M", N]))
    g = helper.make_graph(ops, "mm", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", K])], outs, inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(domain, 1)])
    model.ir_version = 10
    return model, nodes * N * nb * BLOCK * bits // 8


def float_graph(domain: str, K: int, N: int, nodes: int, seed: int = 0, bf16: bool = False):
    """`nodes` float32 MatMuls over the same input A [M, K], each with its own random weights:
    ONNX Runtime's (domain "") or tandem's (its B the weight panels; bf16: as bfloat16, the weights
    rounded to it for both)."""
    rng = np.random.default_rng(seed)
    inits, ops, outs = [], [], []
    for i in range(nodes):
        w = rng.standard_normal((K, N), dtype=np.float32) * 0.02
        w = Bf16Weights.round(w) if bf16 else w
        panels = bf16_bits(weight_panels(w)) if bf16 else weight_panels(w)
        inits.append(numpy_helper.from_array(panels if domain else w, f"B{i}"))
        attrs = ({"N": N, "bf16": 1} if bf16 else {"N": N}) if domain else {}
        ops.append(helper.make_node("MatMul", ["A", f"B{i}"], [f"Y{i}"], domain=domain, **attrs))
        outs.append(helper.make_tensor_value_info(f"Y{i}", TensorProto.FLOAT, ["M", N]))
    g = helper.make_graph(ops, "mm", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", K])], outs, inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)] + ([helper.make_opsetid(domain, 1)]
                                                                                 if domain else []))
    model.ir_version = 10
    return model, nodes * K * N * (2 if bf16 else 4)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="768x3088,1024x768,768x4096,2048x768,768x32000")
    parser.add_argument("--bits", type=int, default=4, choices=(4, 8, 16, 32),
                        help="16: tandem's float kernel over bfloat16 panels (MLAS: float32 weights)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--mib", type=float, default=48.0)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    library = cpu_kernels.library()
    if library is None:
        raise SystemExit("tandem's CPU kernels are not built here (no C++ compiler, or TANDEM_CPU_KERNELS=0)")
    fast = cpu_kernels.f32_matmul() if args.bits >= 16 else cpu_kernels.nbits_matmul()
    print(f"{machine()}; {args.bits}-bit, block {BLOCK}; tandem's kernel: "
          f"{'AVX-512' if fast else 'portable loop (the build would not use it here)'}")
    table = []
    for shape in args.shapes.split(","):
        K, N = (int(v) for v in shape.split("x"))
        per_node = N * K * args.bits // 8
        nodes = max(1, round(args.mib * 2**20 / per_node))
        if args.bits >= 16:
            bf16 = args.bits == 16
            (ours, nbytes), (theirs, _) = float_graph(CPU_DOMAIN, K, N, nodes, bf16=bf16), \
                float_graph("", K, N, nodes, bf16=bf16)
        else:
            ours, nbytes = graph(CPU_DOMAIN, K, N, args.bits, nodes)
            theirs, _ = graph(MS_DOMAIN, K, N, args.bits, nodes)
        sessions = {"tandem": session(ours, kernels=library), "mlas": session(theirs)}
        for rows in args.rows:
            a = {"A": np.random.default_rng(1).standard_normal((rows, K)).astype(np.float32)}
            best = dict.fromkeys(sessions, float("inf"))
            for r in range(args.rounds):
                for name in (sessions if r % 2 else reversed(list(sessions))):
                    sessions[name].run(None, a)
                    t = time.perf_counter()
                    for _ in range(5):
                        sessions[name].run(None, a)
                    best[name] = min(best[name], (time.perf_counter() - t) / 5)
            print(f"  K {K} x N {N}, {nodes} nodes ({nbytes / 2**20:.0f} MiB), {rows} row(s): "
                  f"tandem {best['tandem'] * 1e3:.2f} ms ({nbytes / best['tandem'] / 1e9:.1f} GB/s), "
                  f"mlas {best['mlas'] * 1e3:.2f} ms ({nbytes / best['mlas'] / 1e9:.1f} GB/s), "
                  f"mlas / tandem {best['mlas'] / best['tandem']:.2f}x")
            table.append({"K": K, "N": N, "nodes": nodes, "mib": nbytes / 2**20, "rows": rows,
                          "tandem_ms": best["tandem"] * 1e3, "mlas_ms": best["mlas"] * 1e3,
                          "mlas_over_tandem": best["mlas"] / best["tandem"]})
    return {"bits": args.bits, "results": table}


if __name__ == "__main__":
    main()

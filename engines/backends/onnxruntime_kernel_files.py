"""The engine dir's side of tandem's CPU kernels (plugins/cpu_kernels.py): which graphs the build
optimizes for the CPU provider, the library the dir carries, and whether it loads here.

    engine dir/
      <graph>.onnx        lowered graph: ONNX Runtime's kernels (the CUDA provider's input, the fallback)
      <graph>.opt.onnx    optimized from a second lowering on tandem's kernels, where one applies;
                          its MatMulNBits and its constant-weight float MatMuls on tandem's
                          matmul kernels, where they run fast here (their weight panels in
                          optimized.bin)
      cpu_kernels.so      the library those graphs load (only where some graph uses it)
"""

from __future__ import annotations

import shutil
from pathlib import Path

import onnx

from tandem.engines.backends.onnxruntime_optimized import save_optimized
from tandem.plugins import cpu_kernels


def save_served_graphs(export_dir: Path, out_dir: Path, graphs: dict[str, tuple[str, int | None]], options,
                       bf16: bool = False) -> None:
    """The saved optimized graph of every engine file (graphs: file -> (exported graph, rows)):
    optimized from the lowering on tandem's kernels where the library compiles here and the graph
    has an op it lowers, else from the engine file itself; then its int4 / int8 MatMulNBits (which the
    optimizer makes) and its constant-weight float MatMuls on tandem's kernels where those run fast
    here (bf16: their panels as bfloat16, for `--weights bf16`). options(level, kernels) -> SessionOptions."""
    # the build side: serving an engine dir reads this module's library helpers, never the exporter
    from tandem.export.cpu_kernel_lowering import CPU_DOMAIN, lower_matmul_nbits_to_kernel
    from tandem.export.cpu_matmul_lowering import lower_matmul_to_kernel
    from tandem.export.lowering import lower_for_onnxruntime

    kernels, variants = cpu_kernels.library(), {}
    nbits = kernels is not None and cpu_kernels.nbits_matmul()
    f32 = kernels is not None and cpu_kernels.f32_matmul()

    def matmuls(model: onnx.ModelProto, tensors) -> bool:   # both run: no short circuit
        quantized = bool(nbits and lower_matmul_nbits_to_kernel(model, tensors))
        return bool(f32 and lower_matmul_to_kernel(model, tensors, bf16=bf16)) or quantized

    try:
        if kernels is not None:
            for name, (graph, rows) in graphs.items():
                model = onnx.load(str(export_dir / f"{graph}.onnx"), load_external_data=False)
                variant = lower_for_onnxruntime(model, rows=rows, cpu_kernels=True)
                if any(n.domain == CPU_DOMAIN for n in variant.graph.node):
                    variants[name] = out_dir / f".kernels-{name}"
                    onnx.save(variant, str(variants[name]))
        library = out_dir / cpu_kernels.LIBRARY_FILE
        library.unlink(missing_ok=True)          # a reused dir's: this build decides anew
        if variants or nbits or f32:
            shutil.copyfile(kernels, library)    # the engine dir carries what its graphs load
        rewritten = save_optimized(out_dir, sorted(graphs), lambda level: options(level, library if variants else None),
                                   sources=variants, rewrite=matmuls if nbits or f32 else None)
        if not variants and not rewritten:
            library.unlink(missing_ok=True)
    finally:
        for path in variants.values():
            path.unlink(missing_ok=True)

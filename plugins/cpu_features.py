"""This machine's CPU as the kernels and ONNX Runtime's optimizer see it: its architecture and the
instruction sets either may dispatch on. A leaf: the kernels' build (plugins/cpu_kernels.py) and the
engine dir's record of where its optimized graphs were made (engines/backends) both read it."""

from __future__ import annotations

import platform
from pathlib import Path

# instruction sets MLAS and tandem's kernels dispatch on (x86 and Arm): a CPU with other ones may get
# other fusions or other kernels
CPU_FLAGS = ("sse4_1", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16", "asimd", "asimddp", "i8mm",
             "sve", "bf16", "fphp")


def cpu_signature() -> str:
    """The machine and the instruction sets the optimizer's output may depend on, e.g.
    "x86_64:avx,avx2,fma,f16c,sse4_1"."""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:  # not Linux: the machine name alone
        pass
    return f"{platform.machine()}:{','.join(sorted(flags & set(CPU_FLAGS)))}"

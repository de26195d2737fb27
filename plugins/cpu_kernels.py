"""tandem's ONNX Runtime CPU kernels (plugins/cpu/*.cc): compiled once per machine, carried by
the engine dirs that use them.

    library() -> Path | None     the compiled library (cached), or None where it cannot be built
                                 or is turned off (TANDEM_CPU_KERNELS=0: A/B against ONNX Runtime's)
    LIBRARY_FILE                 its name inside an engine dir

The kernels are ONNX Runtime custom ops in the domain `ai.tandem.cpu` (export/cpu_kernel_lowering.py
lowers to them); a session loads them with SessionOptions.register_custom_ops_library. The library
is written against ONNX Runtime's C ABI (plugins/cpu/ort_abi.h), so it needs a C++ compiler but no
ONNX Runtime headers: `$CXX`, else `c++` or `g++` on PATH. Where none works the build says why once
and lowers to ONNX Runtime's own kernels instead (slower, same results within the verification's
tolerance).

Compiled for the machine's instruction sets (x86-64-v3 where AVX2 and FMA are there): the engine
dir records the CPU signature its optimized graphs were made on (cpu_features.cpu_signature),
and a load on another CPU opens the lowered graphs, which do not use the library.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

from tandem.plugins.cpu_features import cpu_signature

SOURCE_DIR = Path(__file__).resolve().parent / "cpu"
SOURCES = ("gated_deltanet.cc", "conv_gated_deltanet.cc", "paged_attention.cc", "norm_rope.cc", "rotary_tables.cc",
           "matmul_nbits.cc", "matmul_nbits_avx512.cc", "matmul_f32.cc", "row_ops.cc", "sampler.cc", "logprobs.cc",
           "decode_burst.cc", "kernel_times.cc", "register.cc")
HEADERS = ("ort_abi.h", "kernel_common.h", "gated_deltanet.h", "matmul_nbits.h", "row_ops.h")
# what the int4 / int8 matmul kernel's fast path (matmul_nbits_avx512.cc) needs, as /proc/cpuinfo names them
_VNNI_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
LIBRARY_FILE = "cpu_kernels.so"

log = logging.getLogger(__name__)


def digest() -> str:
    """What the library is made of: its sources, the flags and the machine (part of the backend's
    versions, so a change rebuilds the engine dirs that carry it); "off" where turned off."""
    if not enabled():
        return "off"
    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        h.update(name.encode() + b"\0" + (SOURCE_DIR / name).read_bytes())
    h.update(" ".join(_flags()).encode() + cpu_signature().encode())
    return h.hexdigest()[:16]


def version() -> str:
    """The backend's record of the kernels (engines/backends/onnxruntime_backend.versions): digest(),
    marked where the build leaves matmuls to ONNX Runtime on a CPU that could run tandem's
    (TANDEM_CPU_KERNELS_PORTABLE=1 changes what the build makes, not the library), so that either
    change rebuilds an engine dir instead of reusing it."""
    forced = enabled() and os.environ.get("TANDEM_CPU_KERNELS_PORTABLE") == "1" and "avx512f" in _flags_here()
    return f"{digest()}-portable" if forced else digest()


def enabled() -> bool:
    return os.environ.get("TANDEM_CPU_KERNELS", "1") != "0"


def nbits_matmul() -> bool:
    """Whether the library's int4 / int8 matmul runs its AVX-512 VNNI kernel here (the build lowers
    MatMulNBits to it only then: the portable loop is slower than ONNX Runtime's).
    TANDEM_CPU_KERNELS_PORTABLE=1 makes the library run its portable loops, and so turns this off."""
    return _fast() and _VNNI_FLAGS <= _flags_here()


def f32_matmul() -> bool:
    """Whether the library's float32 matmul (plugins/cpu/matmul_f32.cc) runs its AVX-512 kernel
    here: the build lowers constant-weight MatMuls to it only then (and not with
    TANDEM_CPU_KERNELS_PORTABLE=1)."""
    return _fast() and "avx512f" in _flags_here()


def host_functions(make, library: Path | None, what: str, instead: str):
    """make(library): the pipeline's wrapper of some host functions of an engine dir's library (its
    native sampler, a burst's native step), or None where there is no library, it does not load here
    (OSError) or it predates those functions (AttributeError); the reason said once in the log, with
    what runs `instead`."""
    if library is None:
        return None
    try:
        return make(library)
    except (OSError, AttributeError) as e:
        log.info("%s has no %s (%s); %s. Rebuild the engine dir to use it.", library, what, e, instead)
        return None


TIMES_ENV = "TANDEM_CPU_KERNEL_TIMES"    # "1" before a process first runs a kernel: per-op wall times


def kernel_times(library: Path, reset: bool = False) -> dict[str, dict[str, float]]:
    """Per op of tandem's kernels in this process, since the last reset (plugins/cpu/kernel_times.cc):
    {op: {"calls", "busy_us", "gaps", "gap_us"}}, busy the kernels' own wall time, gap the time since
    the previous kernel call ended (ONNX Runtime's executor and nodes between them). Empty unless
    TIMES_ENV=1 was set when the process first ran a kernel. `library`: the one the sessions loaded
    (an engine dir's); AttributeError where it predates the timers."""
    read = ctypes.CDLL(str(library)).tandem_kernel_times
    read.argtypes, read.restype = [ctypes.c_char_p, ctypes.c_int64, ctypes.c_int], ctypes.c_int64
    size = read(None, 0, 0) + 256
    buffer = ctypes.create_string_buffer(size)
    while (needed := read(buffer, size, 0)) >= size:   # grew in between (another thread's kernels)
        size = needed + 256
        buffer = ctypes.create_string_buffer(size)
    if reset:
        read(None, 0, 1)
    times = {}
    for line in buffer.value.decode().splitlines():
        name, calls, busy, gaps, gap = line.split()
        times[name] = {"calls": int(calls), "busy_us": float(busy), "gaps": int(gaps), "gap_us": float(gap)}
    return times


def _fast() -> bool:
    return enabled() and os.environ.get("TANDEM_CPU_KERNELS_PORTABLE") != "1"


def _flags_here() -> set[str]:
    return set(cpu_signature().split(":")[-1].split(","))


def library() -> Path | None:
    """The compiled library, built on first use into the cache (`$TANDEM_KERNEL_CACHE`, else
    ~/.cache/tandem/kernels); None, with one warning saying why, where no compiler can build it."""
    return _library() if enabled() else None


@lru_cache(maxsize=1)
def _library() -> Path | None:
    target = _cache_dir() / f"{digest()}-{LIBRARY_FILE}"
    if target.is_file():
        return target
    compiler = _compiler()
    if compiler is None:
        log.warning("no C++ compiler (set $CXX, or install g++): tandem's CPU kernels are not built, and the "
                    "engines use ONNX Runtime's own (slower) kernels instead")
        return None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as scratch:
            built = Path(scratch) / LIBRARY_FILE
            cmd = [compiler, *_flags(), "-o", str(built), *(str(SOURCE_DIR / s) for s in SOURCES)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                log.warning("tandem's CPU kernels did not compile (%s); the engines use ONNX Runtime's own kernels "
                            "instead:\n%s", " ".join(cmd), done.stderr[-2000:])
                return None
            os.replace(built, target)       # atomic: a concurrent build finds the whole file or none
    except OSError as e:                    # no writable cache (set $TANDEM_KERNEL_CACHE)
        log.warning("tandem's CPU kernels cannot be built in %s (%s; set $TANDEM_KERNEL_CACHE to a writable folder); "
                    "the engines use ONNX Runtime's own kernels instead", target.parent, e)
        return None
    return target


def _flags() -> list[str]:
    flags = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-Wall"]
    signature = cpu_signature()
    if platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma"} <= set(signature.split(":")[-1].split(",")):
        flags.append("-march=x86-64-v3")
    return flags


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cache_dir() -> Path:
    root = os.environ.get("TANDEM_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "tandem" / "kernels"

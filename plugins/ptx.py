"""Ahead-of-time compilation of a KernelPlan to PTX, in the form TensorRT's AOT plugins launch.

TensorRT launches an AOT kernel with exactly the plugin's tensors and scalar extras. Triton (3.x)
appends two pointer parameters to every entry point (global and profile scratch); when the
kernel needs no scratch they are never read, so they are cut from the `.entry` signature, and a
kernel that does need scratch is refused (TensorRT would not pass the buffers). The PTX ISA
version is capped at what the installed driver loads, when one is present: Triton's bundled
ptxas may be newer than the driver, which then rejects the module at engine load.

Needs Triton, not a GPU: compiling for an explicit target runs anywhere.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tandem.plugins.kernel_plan import KernelPlan


@dataclass(frozen=True)
class CompiledKernel:
    name: str
    ptx: str
    shared_bytes: int
    num_warps: int
    capability: int


class KernelCompileError(RuntimeError):
    pass


MAX_SHARED_BYTES = 48 * 1024  # what every launch gets without opting in to more


def _entry(ptx: str, name: str) -> re.Match:
    """The `.entry name(` ... `)` declaration: groups (head, parameter list, closing paren)."""
    match = re.search(r"(\.visible\s+\.entry\s+" + re.escape(name) + r"\s*\()([^)]*)(\))", ptx, re.DOTALL)
    if match is None:
        raise KernelCompileError(f"the PTX has no entry point named {name}")
    return match


def entry_parameters(ptx: str, name: str) -> list[str]:
    return [p.strip() for p in _entry(ptx, name).group(2).split(",") if p.strip()]


def _cut_parameters(ptx: str, name: str, keep: int) -> str:
    match = _entry(ptx, name)
    block = "\n\t" + ",\n\t".join(entry_parameters(ptx, name)[:keep]) + "\n"
    return ptx[:match.start()] + match.group(1) + block + match.group(3) + ptx[match.end():]


def current_capability() -> int | None:
    """Compute capability (e.g. 90) of the current NVIDIA GPU, or None without one."""
    try:
        from triton.runtime import driver
        target = driver.active.get_current_target()
    except Exception:  # no driver, no GPU: the caller names a target
        return None
    return int(target.arch) if target.backend == "cuda" else None


def _driver_ptx_version() -> int | None:
    """Highest PTX ISA (as Triton's ptx_version int, e.g. 87) the installed driver loads."""
    try:
        import ctypes

        from triton.backends.nvidia.compiler import ptx_get_version
        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) != 0:
            return None
        return int(ptx_get_version(f"{version.value // 1000}.{version.value % 1000 // 10}"))
    except Exception:  # no driver here: compile for the newest ISA Triton knows
        return None


def compile_ptx(plan: KernelPlan, capability: int) -> CompiledKernel:
    """PTX for `plan` on an sm_<capability> GPU, its entry taking exactly the plan's parameters."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def build(ptx_version=None):
        options = {"num_warps": plan.num_warps, "num_stages": plan.num_stages}
        if ptx_version:
            options["ptx_version"] = ptx_version
        source = ASTSource(fn=plan.entry_point(), signature={**plan.signature, **dict.fromkeys(plan.constexprs,
                                                                                                 "constexpr")},
                           constexprs=dict(plan.constexprs))
        return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)

    compiled = build()
    isa = re.search(r"\.version (\d+)\.(\d+)", compiled.asm["ptx"])
    cap = _driver_ptx_version()
    if cap and isa and int(isa.group(1)) * 10 + int(isa.group(2)) > cap:
        compiled = build(cap)
    meta, ptx = compiled.metadata, compiled.asm["ptx"]
    scratch = int(getattr(meta, "global_scratch_size", 0) or 0) + int(getattr(meta, "profile_scratch_size", 0) or 0)
    params = entry_parameters(ptx, meta.name)
    if len(params) > len(plan.signature):
        if scratch:
            raise KernelCompileError(f"{plan.kernel} needs {scratch} bytes of Triton scratch memory, which a "
                                     "TensorRT AOT plugin cannot provide; change the kernel")
        ptx = _cut_parameters(ptx, meta.name, len(plan.signature))
    if meta.shared > MAX_SHARED_BYTES:
        raise KernelCompileError(f"{plan.kernel} needs {meta.shared} bytes of shared memory, over the "
                                 f"{MAX_SHARED_BYTES} a launch gets without an opt-in; use smaller blocks")
    return CompiledKernel(meta.name, ptx, int(meta.shared), int(meta.num_warps), capability)

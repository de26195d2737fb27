"""TensorRT backend (NVIDIA GPUs). Imports tensorrt only when used: where it is missing,
selecting this backend raises BackendUnavailable with how to get it.

One serialized plan per graph kind (and verify width), with one optimization profile per batch
bucket: profiles of one engine share one copy of the weights (separately built engines cannot),
and the pipeline picks a profile per bucket, one execution context each. Shapes per profile come
from tandem.engines.buckets.profile_shapes (backend-neutral, unit-tested without TensorRT).

Custom ops: where Triton and `tensorrt.plugin` (TensorRT >= 10.8) are importable, each
`ai.tandem` node becomes an AOT plugin (tandem.plugins: a Triton kernel compiled to PTX and
stored in the plan; no Python at run time). Otherwise the parser imports each node's function
body, the portable fallback. The manifest's versions say which one an engine dir holds.

This module is the serving side (the plans' plugins registered, the runner); building and checking
the plans is tensorrt_build.py. The pipeline runner (tensorrt_runner.py): device pools, one
execution context and buffer plan per bucket, commits by a device kernel, and one CUDA graph per
bucket: enqueueV3 runs once per (context, shapes), then the bucket's call sequence is captured with
fixed addresses and replayed.
"""

from __future__ import annotations

from tandem.engines.backends.common import BackendUnavailable
from tandem.engines.backends.tensorrt_runner import Runner

NAME = "tensorrt"
__all__ = ["NAME", "Runner", "versions"]


def _trt():
    try:
        import tensorrt as trt
    except ImportError as e:
        raise BackendUnavailable(
            "--backend tensorrt needs the TensorRT Python package and an NVIDIA GPU, and TensorRT is not "
            "installed here (its wheels fetch their libraries from NVIDIA's own package index; see TensorRT's "
            "install guide). Use --backend onnxruntime on this machine.") from e
    return trt


def plugin_mode() -> str:
    """"triton-aot" when the plugin kernels can be built here, else "function-bodies"."""
    try:
        import tensorrt.plugin as trtp
        import triton  # noqa: F401
    except ImportError:
        return "function-bodies"
    return "triton-aot" if hasattr(trtp, "aot_impl") else "function-bodies"


def versions() -> dict[str, str]:
    out = {"tensorrt": _trt().__version__, "custom_ops": plugin_mode()}
    if out["custom_ops"] == "triton-aot":
        import triton
        out["triton"] = triton.__version__
    return out


def _register_plugins() -> bool:
    """Register the tandem plugins for this GPU when they can be built here; False otherwise."""
    if plugin_mode() != "triton-aot":
        return False
    from tandem.plugins.ptx import current_capability
    from tandem.plugins.tensorrt_registration import register_plugins
    capability = current_capability()
    if capability is None:
        raise BackendUnavailable("building TensorRT engines needs an NVIDIA GPU, and Triton finds none here")
    register_plugins(capability)
    return True

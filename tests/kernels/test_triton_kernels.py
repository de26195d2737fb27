"""The Triton kernels behind the TensorRT plugins, against the ops' ONNX function bodies.

Each case goes the way TensorRT goes: ONNX node -> plugin name and fields (as the parser narrows
them) -> kernel_plan -> launch, then compares with ONNX Runtime running the function body. On a
machine without a GPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET);
with one, on the GPU. The PTX check compiles every plugin's kernel ahead of time, as the AOT
plugin does at engine build, for two GPU generations (no GPU needed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tandem.export.ops import gated_deltanet, paged_sparse_attention
from tandem.plugins.tensorrt_plugins import kernel_plan, output_shapes, plugin_fields, plugin_name

from ..export.test_ops import attention_case, gdn_inputs
from ..op_harness import run, single_op_model

torch = pytest.importorskip("torch")
pytest.importorskip("triton", reason="Triton is a test dependency (make setup-test installs it)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def run_plugin(model, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Run the model's single tandem node through its plugin's kernel plan."""
    from tandem.plugins.kernel_plan import launch

    node = model.graph.node[0]
    plugin = plugin_name(node)
    shapes = [a.shape for a in inputs]
    dtype = str(inputs[0].dtype)                              # activations; GatedDeltaNet states stay fp32
    plan = kernel_plan(plugin, shapes, plugin_fields(node), dtype)
    tensors = [torch.from_numpy(np.ascontiguousarray(a)).to(DEVICE) for a in inputs]
    out_dtypes = [getattr(torch, dtype)] + [torch.float32] * 2
    outputs = [torch.full(shape, float("nan"), dtype=dt, device=DEVICE)
               for shape, dt in zip(output_shapes(plugin, shapes), out_dtypes)]
    launch(plan, tensors, outputs)
    return [o.cpu().numpy() for o in outputs]


@pytest.mark.parametrize("emit_rows", [False, True])
@pytest.mark.parametrize("w", [1, 5])
def test_gated_deltanet_kernel_matches_function_body(emit_rows, w):
    rng = np.random.default_rng(w)
    q, k, v, g, beta, s0 = gdn_inputs(rng, b=3, w=w, hk=2, hv=4, dk=24, dv=20)   # dims not powers of two
    rows = np.array([w, max(0, w - 2), 1], np.int64)                              # padded rows past state_rows
    inputs = [q, k, v, g, beta, s0, rows]
    model = single_op_model(gated_deltanet.make_function(emit_rows), "GatedDeltaNet", inputs,
                            [4, 4, 5] if emit_rows else [4, 4], scale=0.35, num_key_heads=2, num_value_heads=4)
    expected = run(model, inputs)
    got = run_plugin(model, inputs)
    assert len(got) == len(expected)
    for name, e, r in zip(["output", "final_state", "row_states"], expected, got):
        np.testing.assert_allclose(r, e, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("selection", ["dense", "per_row", "shared"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_paged_attention_kernel_matches_function_body(window, selection, dtype):
    """float16 engines keep fp16 K/V pools: both the kernel and the body widen what they read
    to fp32, so they agree to the fp16 rounding of the output."""
    rng = np.random.default_rng(window + len(selection))
    q, k, v, kc, vc, tables, lens = attention_case(rng, b=3, w=4, hq=6, hkv=2, d=24, dv=20, page=4)
    q, k, v, kc, vc = (x.astype(dtype) for x in (q, k, v, kc, vc))
    distinct = lambda shape: np.stack([rng.permutation(20)[:shape[-1]] - 2 for _ in range(int(np.prod(shape[:-1])))]  # noqa: E731
                                      ).reshape(shape).clip(-1)                   # distinct positions, -1 padding
    sel = {"dense": np.zeros((1, 1, 0)), "per_row": distinct((3, 4, 7)), "shared": distinct((1, 1, 5))}[selection]
    inputs = [q, k, v, kc, vc, tables, lens, sel.astype(np.int64)]
    model = single_op_model(paged_sparse_attention.make_function(), "PagedSparseAttention", inputs, [4],
                            out_dtype=dtype, scale=0.3, sliding_window=window)
    (expected,) = run(model, inputs)
    (got,) = run_plugin(model, inputs)
    assert got.dtype == expected.dtype == dtype
    np.testing.assert_allclose(got.astype(np.float32), expected.astype(np.float32),
                               atol=2e-5 if dtype == np.float32 else 2e-3)


_COMPILE = """
import json, sys
from tandem.plugins.tensorrt_plugins import kernel_plan
from tandem.plugins.ptx import compile_ptx, entry_parameters
gdn = {"scale": 128 ** -0.5, "num_key_heads": 16, "num_value_heads": 32}
gdn_shapes = [(8, 4, 16, 128), (8, 4, 16, 128), (8, 4, 32, 128), (8, 4, 32), (8, 4, 32), (8, 32, 128, 128), (8,)]
att_shapes = [(8, 4, 16, 256), (8, 4, 2, 256), (8, 4, 2, 256), (4096, 16, 2, 256), (4096, 16, 2, 256), (8, 256),
              (8,), (1, 1, 0)]
cases = [("GatedDeltaNet", gdn_shapes, gdn), ("GatedDeltaNetRowStates", gdn_shapes, gdn),
         ("PagedSparseAttention", att_shapes, {"scale": 0.0625, "sliding_window": 0})]
out = []
for capability in (80, 90):
    for plugin, shapes, fields in cases:
        plan = kernel_plan(plugin, shapes, fields, "float32")
        kernel = compile_ptx(plan, capability)
        out.append({"plugin": plugin, "capability": capability, "name": kernel.name, "shared": kernel.shared_bytes,
                    "params": len(entry_parameters(kernel.ptx, kernel.name)), "expected": len(plan.signature),
                    "target": f".target sm_{capability}" in kernel.ptx})
json.dump(out, sys.stdout)
"""


def test_plugin_kernels_compile_ahead_of_time_to_ptx():
    """What the AOT plugins do at engine build, for Qwen3.5-sized heads on sm_80 and sm_90:
    the entry takes exactly TensorRT's arguments, within 48 KiB of shared memory."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the real compiler, not the interpreter
    proc = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    assert len(results) == 6
    for r in results:
        assert r["params"] == r["expected"], r
        assert r["target"] and 0 <= r["shared"] <= 48 * 1024, r

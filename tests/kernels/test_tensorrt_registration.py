"""plugins/tensorrt_registration.py against a stand-in for TensorRT's plugin API (tests/fake_tensorrt.py):
the glue registers the three plugins, describes their outputs from the input shapes, and hands
TensorRT the launch that tests/kernels/test_triton_kernels.py runs (same plan, compiled to PTX)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from tandem.plugins import ptx, tensorrt_registration
from tandem.plugins.tensorrt_plugins import kernel_plan

from ..fake_tensorrt import DynamicDim, TensorDesc, make_modules


@pytest.fixture
def registered(monkeypatch):
    trt, trtp, registry = make_modules()
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)
    monkeypatch.setattr(tensorrt_registration, "_registered", False)
    compiled = []

    def fake_compile(plan, capability):  # PTX compilation itself: test_triton_kernels.py
        compiled.append((plan, capability))
        return ptx.CompiledKernel(f"{plan.kernel}_sm{capability}", "// ptx", 2048, plan.num_warps, capability)

    monkeypatch.setattr(ptx, "compile_ptx", fake_compile)
    tensorrt_registration.register_plugins(90)
    return registry, compiled


GDN_FIELDS = dict(scale=np.array([0.35], np.float32), num_key_heads=np.array([2], np.int32),
                  num_value_heads=np.array([4], np.int32))


def gdn_inputs(batch=2, rows=3):
    return [TensorDesc((batch, rows, 2, 24)), TensorDesc((batch, rows, 2, 24)), TensorDesc((batch, rows, 4, 20)),
            TensorDesc((batch, rows, 4)), TensorDesc((batch, rows, 4)), TensorDesc((batch, 4, 24, 20)),
            TensorDesc((batch,), "int64")]


def test_three_plugins_are_registered_with_desc_and_aot(registered):
    registry, _ = registered
    ids = {"tandem::GatedDeltaNet", "tandem::GatedDeltaNetRowStates", "tandem::PagedSparseAttention"}
    assert set(registry.descs) == set(registry.aots) == ids


def test_gated_deltanet_outputs_and_launch(registered):
    registry, compiled = registered
    outs = registry.descs["tandem::GatedDeltaNetRowStates"](*gdn_inputs(), **GDN_FIELDS)
    assert [(o.shape, o.dtype) for o in outs] == [((2, 3, 4, 20), "float32"), ((2, 4, 24, 20), "float32"),
                                                  ((2, 3, 4, 24, 20), "float32")]
    assert len(registry.descs["tandem::GatedDeltaNet"](*gdn_inputs(), **GDN_FIELDS)) == 2
    name, code, launch, extras = registry.aots["tandem::GatedDeltaNetRowStates"](*gdn_inputs(), **GDN_FIELDS,
                                                                                 outputs=outs)
    plan, capability = compiled[-1]
    assert (name, code, capability) == ("gated_deltanet_rows_kernel_sm90", "// ptx", 90)
    assert (launch.grid_x, launch.grid_y, launch.grid_z) == (8, 1, 1)        # batch x value heads, one column block
    assert launch.block_x == plan.num_warps * 32 and launch.shared_mem == 2048
    assert [e.expr for e in extras] == [3]                                   # W, the rows of this call
    # the very plan tests/kernels/test_triton_kernels.py launches for the same node
    shapes = [d.shape for d in gdn_inputs()]
    assert plan == kernel_plan("GatedDeltaNetRowStates", shapes, GDN_FIELDS, "float32")


def test_attention_launch_and_a_dynamic_head_dim_is_refused(registered):
    registry, compiled = registered
    fields = dict(scale=np.array([0.3], np.float32), sliding_window=np.array([0], np.int32))
    inputs = [TensorDesc((2, 4, 6, 24)), TensorDesc((2, 4, 2, 24)), TensorDesc((2, 4, 2, 20)),
              TensorDesc((12, 4, 2, 24)), TensorDesc((12, 4, 2, 20)), TensorDesc((2, 5), "int64"),
              TensorDesc((2,), "int64"), TensorDesc((1, 1, 0), "int64")]
    out = registry.descs["tandem::PagedSparseAttention"](*inputs, **fields)
    assert out.shape == (2, 4, 6, 20)
    _, _, launch, extras = registry.aots["tandem::PagedSparseAttention"](*inputs, **fields, outputs=(out,))
    assert (launch.grid_x, launch.grid_y) == (8, 2)                          # new rows x KV heads
    assert [e.expr for e in extras] == [4, 5, 1, 1, 0]                       # W, pages per seq, selected dims
    assert compiled[-1][0].constexprs["PAGE"] == 4
    inputs[0] = TensorDesc((2, 4, 6, DynamicDim(24)))
    with pytest.raises(ValueError, match="the head dim must be known when the engine is built"):
        registry.aots["tandem::PagedSparseAttention"](*inputs, **fields, outputs=(out,))

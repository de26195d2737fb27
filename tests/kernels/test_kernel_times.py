"""tandem's kernel timers (plugins/cpu/kernel_times.cc, read by plugins/cpu_kernels.kernel_times):
off unless TANDEM_CPU_KERNEL_TIMES=1 when a process first runs a kernel; then per op its calls, their
wall time and the gaps before them. The switch is read once per process, so each case runs in a
child process. And bench/where_time_goes.py's table (e) of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tandem.bench.where_time_goes import kernel_table
from tandem.plugins import cpu_kernels

# two MatMul nodes of tandem's kernel, run three times; the table read, then read again after a reset
CHILD = """
import json
import numpy as np
from onnx import TensorProto, helper, numpy_helper
from tandem.engines.backends.onnxruntime_backend import session
from tandem.export.cpu_kernel_lowering import CPU_DOMAIN
from tandem.export.cpu_matmul_lowering import weight_panels
from tandem.plugins import cpu_kernels

rng = np.random.default_rng(0)
w1, w2 = rng.standard_normal((64, 48), dtype=np.float32), rng.standard_normal((48, 32), dtype=np.float32)
nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], domain=CPU_DOMAIN, N=48),
         helper.make_node("MatMul", ["h", "w2"], ["y"], domain=CPU_DOMAIN, N=32)]
graph = helper.make_graph(nodes, "two", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32])],
                          [numpy_helper.from_array(weight_panels(w1), "w1"),
                           numpy_helper.from_array(weight_panels(w2), "w2")])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(CPU_DOMAIN, 1)])
model.ir_version = 10
library = cpu_kernels.library()
run = session(model, kernels=library)
x = {"x": rng.standard_normal((1, 64)).astype(np.float32)}
y = run.run(None, x)[0]
assert np.allclose(y, x["x"] @ w1 @ w2, atol=1e-3)
run.run(None, x)
run.run(None, x)
print(json.dumps([cpu_kernels.kernel_times(library, reset=True), cpu_kernels.kernel_times(library)]))
"""


def _child(library, on: bool) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != cpu_kernels.TIMES_ENV}
    if on:
        env[cpu_kernels.TIMES_ENV] = "1"
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_on_each_call_of_each_op_is_timed_and_a_reset_zeroes_them(library):
    read, after_reset = _child(library, on=True)
    assert set(read) == {"MatMul"}
    t = read["MatMul"]
    assert t["calls"] == 6 and t["busy_us"] > 0
    assert 3 <= t["gaps"] <= 5 and t["gap_us"] > 0      # the second node of each run; between runs if < 1 ms
    assert after_reset == {"MatMul": {"calls": 0, "busy_us": 0.0, "gaps": 0, "gap_us": 0.0}}


def test_off_by_default_nothing_is_recorded(library):
    assert _child(library, on=False) == [{}, {}]


def test_where_time_goes_table_per_step_and_per_call():
    times = {"MatMul": {"calls": 98, "busy_us": 14_700.0, "gaps": 96, "gap_us": 192.0},
             "PagedAttention": {"calls": 6, "busy_us": 180.0, "gaps": 6, "gap_us": 6.0},
             "NormRope": {"calls": 0, "busy_us": 0.0, "gaps": 0, "gap_us": 0.0}}
    table = kernel_table(times, steps=2)
    assert list(table) == ["MatMul", "PagedAttention"]          # largest first; ops that did not run left out
    assert table["MatMul"] == pytest.approx({"calls_per_step": 49, "us_per_step": 7350, "us_per_call": 150,
                                             "gap_us_per_call": 2})
    assert table["PagedAttention"]["us_per_call"] == pytest.approx(30)

"""Layers that import only downward: serving an engine dir (the pipeline, the server) loads nothing of
the build side (the exporter, the build options, the builder) nor torch / transformers; the engine
dir's format (manifest, file hashes, weights file name) is a leaf the exporter imports, not the
other way round. Each check imports in a fresh interpreter, so what an earlier test loaded counts
for nothing."""

from __future__ import annotations

import json
import subprocess
import sys

BUILD_SIDE = ("tandem.export", "tandem.engines.builder", "tandem.engines.options", "tandem.engines.fingerprint",
              "torch", "transformers")


def loaded(module: str) -> list[str]:
    code = (f"import json, sys, {module}; "
            f"print(json.dumps(sorted(m for m in sys.modules if m.startswith({BUILD_SIDE!r}))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_the_runtime_loads_no_build_side_module():
    """The server (app, `tandem serve`) and the offline API; opening an engine dir is the test below."""
    assert loaded("tandem.pipeline.llm, tandem.server.app, tandem.server.serve") == []


def test_the_engine_dir_format_is_a_leaf():
    """engines.manifest and engines.integrity read and check an engine dir without the build side."""
    assert loaded("tandem.engines.integrity, tandem.engines.manifest") == []


def test_server_and_profiling_use_the_llms_public_methods():
    """The server, `tandem profile` and the tools talk to an LLM through its methods (stats(),
    isolate_failure(), latency_cases(), ...), never through its scheduler, runner or round loop."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    reach = re.compile(r"\bllm\.(scheduler|runner|round_loop|pools|page_groups|prefix_cache)\b")
    found = [f"{path.relative_to(root)}:{i}: {line.strip()}"
             for folder in ("server", "profiling", "tools") for path in sorted((root / folder).rglob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1) if reach.search(line)]
    assert found == []


# package -> the tandem packages it may not import, even inside a function (the build side's lazy
# imports are the engines' own business): every arrow points down the one way through
FORBIDDEN = {
    "checkpoint": ("plugins", "export", "engines", "pipeline", "server", "profiling"),
    "plugins": ("export", "engines", "pipeline", "server", "profiling"),
    "export": ("engines.builder", "engines.backends", "engines.buckets", "pipeline", "server", "profiling"),
    "pipeline": ("export", "engines.builder", "engines.options", "server", "profiling"),
    "server": ("export", "engines.builder", "engines.options", "profiling"),
}


def test_imports_point_down():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    imports = re.compile(r"^\s*(?:from|import) tandem\.([a-z_.]+)", re.M)
    found = [f"{path.relative_to(root)} imports tandem.{name}"
             for package, banned in FORBIDDEN.items() for path in sorted((root / package).rglob("*.py"))
             for name in imports.findall(path.read_text())
             if any(name == b or name.startswith(b + ".") for b in banned)]
    assert found == []


SERVING_NEVER = BUILD_SIDE + ("tandem.engines.buckets", "tandem.engines.verification", "tandem.engines.builder",
                              "tandem.engines.backends.onnxruntime_build", "tandem.engines.backends.tensorrt_build",
                              "tandem.engines.backends.onnxruntime_optimized",
                              "tandem.engines.backends.onnxruntime_kernel_files")


def test_serving_an_engine_dir_loads_no_build_module(engine_dirs):
    """Opening an engine dir and generating from it loads the backend's serving module only."""
    code = ("import json, sys; from tandem.pipeline.llm import LLM; "
            "from tandem.pipeline.sampling_params import SamplingParams; "
            f"llm = LLM({str(engine_dirs['qwen3_5_mtp3'])!r}); "
            "llm.generate([[5, 17, 33]], SamplingParams(max_tokens=4)); "
            f"print(json.dumps(sorted(m for m in sys.modules if m.startswith({SERVING_NEVER!r}))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_no_import_cycles():
    """No tandem module imports, at module level, one that imports it back (directly or around a loop)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = {("tandem." + ".".join(p.relative_to(root).with_suffix("").parts)).removesuffix(".__init__"): p
             for folder in ("checkpoint", "export", "engines", "plugins", "pipeline", "server", "profiling", "testing")
             for p in (root / folder).rglob("*.py")}
    files.update({f"tandem.{p.stem}": p for p in root.glob("*.py") if p.stem != "__init__"})
    graph = {}
    for name, path in files.items():
        deps = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tandem"):
                deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                         for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("tandem")}
        graph[name] = deps & files.keys() - {name}
    state, cycles = {}, []

    def visit(module, path):
        state[module] = "open"
        for dep in sorted(graph[module]):
            if state.get(dep) == "open":
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []

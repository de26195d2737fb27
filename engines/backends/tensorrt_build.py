"""TensorRT backend, the build side (`tandem build-engines --backend tensorrt`): one serialized plan
per graph kind (and verify width) with one optimization profile per batch bucket, and the check of
each bucket's profile against ONNX Runtime on the exported graph. See tensorrt_backend.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tandem.engines.backends.onnxruntime_build import ReferenceRunner
from tandem.engines.backends.tensorrt_backend import NAME, _register_plugins, _trt, versions
from tandem.engines.buckets import Bucket, profile_shapes

__all__ = ["NAME", "Checker", "build", "engine_file", "versions"]
_WORKSPACE = 4 << 30


def _parsed_graph(export_dir: Path, graph: str, use_plugins: bool) -> Path:
    """The ONNX file the parser reads: the export itself, or a copy whose tandem nodes name
    their plugins (next to it, so the shared external weights resolve)."""
    path = export_dir / f"{graph}.onnx"
    if not use_plugins:
        return path
    tagged = export_dir / f"{graph}.plugins.onnx"
    if not tagged.exists():
        import onnx

        from tandem.plugins.tensorrt_plugins import mark_for_plugins
        onnx.save(mark_for_plugins(onnx.load(str(path), load_external_data=False)), str(tagged))
    return tagged


def engine_file(bucket: Bucket) -> str:
    return f"{bucket.graph.engine_key(bucket.rows)}.plan"


def build(export_dir: Path, out_dir: Path, buckets: list[Bucket], desc, options, progress=None
          ) -> dict[str, tuple[str, int]]:
    """Parse each exported graph once, add one profile per bucket, serialize the plan."""
    trt = _trt()
    logger = trt.Logger(trt.Logger.WARNING)
    use_plugins = _register_plugins()
    groups: dict[str, list[Bucket]] = {}
    for bucket in buckets:
        groups.setdefault(engine_file(bucket), []).append(bucket)
    files = {}
    for file, group in groups.items():
        builder = trt.Builder(logger)
        flags = 0
        if hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):  # precision from the ONNX types
            flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
        network = builder.create_network(flags)
        parser = trt.OnnxParser(network, logger)
        if use_plugins and hasattr(trt.OnnxParserFlag, "ENABLE_PLUGIN_OVERRIDE"):
            parser.set_flag(trt.OnnxParserFlag.ENABLE_PLUGIN_OVERRIDE)
        onnx_path = _parsed_graph(export_dir, group[0].graph.name, use_plugins)
        if not parser.parse_from_file(str(onnx_path)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise RuntimeError(f"TensorRT could not parse {onnx_path.name}: {errors}")
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, _WORKSPACE)
        inputs = {network.get_input(i).name for i in range(network.num_inputs)}
        for index, bucket in enumerate(group):
            profile = builder.create_optimization_profile()
            for name, (lo, opt, hi) in profile_shapes(desc, bucket, options).items():
                if name in inputs:
                    profile.set_shape(name, lo, opt, hi)
            config.add_optimization_profile(profile)
            files[bucket.name] = (file, index)
        plan = builder.build_serialized_network(network, config)
        if plan is None:
            raise RuntimeError(f"TensorRT failed to build {file}; run with TensorRT's verbose log for the reason")
        (out_dir / file).write_bytes(bytes(plan))
        for bucket in group:
            if progress:
                progress.step(bucket.name)
    return files


class Checker:
    """Engine outputs (polygraphy's TrtRunner on the bucket's profile) against ONNX Runtime on
    the exported graph: the same comparison the ONNX Runtime backend makes."""

    def __init__(self, engine_dir: Path, export_dir: Path):
        self.engine_dir, self.export_dir = engine_dir, export_dir
        self.reference = ReferenceRunner()
        self._engines = {}
        _register_plugins()  # plans with plugin layers deserialize with their creators registered

    def run(self, bucket: Bucket, engine: tuple[str, int], feeds: dict[str, np.ndarray]) -> tuple[dict, dict]:
        from polygraphy.backend.trt import EngineFromBytes, TrtRunner

        file, profile = engine
        if file not in self._engines:
            self._engines[file] = EngineFromBytes((self.engine_dir / file).read_bytes())()
        reference = self.reference.run(self.export_dir / f"{bucket.graph.name}.onnx", feeds)
        with TrtRunner(self._engines[file], optimization_profile=profile) as runner:
            outputs = runner.infer(feed_dict=feeds)
        return reference, {name: np.asarray(value) for name, value in outputs.items()}

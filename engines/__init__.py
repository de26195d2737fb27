"""Builds and loads engines per (batch size, verify width) bucket: ONNX Runtime and TensorRT.

Boundary: turns exported graphs into an engine directory with a manifest; the pipeline reads
only that directory.
"""

"""Lowers the target model, each MTP head and the verify step to ONNX graphs.

Boundary: reads a checkpoint through `tandem.checkpoint`; writes ONNX files. Knows nothing
about engines, scheduling or HTTP.
"""

"""Custom ops of the `ai.tandem` domain. Each op module exports make_function(...), the
standard-ONNX body that any runtime can run (ONNX Runtime inlines it; a registered kernel or
plugin overrides it), and the attribute set it takes."""

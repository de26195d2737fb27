"""The OpenAI-compatible HTTP server over the pipeline.

Boundary: translates HTTP to pipeline requests and back; owns no model state.
"""

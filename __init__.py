"""tandem: serve LLMs that carry multi-token-prediction heads.

One way through: checkpoint -> export (ONNX) -> engines (+ manifest) -> pipeline -> server.
Each stage is a subpackage: `tandem.checkpoint`, `tandem.export`, `tandem.engines`,
`tandem.pipeline`, `tandem.server`, `tandem.plugins`; `tandem.testing` makes tiny checkpoints.
"""

__version__ = "0.1.0"

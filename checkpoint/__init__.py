"""Reads local Hugging Face checkpoints into one frozen model description and a lazy weight
accessor, refusing at config time what tandem cannot run.

Boundary: numpy + safetensors headers only; never imports torch.
"""

from tandem.checkpoint.description import LayerKind, MLPKind, ModelDescription
from tandem.checkpoint.errors import CheckpointError
from tandem.checkpoint.reader import Checkpoint, open_checkpoint

__all__ = ["Checkpoint", "CheckpointError", "LayerKind", "MLPKind", "ModelDescription", "open_checkpoint"]

"""Shared by the checkpoint tests: the refusal a checkpoint folder gets when it is opened."""

from __future__ import annotations

import pytest

from tandem.checkpoint import open_checkpoint
from tandem.checkpoint.errors import CheckpointError


def refusal(*args, **kwargs) -> str:
    """open_checkpoint(*args, **kwargs) must refuse; returns the CheckpointError's message."""
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(*args, **kwargs)
    return str(info.value)

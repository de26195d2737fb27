"""What each layer keeps between steps, declared per layer as vLLM's KVCacheSpec does. The
layer's mixer spec (checkpoint/description.py) says which pools it needs; the contract's pool
inputs and outputs, the pipeline's pools and byte budgets, bucket dims and the build's
verification inputs are all derived from these declarations, and nothing else spells a pool shape.

    PagedKVSpec  rows committed per accepted token
                 pool  [num_pages, page_size, *row_shape]   graph output  [batch, rows, *row_shape]
    StateSpec    a state replaced after the accepted row
                 pool  [num_slots, *shape]                  graph output  [batch, *shape]

dtype None means the activation dtype (the engines' float32 or float16; the checkpoint's for
`tandem inspect`); a fixed dtype stays whatever the engines run in (Gated DeltaNet's recurrent
state is always float32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KEY, VALUE = "key", "value"          # attention K/V rows
RECURRENT, CONV = "recurrent", "conv"  # Gated DeltaNet recurrent state and conv window

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class _PoolSpec:
    """What both kinds of pool share: a dtype that may follow the activations, and bytes per
    element block (one page row, or one sequence's state)."""

    dtype: str | None

    def dtype_for(self, activation: str) -> str:
        return self.dtype or activation

    def _bytes(self, shape: tuple[int, ...], activation_bytes: int) -> int:
        return math.prod(shape) * (DTYPE_BYTES[self.dtype] if self.dtype else activation_bytes)


@dataclass(frozen=True)
class PagedKVSpec(_PoolSpec):
    name: str                      # pool family: key_pool.{layer} in, new_key.{layer} out
    row_shape: tuple[int, ...]     # one token's row, e.g. [Hkv, head_dim]
    doc: str                       # what a row holds, e.g. "keys (post-RoPE)"
    dtype: str | None = None       # None: the activation dtype
    # sliding window: attention reads only the last `window` positions. Pools of one window form a
    # page group (contract.page_groups) with its own pages and block table; the pipeline releases
    # a group's pages that fall out of the window while the sequence runs (pipeline/allocator.py)
    window: int | None = None

    def __post_init__(self):
        _check(self.name, self.row_shape, self.dtype)
        if self.window is not None and self.window < 1:
            raise ValueError(f"pool {self.name}: sliding window must be >= 1, got {self.window}")

    def row_bytes(self, activation_bytes: int) -> int:
        return self._bytes(self.row_shape, activation_bytes)


@dataclass(frozen=True)
class StateSpec(_PoolSpec):
    name: str                      # pool family: conv_pool.{layer} in, new_conv_state.{layer} out
    shape: tuple[int, ...]         # one sequence's state
    doc: str
    dtype: str | None = None

    def __post_init__(self):
        _check(self.name, self.shape, self.dtype)

    def slot_bytes(self, activation_bytes: int) -> int:
        return self._bytes(self.shape, activation_bytes)


@dataclass(frozen=True)
class LayerCache:
    """The pools of one layer: trunk layer `layer`, or MTP head `layer` when `head`."""

    layer: int
    pools: tuple[PagedKVSpec | StateSpec, ...]
    head: bool = False

    @property
    def paged(self) -> tuple[PagedKVSpec, ...]:
        return tuple(p for p in self.pools if isinstance(p, PagedKVSpec))

    @property
    def states(self) -> tuple[StateSpec, ...]:
        return tuple(p for p in self.pools if isinstance(p, StateSpec))


def page_bytes(caches, page_size: int, activation_bytes: int) -> int:
    """Bytes of one page (page_size token rows) across every paged pool of `caches`."""
    return page_size * sum(p.row_bytes(activation_bytes) for cache in caches for p in cache.paged)


def slot_bytes(caches, activation_bytes: int) -> int:
    """Bytes of one sequence's states across every state pool of `caches`."""
    return sum(p.slot_bytes(activation_bytes) for cache in caches for p in cache.states)


def _check(name: str, shape: tuple[int, ...], dtype: str | None) -> None:
    if not name.isidentifier():
        raise ValueError(f"pool name {name!r} must be an identifier: it becomes part of tensor names")
    if not shape or any(type(d) is not int or d < 0 for d in shape):
        raise ValueError(f"pool {name}: shape {shape} must be non-negative integers")
    if dtype is not None and dtype not in DTYPE_BYTES:
        raise ValueError(f"pool {name}: dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")

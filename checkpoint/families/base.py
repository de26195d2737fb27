"""What every model family shares: the `Family` interface the checkpoint reader calls, how one
canonical tensor is read from what a checkpoint stores (`Source`), where a family keeps its MTP
heads (`MTPLayout`, with the NextN layout several families use), and config.json helpers.

Canonical tensor names are transformers' Qwen3.5 text layout without the `model.` prefix
(`layers.3.self_attn.q_proj.weight`, `mtp.layers.0.mlp.experts.gate_up_proj`); each family maps
them to its stored names (`sources()`). A family package in this folder that defines `FAMILY` is
registered by `tandem.checkpoint.families` on import: adding one touches nothing else.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from tandem.checkpoint.description import ModelDescription

Shape = tuple[int, ...]
SUPPORTED_ROPE_TYPES = ("default",)
TORCH_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32",
                "torch.bfloat16": "bfloat16", "torch.float16": "float16", "torch.float32": "float32"}


class ConfigError(ValueError):
    """A config.json value that is missing or out of range; the reader adds the file name."""


@dataclass(frozen=True)
class Source:
    """How one canonical tensor is read: the stored tensors and the shapes config implies for
    them, and how to turn them into the canonical array (None: the single tensor as is)."""

    names: tuple[str, ...]
    shapes: tuple[Shape, ...]
    combine: Callable[[list[np.ndarray]], np.ndarray] | None = None


def single(name: str, shape: Shape) -> Source:
    return Source((name,), (tuple(shape),))


@dataclass(frozen=True)
class MTPLayout:
    """Where a family stores its MTP heads: `count_key` (config.json) declares how many, `owns` tells
    a head's stored tensor from the trunk's, `layer_of` gives its head layer (None: shared by every
    head), `layer_prefix(j)` names head j's stored decoder layer and `pattern` all of them, in messages."""

    count_key: str
    pattern: str
    owns: Callable[[str], bool]
    layer_of: Callable[[str], int | None]
    layer_prefix: Callable[[int], str]


@dataclass(frozen=True)
class TinyKind:
    """A small random checkpoint of a family for tests and benchmarks, declared in the family's
    `tiny` module (`TINY_KINDS`) and written by testing/tiny_checkpoints.py: its config.json for a
    dtype, whether experts are stored one tensor each, how many shards, stored tensors the family
    does not read (a vision tower: `extra_shapes(config)`), and what the releases store beyond the
    generic random tensors (`finish(config, tensors, rng)`)."""

    config: Callable[[str], dict]
    per_expert: bool = False
    shards: int = 1
    extra_shapes: Callable[[dict], dict[str, Shape]] | None = None
    finish: Callable[[dict, dict[str, np.ndarray], np.random.Generator], dict[str, np.ndarray]] | None = None


class Family(Protocol):
    """A model family: one package under checkpoint/families/ (its `tiny` module declares its tiny
    checkpoints, `TINY_KINDS`; the runtime never imports it). Optional as well:
    `BLOCK_FP8` (reads DeepSeek's fp8 block-quantized releases), `unused_tensors(desc)` (stored names
    that may be present and are never read) and `fit_mtp_to_tensors(desc, stored names)` (the MTP
    spec as the stored tensors have it, where config.json cannot say)."""

    FAMILY: str
    ARCHITECTURES: dict[str, tuple[str, str, str | None]]  # -> (model_type, text-weight prefix, text-config key)
    IGNORED_PREFIXES: tuple[str, ...]                      # stored tensors of other modalities
    CHAT_FORMATS: dict[str, dict]                          # -> tool-call and reasoning formats the server parses

    def text_config(self, config: dict, architecture: str) -> dict: ...
    def mtp_layout(self, text_config: dict) -> MTPLayout: ...
    def describe(self, config: dict, architecture: str, *, mtp_layers: int, mtp_source: str) -> ModelDescription: ...
    def sources(self, desc: ModelDescription, per_expert: bool = False) -> dict[str, Source]: ...


# ---- config.json ---------------------------------------------------------------------------

def config_value(cfg: dict, key: str, default=None, required: bool = True):
    """cfg[key]; a missing or null key gives `default`, or a ConfigError when there is none."""
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if default is None and required:
        raise ConfigError(f"'{key}' is missing")
    return default


def text_config(config: dict, key: str | None) -> dict:
    """The text model's config: the wrapper's `text_config` section, or the whole file."""
    return (config.get(key) or {}) if key else config


def checkpoint_dtype(top: dict, cfg: dict, default: str = "float32") -> str:
    """The weights' dtype from `dtype` / `torch_dtype` at the top level or in the text config."""
    name = str(top.get("dtype") or top.get("torch_dtype") or cfg.get("dtype") or cfg.get("torch_dtype") or default)
    if name not in TORCH_DTYPES:
        raise ConfigError(f"dtype {name!r} is not supported (use bfloat16, float16 or float32)")
    return TORCH_DTYPES[name]


def eos_token_ids(top: dict, cfg: dict) -> tuple[int, ...]:
    eos = top.get("eos_token_id", cfg.get("eos_token_id"))
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))


def rope_settings(cfg: dict, head_dim: int, default_partial_factor: float) -> tuple[int, float, tuple[int, ...] | None]:
    """(rotary_dim, theta, mrope_section) from `rope_parameters` (transformers 5) or the older
    top-level `rope_theta` / `partial_rotary_factor` / `rope_scaling` keys: NeoX RoPE on the first
    rotary_dim dims of each head (mrope_section: Qwen3.5's text streams, all equal for text)."""
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"rope_type {rope_type!r} is not supported yet (supported: {SUPPORTED_ROPE_TYPES})")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    factor = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default_partial_factor)))
    mrope = params.get("mrope_section")
    return int(head_dim * factor), theta, (tuple(mrope) if mrope else None)


# ---- NextN heads: head j stored as decoder layer N + j (DeepSeek-V3, Step-3.5, GLM) ----------

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def nextn_layout(cfg: dict) -> MTPLayout:
    """NextN head j is stored as decoder layer N+j (`model.layers.{N+j}.*`)."""
    n = int(config_value(cfg, "num_hidden_layers"))

    def layer_of(name: str) -> int | None:
        m = _LAYER.match(name)
        return int(m.group(1)) - n if m and int(m.group(1)) >= n else None

    return MTPLayout("num_nextn_predict_layers", f"NextN (model.layers.{n}.* and up)",
                     lambda name: layer_of(name) is not None, layer_of, lambda j: f"model.layers.{n + j}.")


def nextn_shapes(d: ModelDescription, j: int) -> dict[str, Shape]:
    """NextN head j's own tensors besides its decoder layer: the embedding and hidden norms, the
    projection of their concatenation, its final norm and (where the heads have their own) lm head."""
    h, p = d.hidden_size, f"mtp.layers.{j}."
    out = {p + "enorm.weight": (h,), p + "hnorm.weight": (h,), p + "eh_proj.weight": (h, 2 * h),
           p + "shared_head.norm.weight": (h,)}
    if d.mtp.own_lm_head:
        out[p + "shared_head.head.weight"] = (d.vocab_size, h)
    return out


def nextn_stored(canonical: str, n: int) -> str:
    """`mtp.layers.{j}.rest` -> `layers.{n + j}.rest` (without the `model.` prefix); other names as they are."""
    if canonical.startswith("mtp.layers."):
        j, rest = canonical.removeprefix("mtp.layers.").split(".", 1)
        return f"layers.{n + int(j)}.{rest}"
    return canonical


def nextn_unused_tensors(desc: ModelDescription) -> frozenset[str]:
    """Stored tensors a NextN checkpoint may hold that are never read: each head's copy of the
    embedding (the heads embed with the target's embed_tokens)."""
    n, heads = desc.num_layers, desc.mtp.num_layers if desc.mtp else 0
    return frozenset(f"model.layers.{n + j}.embed_tokens.weight" for j in range(heads))


def nextn_fit_lm_heads(desc: ModelDescription, stored: frozenset[str]) -> ModelDescription:
    """The description as the stored NextN tensors have it (config.json cannot say): when no head
    stores `shared_head.head` (published as a copy of lm_head, so some conversions drop it), every
    head projects with the target's lm_head; when any does, each uses its own (and a head without
    one is reported missing). `stored`: the names in the folder the NextN tensors come from."""
    if desc.mtp is None:
        return desc
    n = desc.num_layers
    heads = [f"model.layers.{n + j}.shared_head.head.weight" for j in range(desc.mtp.num_layers)]
    if any(name in stored for name in heads):
        return desc
    return replace(desc, mtp=replace(desc.mtp, own_lm_head=False))

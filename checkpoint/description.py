"""The frozen description of a model that every later stage reads.

Built from config.json alone (families/*.py); shapes are then checked against the safetensors
headers (validation.py). Nothing here reads weights. Sizes follow the runtime's layouts:
KV rows per full-attention layer [Hkv, head_dim] for K and V; Gated DeltaNet recurrent state
[Hv, dk, dv] in fp32 and conv state [conv_dim, K-1] in the activation dtype.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class LayerKind(str, Enum):
    FULL_ATTENTION = "full_attention"
    LINEAR_ATTENTION = "linear_attention"  # Gated DeltaNet


class MLPKind(str, Enum):
    DENSE = "dense"
    MOE = "moe"


@dataclass(frozen=True)
class AttentionSpec:
    """Gated full attention: q_proj gives [Hq, 2*head_dim] (query | gate) per head."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # partial NeoX RoPE on the first rotary_dim dims of each head
    rope_theta: float
    output_gate: bool = True
    qk_norm: bool = True
    bias: bool = False
    mrope_section: tuple[int, ...] | None = None  # text-only input: all three streams equal

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_kv_heads}")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(f"rotary dim {self.rotary_dim} must be even and in 1..head_dim {self.head_dim}")


@dataclass(frozen=True)
class LinearAttentionSpec:
    """Gated DeltaNet dims. q/k heads are shared by r = Hv/Hk value heads each."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    def __post_init__(self):
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"linear_num_value_heads {self.num_value_heads} is not a multiple of "
                             f"linear_num_key_heads {self.num_key_heads}")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool = True

    def __post_init__(self):
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be in 1..num_experts {self.num_experts}")


@dataclass(frozen=True)
class LayerSpec:
    kind: LayerKind
    mlp: MLPKind


@dataclass(frozen=True)
class MTPSpec:
    """The MTP head(s): shared fc / pre-fc norms / final norm, and `num_layers` decoder layers
    (each a full-attention layer with its own KV). Chained drafting uses layer s % num_layers
    at step s; the reused mode uses layer 0 every step."""

    num_layers: int
    layer: LayerSpec
    source: str  # "checkpoint" or the draft folder's path


@dataclass(frozen=True)
class ModelDescription:
    family: str
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layers: tuple[LayerSpec, ...]
    attention: AttentionSpec
    linear_attention: LinearAttentionSpec
    moe: MoESpec | None
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    dtype: str  # the checkpoint's declared dtype ("bfloat16", "float16", "float32")
    mtp: MTPSpec | None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Norms are zero-centred RMSNorm x*rsqrt(mean(x^2)+eps)*(1+w), except the GDN output norm.
    norm_zero_centred: bool = True

    def __post_init__(self):
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_indices(self, kind: LayerKind) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if layer.kind == kind]

    def kv_bytes_per_token(self, dtype: str | None = None, include_mtp: bool = True) -> int:
        """K and V bytes one token occupies across all full-attention layers (+ MTP layers)."""
        a = self.attention
        per_layer = 2 * a.num_kv_heads * a.head_dim * DTYPE_BYTES[dtype or self.dtype]
        n = len(self.layer_indices(LayerKind.FULL_ATTENTION))
        if include_mtp and self.mtp is not None:
            n += self.mtp.num_layers
        return n * per_layer

    def state_bytes_per_sequence(self, dtype: str | None = None) -> int:
        """Gated DeltaNet state one sequence holds: fp32 recurrent + conv window (K-1 inputs)."""
        g = self.linear_attention
        recurrent = g.num_value_heads * g.key_head_dim * g.value_head_dim * 4
        conv = g.conv_dim * (g.conv_kernel - 1) * DTYPE_BYTES[dtype or self.dtype]
        return len(self.layer_indices(LayerKind.LINEAR_ATTENTION)) * (recurrent + conv)


def description_to_dict(desc: ModelDescription) -> dict:
    """JSON-safe form (enums as their values); the engine manifest stores it."""
    return _plain(asdict(desc))


def description_from_dict(data: dict) -> ModelDescription:
    """Inverse of description_to_dict: the pipeline rebuilds the description from the manifest."""
    layer = lambda d: LayerSpec(LayerKind(d["kind"]), MLPKind(d["mlp"]))  # noqa: E731
    mtp = data.get("mtp")
    return ModelDescription(
        **{k: v for k, v in data.items() if k not in ("layers", "attention", "linear_attention", "moe", "mtp",
                                                       "eos_token_ids")},
        layers=tuple(layer(x) for x in data["layers"]),
        attention=AttentionSpec(**{**data["attention"], "mrope_section": tuple(data["attention"]["mrope_section"])
                                   if data["attention"].get("mrope_section") else None}),
        linear_attention=LinearAttentionSpec(**data["linear_attention"]),
        moe=MoESpec(**data["moe"]) if data.get("moe") else None,
        mtp=MTPSpec(mtp["num_layers"], layer(mtp["layer"]), mtp["source"]) if mtp else None,
        eos_token_ids=tuple(data.get("eos_token_ids", ())))


def _plain(x):
    if isinstance(x, Enum):
        return x.value
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x

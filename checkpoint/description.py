"""The frozen description of a model that every later stage reads.

Built from config.json alone (families/*.py); shapes are then checked against the safetensors
headers (validation.py). Nothing here reads weights. Every trunk layer and every MTP head layer
carries its own mixer spec (a family with one shape for all its attention layers shares one spec
object between them), and each mixer spec declares the pools its layer keeps (cache_specs.py):
attention paged K and V rows [Hkv, head_dim] (with its sliding window, if any); Gated DeltaNet a
recurrent state [Hv, dk, dv] in fp32 and a conv window [K-1, conv_dim] in the activation dtype;
multi-head latent attention (mla_specs.py) one latent row [kv_lora_rank + rope] and, with a
lightning indexer, one indexer key row [index_head_dim]. Every later size and shape is derived
from these declarations.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from enum import Enum

from tandem.checkpoint.cache_specs import (
    CONV,
    DTYPE_BYTES,
    KEY,
    RECURRENT,
    VALUE,
    LayerCache,
    PagedKVSpec,
    StateSpec,
    page_bytes,
    slot_bytes,
)
from tandem.checkpoint.mla_specs import MLASpec


class LayerKind(str, Enum):
    FULL_ATTENTION = "full_attention"
    LINEAR_ATTENTION = "linear_attention"  # Gated DeltaNet


class MLPKind(str, Enum):
    DENSE = "dense"
    MOE = "moe"


@dataclass(frozen=True)
class AttentionSpec:
    """GQA with optional gates. `output_gate`: q_proj gives [Hq, 2*head_dim] (query | gate) per
    head and the output is multiplied elementwise by sigmoid(gate) (Qwen). `head_gate`: g_proj
    [Hq, H] gives one sigmoid gate per head (Step-3.5). `window`: the layer attends to the last
    `window` positions only (None: full attention). `softmax_scale` None: head_dim^-0.5. `bias`: q/k/v
    projections carry biases; `o_bias`: o_proj does (Qwen, Step: both from attention_bias; GLM: q/k/v only)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # partial NeoX RoPE on the first rotary_dim dims of each head
    rope_theta: float
    output_gate: bool = True
    qk_norm: bool = True
    bias: bool = False
    o_bias: bool = False
    mrope_section: tuple[int, ...] | None = None  # text-only input: all three streams equal
    window: int | None = None
    head_gate: bool = False
    softmax_scale: float | None = None

    def __post_init__(self):
        if self.output_gate and self.head_gate:
            raise ValueError("an attention layer has either the packed output gate or the head-wise g_proj gate, "
                             "not both")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_kv_heads}")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(f"rotary dim {self.rotary_dim} must be even and in 1..head_dim {self.head_dim}")
        if self.window is not None and (not isinstance(self.window, int) or self.window < 1):
            raise ValueError(f"sliding window {self.window!r} must be a positive number of positions (or None)")

    @property
    def scale(self) -> float:
        return self.softmax_scale if self.softmax_scale is not None else float(self.head_dim ** -0.5)

    @property
    def reuses_previous_selection(self) -> bool:
        """Whether the layer attends the positions the previous layer selected (only sparse MLA can)."""
        return False

    @classmethod
    def from_dict(cls, d: dict) -> AttentionSpec:
        """Inverse of dataclasses.asdict (the manifest's JSON has lists for tuples)."""
        return cls(**{**d, "mrope_section": tuple(d["mrope_section"]) if d.get("mrope_section") else None})

    def cache_specs(self) -> tuple[PagedKVSpec, ...]:
        row = (self.num_kv_heads, self.head_dim)
        return (PagedKVSpec(KEY, row, "keys (post-RoPE)", window=self.window),
                PagedKVSpec(VALUE, row, "values", window=self.window))


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

    @property
    def reuses_previous_selection(self) -> bool:
        return False

    @classmethod
    def from_dict(cls, d: dict) -> LinearAttentionSpec:
        return cls(**d)

    def cache_specs(self) -> tuple[StateSpec, ...]:
        return (StateSpec(RECURRENT, (self.num_value_heads, self.key_head_dim, self.value_head_dim),
                          "Gated DeltaNet states", dtype="float32"),
                StateSpec(CONV, (self.conv_kernel - 1, self.conv_dim),
                          "conv windows (the last K-1 conv inputs, position-major)"))


MOE_ROUTERS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoESpec:
    """Routed experts plus one shared expert (size 0: none).

    router "softmax" (Qwen): p = softmax(gate(x)); top-k of p; weights p[top] (renormalised when
    norm_topk_prob). router "sigmoid" (Step-3.5, DeepSeek-V3): s = sigmoid(gate(x)); top-k of
    s + e_score_correction_bias when score_correction_bias; weights s[top] (renormalised when
    norm_topk_prob). Either way the routed sum is multiplied by routed_scaling_factor. The shared
    expert's output is multiplied by sigmoid(shared_expert_gate(x)) when shared_expert_gate.
    Group-limited routing (DeepSeek-V3): experts form n_group equal groups; a group scores the sum
    of its two best choice scores, only the topk_group best groups stay eligible for the top-k.
    n_group 1: no grouping."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool = True
    router: str = "softmax"
    score_correction_bias: bool = False
    routed_scaling_factor: float = 1.0
    shared_expert_gate: bool = True
    n_group: int = 1
    topk_group: int = 1

    def __post_init__(self):
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be in 1..num_experts {self.num_experts}")
        if self.router not in MOE_ROUTERS:
            raise ValueError(f"MoE router {self.router!r} is not one of {MOE_ROUTERS}")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(f"n_group {self.n_group} must be a positive divisor of num_experts {self.num_experts}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group {self.topk_group} must be in 1..n_group {self.n_group}")
        per_group = self.num_experts // self.n_group
        if self.n_group > 1 and per_group < 2:
            raise ValueError(f"n_group {self.n_group} leaves {per_group} expert per group; group scores sum each "
                             "group's two best experts, so every group needs at least 2")
        if self.top_k > self.topk_group * per_group:
            raise ValueError(f"num_experts_per_tok {self.top_k} exceeds the {self.topk_group} x {per_group} experts "
                             "the topk_group best groups hold")


Mixer = AttentionSpec | MLASpec | LinearAttentionSpec
# every layer mixer, declared once: its spec type -> (the kind of layer it makes, its name in manifests
# and `tandem inspect`). Export (export/mixers.py) and the summary (checkpoint/summary.py) key their
# own per-mixer code by these names.
MIXERS: dict[type, tuple[LayerKind, str]] = {
    AttentionSpec: (LayerKind.FULL_ATTENTION, "attention"),
    MLASpec: (LayerKind.FULL_ATTENTION, "mla"),
    LinearAttentionSpec: (LayerKind.LINEAR_ATTENTION, "gated_deltanet"),
}
_MIXER_BY_NAME = {name: spec_type for spec_type, (_, name) in MIXERS.items()}


def mixer_name(spec: Mixer) -> str:
    return MIXERS[type(spec)][1]


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: its own mixer spec and its MLP kind. SwiGLU clamps (Step-3.5):
    act = min(silu(gate), L) * clamp(up, -L, L); `swiglu_limit` for the dense MLP or the routed
    experts, `shared_swiglu_limit` for the shared expert; None: no clamp."""

    mixer: Mixer
    mlp: MLPKind
    swiglu_limit: float | None = None
    shared_swiglu_limit: float | None = None

    def __post_init__(self):
        for name in ("swiglu_limit", "shared_swiglu_limit"):
            limit = getattr(self, name)
            if limit is not None and not limit > 0:
                raise ValueError(f"{name} {limit!r} must be positive (or None for no clamp)")

    @property
    def kind(self) -> LayerKind:
        return MIXERS[type(self.mixer)][0]


MTP_FORMS = ("fc", "nextn")
MTP_ANCHORS = ("target", "previous_head")


@dataclass(frozen=True)
class MTPSpec:
    """The MTP head(s): one decoder layer per head (each with its own mixer spec and KV) and the
    input projection around it. Chained drafting uses layer s % num_layers at step s; the reused
    mode uses layer 0 every step.

    form "fc" (Qwen): x = mtp.fc(cat[pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)]), one fc,
        norm pair and final mtp.norm shared by all head layers.
    form "nextn" (Step-3.5, DeepSeek-V3): per head j, x = eh_proj(cat[enorm(e), hnorm(h)]) and its
        own final norm shared_head.norm; logits from its own shared_head.head when own_lm_head,
        else from the target's lm_head.
    anchor "target": every head's committed rows pair tokens with the target's hidden (vLLM's MTP).
    anchor "previous_head": head j > 0's committed rows pair tokens with head j-1's hidden at the
        same rows, head j one token ahead of head j-1 (transformers' chained NextN: Step-3.5)."""

    layers: tuple[LayerSpec, ...]
    source: str  # "checkpoint" or the draft folder's path
    form: str = "fc"
    own_lm_head: bool = False
    anchor: str = "target"

    def __post_init__(self):
        if not self.layers:
            raise ValueError("an MTP spec needs at least one head layer")
        if self.form not in MTP_FORMS:
            raise ValueError(f"MTP form {self.form!r} is not one of {MTP_FORMS}")
        if self.anchor not in MTP_ANCHORS:
            raise ValueError(f"MTP anchor {self.anchor!r} is not one of {MTP_ANCHORS}")
        if self.own_lm_head and self.form != "nextn":
            raise ValueError("only NextN heads carry their own lm head (shared_head.head)")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def layer(self) -> LayerSpec:
        """Head 0's layer (the one the reused mode runs every step)."""
        return self.layers[0]


@dataclass(frozen=True)
class ModelDescription:
    family: str
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layers: tuple[LayerSpec, ...]
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

    @property
    def all_layers(self) -> tuple[LayerSpec, ...]:
        """Trunk layers, then the MTP head layers."""
        return self.layers + (self.mtp.layers if self.mtp else ())

    @property
    def attention(self) -> AttentionSpec:
        """The first attention layer's spec (trunk, then heads): the one every attention layer
        shares in families with a single attention shape. Per-layer readers use layers[i].mixer."""
        for layer in self.all_layers:
            if mixer_name(layer.mixer) == "attention":
                return layer.mixer
        raise ValueError(f"{self.architecture} has no attention layer")

    @property
    def linear_attention(self) -> LinearAttentionSpec | None:
        """The first Gated DeltaNet layer's spec; None for a model without one."""
        return next((layer.mixer for layer in self.all_layers if mixer_name(layer.mixer) == "gated_deltanet"), None)

    def layer_caches(self, mtp_layers: int | None = None) -> tuple[LayerCache, ...]:
        """The pools of every trunk layer, then of MTP heads 0..mtp_layers-1 (None: all the model has)."""
        heads = (self.mtp.num_layers if self.mtp else 0) if mtp_layers is None else mtp_layers
        if heads and self.mtp is None:
            raise ValueError(f"{heads} MTP head layer(s) asked for, but the model has no MTP head")
        trunk = tuple(LayerCache(i, layer.mixer.cache_specs()) for i, layer in enumerate(self.layers))
        return trunk + tuple(self.head_cache(j) for j in range(heads))

    def head_cache(self, j: int) -> LayerCache:
        return LayerCache(j, self.mtp.layers[j].mixer.cache_specs(), head=True)

    def kv_bytes_per_token(self, dtype: str | None = None, include_mtp: bool = True) -> int:
        """Bytes one token's rows occupy across every paged pool of the trunk (+ MTP layers)."""
        caches = self.layer_caches(None if include_mtp else 0)
        return page_bytes(caches, 1, DTYPE_BYTES[dtype or self.dtype])

    def state_bytes_per_sequence(self, dtype: str | None = None) -> int:
        """State one sequence holds across the trunk's state pools (Gated DeltaNet: fp32 recurrent +
        conv window of K-1 inputs)."""
        return slot_bytes(self.layer_caches(0), DTYPE_BYTES[dtype or self.dtype])


def description_to_dict(desc: ModelDescription) -> dict:
    """JSON-safe form (enums as their values); the engine manifest stores it. Each layer holds its
    mixer as {"kind": ..., "spec": {...}}."""
    data = _plain({f.name: getattr(desc, f.name) for f in fields(desc) if f.name not in ("layers", "mtp", "moe")})
    data["moe"] = asdict(desc.moe) if desc.moe else None
    data["layers"] = [_layer_dict(x) for x in desc.layers]
    data["mtp"] = ({"layers": [_layer_dict(x) for x in desc.mtp.layers],
                    **{f.name: getattr(desc.mtp, f.name) for f in fields(desc.mtp) if f.name != "layers"}}
                   if desc.mtp else None)
    return data


def description_from_dict(data: dict) -> ModelDescription:
    """Inverse of description_to_dict: the pipeline rebuilds the description from the manifest.
    Also reads the form written before per-layer mixers (one global "attention" and
    "linear_attention" spec, layers as {"kind", "mlp"}, mtp as {"num_layers", "layer"})."""
    shared = {LayerKind.FULL_ATTENTION: data.get("attention"), LayerKind.LINEAR_ATTENTION: data.get("linear_attention")}
    cache: dict = {}
    layer = lambda d: _layer_from_dict(d, shared, cache)  # noqa: E731
    mtp = data.get("mtp")
    if mtp:
        heads = (tuple(layer(x) for x in mtp["layers"]) if "layers" in mtp
                 else (layer(mtp["layer"]),) * mtp["num_layers"])
    return ModelDescription(
        **{k: v for k, v in data.items() if k not in ("layers", "attention", "linear_attention", "moe", "mtp",
                                                       "eos_token_ids")},
        layers=tuple(layer(x) for x in data["layers"]),
        moe=MoESpec(**data["moe"]) if data.get("moe") else None,
        mtp=MTPSpec(heads, **{k: v for k, v in mtp.items() if k not in ("layers", "layer", "num_layers")})
        if mtp else None,
        eos_token_ids=tuple(data.get("eos_token_ids", ())))


def _layer_dict(layer: LayerSpec) -> dict:
    return {"kind": layer.kind.value, "mixer_type": mixer_name(layer.mixer), "mixer": _plain(asdict(layer.mixer)),
            "mlp": layer.mlp.value, "swiglu_limit": layer.swiglu_limit,
            "shared_swiglu_limit": layer.shared_swiglu_limit}


def _layer_from_dict(d: dict, shared: dict, cache: dict) -> LayerSpec:
    """Equal mixer dicts give one shared spec object, as the families build them."""
    kind = LayerKind(d["kind"])
    spec = d.get("mixer", shared[kind])
    if spec is None:
        raise ValueError(f"a {kind.value} layer has no mixer spec in the description")
    name = d.get("mixer_type") or _legacy_mixer_name(kind, spec)   # manifests written before mixer_type
    key = (name, repr(sorted(spec.items())))
    if key not in cache:
        cache[key] = _MIXER_BY_NAME[name].from_dict(spec)
    return LayerSpec(cache[key], MLPKind(d["mlp"]), d.get("swiglu_limit"), d.get("shared_swiglu_limit"))


def _legacy_mixer_name(kind: LayerKind, spec: dict) -> str:
    if kind == LayerKind.LINEAR_ATTENTION:
        return "gated_deltanet"
    return "mla" if "kv_lora_rank" in spec else "attention"


def _plain(x):
    if isinstance(x, Enum):
        return x.value
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x

"""Multi-head latent attention (DeepSeek-V2/V3, V3.2, GLM-5) and its lightning indexer, as mixer specs.

Built from config.json by the DeepSeek-DSA family (checkpoint/families/deepseek_dsa/); read by export and
the pipeline exactly like AttentionSpec. Everything config-dependent is resolved here, so export
needs no config: the softmax scale (YaRN's mscale_all_dim folded in), the RoPE inverse frequencies
(`inv_freq()`, YaRN ramp included) and the cos/sin multiplier (`rope_attention_factor`).

Per layer, with x [T, hidden]:
    q      = q_b_proj(q_a_layernorm(q_a_proj(x)))  (q_lora_rank None: q_proj(x))   [T, H, nope + rope]
    ckv    = kv_a_proj_with_mqa(x) = [latent | k_rope]                               [T, kv_lora_rank + rope]
    latent = kv_a_layernorm(latent); k_rope = RoPE(k_rope) (one key head shared by all heads)
    kv_b_proj(latent) = [k_nope | v] per head                                        [T, H, nope + v]
The cache keeps [latent | k_rope] per token (pool "latent"): decode absorbs W_UK into the query
(q_nope @ W_UK -> [H, kv_lora_rank]) and applies W_UV after attending over the latent rows.

The indexer (DeepSeek Sparse Attention): q_i = wq_b(q_a_layernorm(q_a_proj(x))) [T, Hi, Di],
k = LayerNorm(wk(x)) [T, Di] (pool "index_keys"), both RoPE'd on their first `rope` dims;
score[s, t] = sum_h relu(q_h[s] . k[t] * Di^-0.5) * weights_proj(x)[s, h] * Hi^-0.5, causal; each
query row attends to its top-`topk` positions only (dense when the context is shorter). A layer
with `reuse_previous` has no indexer weights or key pool: it takes the previous layer's selection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tandem.checkpoint.cache_specs import PagedKVSpec

LATENT, INDEX_KEYS = "latent", "index_keys"  # MLA pools: compressed latent + rope key; indexer keys


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention-temperature factor (transformers' yarn_get_mscale)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YarnSpec:
    """YaRN RoPE scaling as transformers 5.24 computes it (`_compute_yarn_parameters`): inverse
    frequencies blended between interpolation (/factor) and extrapolation by a linear ramp over
    the correction range of beta_fast..beta_slow rotations, and cos/sin multiplied by
    `attention_factor` (resolved from mscale / mscale_all_dim when the config gives none)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # None: resolved below
    truncate: bool = True

    def __post_init__(self):
        if not self.factor >= 1:
            raise ValueError(f"YaRN factor {self.factor!r} must be >= 1")
        if not self.original_max_position_embeddings > 0:
            raise ValueError(f"YaRN original_max_position_embeddings {self.original_max_position_embeddings!r} "
                             "must be positive")
        if not self.beta_fast > self.beta_slow > 0:
            raise ValueError(f"YaRN beta_fast {self.beta_fast} must exceed beta_slow {self.beta_slow} (both > 0)")

    @property
    def cos_sin_factor(self) -> float:
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def inv_freq(self, dim: int, theta: float) -> np.ndarray:
        """[dim // 2] float32 inverse frequencies (float32 arithmetic, as transformers' torch code)."""
        pos = np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
        extrapolation, interpolation = np.float32(1) / pos, np.float32(1) / (np.float32(self.factor) * pos)

        def correction_dim(rotations: float) -> float:
            return dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
                2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        high = high + 0.001 if low == high else high  # transformers: no singular ramp
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
        keep = np.float32(1) - ramp.astype(np.float32)  # extrapolation weight
        return (interpolation * (np.float32(1) - keep) + extrapolation * keep).astype(np.float32)


@dataclass(frozen=True)
class IndexerSpec:
    """The lightning indexer of one layer. `rope_interleave`: RoPE on (even, odd) pairs (GLM-5)
    rather than NeoX halves (DeepSeek-V3.2). `reuse_previous`: GLM-5's shared layer, which runs
    no indexer and attends to the previous layer's top-k selection."""

    num_heads: int
    head_dim: int
    topk: int
    rope_interleave: bool = False
    reuse_previous: bool = False
    norm_eps: float = 1e-6  # k_norm is a LayerNorm with weight and bias

    def __post_init__(self):
        for name in ("num_heads", "head_dim", "topk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"indexer {name} {value!r} must be a positive integer")

    @property
    def scale(self) -> float:
        return float(self.head_dim ** -0.5)

    @property
    def weights_scale(self) -> float:
        """weights_proj(x) is multiplied by Hi^-0.5 before the sum over heads."""
        return float(self.num_heads ** -0.5)


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (see the module docstring for the math). `rope_interleave`:
    the main attention's RoPE pairs (even, odd) dims (DeepSeek-V3 and later). `yarn` None: plain
    RoPE. `softmax_scale`: the resolved scale (qk_head_dim^-0.5, times mscale(factor,
    mscale_all_dim)^2 under YaRN); None computes it from the other fields."""

    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    rope_interleave: bool = True
    yarn: YarnSpec | None = None
    softmax_scale: float | None = None
    indexer: IndexerSpec | None = None
    bias: bool = False  # attention_bias: q_a_proj (q_proj), kv_a_proj_with_mqa and o_proj carry biases
    norm_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm

    def __post_init__(self):
        for name in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MLA {name} {value!r} must be a positive integer")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank < 1):
            raise ValueError(f"MLA q_lora_rank {self.q_lora_rank!r} must be a positive integer (or None: plain q_proj)")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MLA qk_rope_head_dim {self.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        if not self.rope_theta > 0:
            raise ValueError(f"MLA rope_theta {self.rope_theta!r} must be positive")
        if self.indexer is not None:
            if self.q_lora_rank is None:
                raise ValueError("the lightning indexer reads the q LoRA residual (q_a_layernorm(q_a_proj(x))), so "
                                 "it needs q_lora_rank; a layer without q LoRA cannot have an indexer")
            if self.indexer.head_dim < self.qk_rope_head_dim:
                raise ValueError(f"indexer head_dim {self.indexer.head_dim} is smaller than qk_rope_head_dim "
                                 f"{self.qk_rope_head_dim}: the indexer RoPEs its first qk_rope_head_dim dims")
        if self.softmax_scale is None:
            object.__setattr__(self, "softmax_scale", self.resolved_scale())

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """One cached row: the normed latent then the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        return float(self.softmax_scale)

    @property
    def window(self) -> None:
        """MLA attends over the whole context: its pools are on the full-attention page group."""
        return None

    def resolved_scale(self) -> float:
        """transformers' yarn_apply_mscale: qk_head_dim^-0.5 * mscale(factor, mscale_all_dim)^2."""
        scale = self.qk_head_dim ** -0.5
        if self.yarn is not None and self.yarn.mscale_all_dim:
            scale *= yarn_mscale(self.yarn.factor, self.yarn.mscale_all_dim) ** 2
        return float(scale)

    @property
    def rope_attention_factor(self) -> float:
        """cos and sin are multiplied by this (YaRN's attention factor; 1 for plain RoPE)."""
        return self.yarn.cos_sin_factor if self.yarn is not None else 1.0

    def inv_freq(self) -> np.ndarray:
        """[qk_rope_head_dim // 2] float32 RoPE inverse frequencies, shared by the attention and
        the indexer (both rotate qk_rope_head_dim dims)."""
        dim = self.qk_rope_head_dim
        if self.yarn is not None:
            return self.yarn.inv_freq(dim, self.rope_theta)
        return (np.float32(1) / np.float32(self.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32)
                                                                / np.float32(dim))).astype(np.float32)

    def cache_specs(self) -> tuple[PagedKVSpec, ...]:
        # one kv head: the pool is PagedSparseAttention's [N, S, 1, r + rope], read as key and value
        latent = PagedKVSpec(LATENT, (1, self.latent_dim), "compressed latent (kv_a_layernorm) | rope key (post-RoPE)")
        if self.indexer is None or self.indexer.reuse_previous:
            return (latent,)
        return latent, PagedKVSpec(INDEX_KEYS, (self.indexer.head_dim,), "indexer keys (k_norm, post-RoPE)")

    @property
    def reuses_previous_selection(self) -> bool:
        """GLM-5's "shared" layers attend the top-k the previous layer's indexer selected."""
        return bool(self.indexer and self.indexer.reuse_previous)

    @classmethod
    def from_dict(cls, d: dict) -> MLASpec:
        """Inverse of dataclasses.asdict (nested YaRN and indexer specs)."""
        return cls(**{**d, "yarn": YarnSpec(**d["yarn"]) if d.get("yarn") else None,
                      "indexer": IndexerSpec(**d["indexer"]) if d.get("indexer") else None})

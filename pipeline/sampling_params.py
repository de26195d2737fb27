"""Per-request generation settings, validated at construction."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from tandem.contract import MIN_TEMPERATURE


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0          # below MIN_TEMPERATURE (1e-5): greedy
    top_k: int = 0                    # 0 (or at least the vocabulary): off
    top_p: float = 1.0                # 1: off
    seed: int | None = None           # same seed + same prompt -> same output, whatever the batch (None: OS entropy)
    stop: tuple[str, ...] = ()        # stop strings (not included in the output)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    speculative: bool = True          # draft with the MTP heads (when the engines have them)
    k: int | None = None              # draft tokens per round for this request (None: the engine's)
    p_min: float = 0.0                # stop drafting when the head's probability falls below this

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:  # NaN fails too
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.seed is not None and not isinstance(self.seed, numbers.Integral):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.k is not None and self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        if not 0.0 <= self.p_min < 1.0:
            raise ValueError(f"p_min must be in [0, 1), got {self.p_min}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.seed is not None:
            object.__setattr__(self, "seed", int(self.seed))

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

"""Per-request generation settings, validated at construction (relaxed acceptance and grammars among them)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.contract import MIN_TEMPERATURE

if TYPE_CHECKING:
    from tandem.pipeline.grammar import GrammarSpec


@dataclass(frozen=True)
class RelaxedAcceptance:
    """Opt-in relaxed acceptance (export/acceptance.py, TensorRT-LLM's rule): a greedy request also
    accepts a draft that is among the target's `top_k` most likely tokens and whose probability is
    at least the top token's minus `delta`; with `thinking_only`, only while the sequence is inside a
    thinking span (<think> ... </think>). Trades exactness for accepted length: the output is no
    longer plain greedy decoding's. top_k 0 is off (a request can turn off an engine default)."""

    top_k: int
    delta: float
    thinking_only: bool = False

    def __post_init__(self):
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) or self.top_k < 0:
            raise ValueError(f"relaxed_acceptance.top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if (isinstance(self.delta, bool) or not isinstance(self.delta, numbers.Real)
                or not 0.0 <= self.delta <= 1.0):  # NaN fails too
            raise ValueError(f"relaxed_acceptance.delta must be a probability gap in [0, 1], got {self.delta!r}")
        if not isinstance(self.thinking_only, bool):
            raise ValueError(f"relaxed_acceptance.thinking_only must be true or false, got {self.thinking_only!r}")
        object.__setattr__(self, "top_k", int(self.top_k))
        object.__setattr__(self, "delta", float(self.delta))

    @property
    def on(self) -> bool:
        return self.top_k > 0


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
    relaxed: RelaxedAcceptance | None = None  # relaxed acceptance (greedy only); None: the engine's default
    grammar: GrammarSpec | None = None  # structured output (pipeline/grammar.py): every token obeys it

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
        if isinstance(self.relaxed, dict):
            unknown = set(self.relaxed) - {"top_k", "delta", "thinking_only"}
            if unknown or not {"top_k", "delta"} <= set(self.relaxed):
                raise ValueError(f"relaxed_acceptance takes top_k, delta and optionally thinking_only, got "
                                 f"{sorted(self.relaxed)}")
            object.__setattr__(self, "relaxed", RelaxedAcceptance(**self.relaxed))
        if self.relaxed is not None and not isinstance(self.relaxed, RelaxedAcceptance):
            raise ValueError(f"relaxed must be a RelaxedAcceptance (or a dict of its fields), got "
                             f"{type(self.relaxed).__name__}")
        if self.relaxed is not None and self.relaxed.on and not self.greedy:
            raise ValueError(f"relaxed acceptance applies to greedy decoding only, but temperature is "
                             f"{self.temperature}: send temperature 0, or drop relaxed_acceptance (sampling "
                             "already accepts drafts by their probability)")
        if self.grammar is not None:
            from tandem.pipeline.grammar import GrammarSpec  # here: grammar.py imports request_checks, which imports us
            if not isinstance(self.grammar, GrammarSpec):
                raise ValueError(f"grammar must be a GrammarSpec, got {type(self.grammar).__name__}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.seed is not None:
            object.__setattr__(self, "seed", int(self.seed))

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

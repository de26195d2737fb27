"""Per-request generation settings, validated at construction (relaxed acceptance and grammars among them)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.contract import MAX_LOGIT_BIAS_ENTRIES, MAX_LOGPROBS, MIN_TEMPERATURE

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
    # logits processors (pipeline/logits_processors.py), in the order they apply, as vLLM's:
    allowed_token_ids: tuple[int, ...] | None = None   # only these may be generated
    bad_words: tuple[str, ...] = ()   # never generated (as the tokenizer writes them, with and without a space)
    min_tokens: int = 0               # stop ids and EOS are banned until this many tokens are out
    logit_bias: tuple[tuple[int, float], ...] = ()     # (token id, bias added to its logit)
    repetition_penalty: float = 1.0   # prompt and output tokens: logit / r where positive, logit * r else
    frequency_penalty: float = 0.0    # output tokens: logit - f * count
    presence_penalty: float = 0.0     # output tokens: logit - p (once present)
    min_p: float = 0.0                # sampled rows: drop tokens below min_p * the top token's probability
    logprobs: int | None = None       # the target's log-probability of each emitted token, with the top N
    prompt_logprobs: int | None = None  # the same for each prompt token after the first
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True   # special tokens left out of the text (the ids keep them)
    cache_salt: str | None = None     # prefix cache: only requests with the same salt share cached prefixes
    spaces_between_special_tokens: bool = True   # false: adjacent added tokens as their own text (detokenizer.py)

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
        self._check_processors()

    def _check_processors(self) -> None:
        reals = {"repetition_penalty": self.repetition_penalty, "frequency_penalty": self.frequency_penalty,
                 "presence_penalty": self.presence_penalty, "min_p": self.min_p}
        for name, value in reals.items():
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2] (1 = off), got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if (isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, numbers.Integral)
                or self.min_tokens < 0):
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        bias = tuple(sorted((int(t), float(b)) for t, b in bias))
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are taken")
        for t, b in bias:
            if not (math.isfinite(b) and -100.0 <= b <= 100.0):
                raise ValueError(f"logit_bias[{t}] must be a number in [-100, 100], got {b}")
        object.__setattr__(self, "logit_bias", bias)
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        if self.allowed_token_ids is not None:
            if len(self.allowed_token_ids) == 0:
                raise ValueError("allowed_token_ids is empty: send at least one token id, or leave it out")
            object.__setattr__(self, "allowed_token_ids", tuple(int(t) for t in self.allowed_token_ids))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)
                                      or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] (or None), got {value!r}")

    @property
    def processed(self) -> bool:
        """Whether a logits processor shapes this request's logits (masks, bias or penalties)."""
        return bool(self.allowed_token_ids is not None or self.bad_words or self.min_tokens or self.logit_bias
                    or self.repetition_penalty != 1.0 or self.frequency_penalty or self.presence_penalty)

    def ending_ids(self, eos_ids) -> frozenset[int]:
        """The token ids that end the answer: `eos_ids` unless ignore_eos, and the stop ids."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

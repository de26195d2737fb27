"""Checks on one request's inputs, shared by `LLM.add_request` (offline) and the server (which runs
them when a request arrives, before it reaches the serve-loop thread). Each failure is a ValueError
(RequestError, with the field as `param`) that names the field, says what was wrong and what to
send instead; the server answers it with 400.

What is checked here is what the engines cannot survive: token ids outside the embedding table
(ONNX Runtime fails the whole batch, or a negative id silently wraps), integers beyond int64
(numpy refuses them when the engine buffers are filled), text that is not valid Unicode (the
tokenizer raises on a lone UTF-16 surrogate), and values of the wrong Python type.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tandem.pipeline.sampling_params import SamplingParams

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


class RequestError(ValueError):
    """A refused request; `param` is the field at fault (the OpenAI error's "param")."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class CheckedRequest:
    """A request that passed: its token ids and how it drafts."""

    ids: list[int]
    speculative: bool
    k: int              # drafts per round (0 when not speculative)
    k_fixed: bool       # k set by the request or globally, not by the batch size


def check_text(text: object, field: str) -> str:
    """`text` must be a str that encodes as UTF-8 (no lone surrogates such as '\\ud800')."""
    if not isinstance(text, str):
        raise RequestError(field, f"{field} must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start : e.end].encode("unicode_escape").decode("ascii")
        raise RequestError(field, f"{field} is not valid Unicode: a lone surrogate '{bad}' at index {e.start}; "
                                  "send valid Unicode text (surrogates only in pairs)") from None
    return text


def check_int(value: object, field: str, low: int = INT64_MIN, high: int = INT64_MAX) -> int:
    """An int (not a bool) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise RequestError(field, f"{field} must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise RequestError(field, f"{field}={value} is out of range: it must be between {low} and {high}")
    return int(value)


def check_token_ids(ids: Sequence, vocab_size: int, field: str = "prompt") -> list[int]:
    """Token ids as ints in [0, vocab_size); an empty list is refused."""
    if len(ids) == 0:
        raise RequestError(field, f"{field} is empty: send at least one token id")
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise RequestError(f"{field}[{i}]", f"{field}[{i}] must be an integer token id, got {type(t).__name__}")
        if not 0 <= t < vocab_size:
            raise RequestError(f"{field}[{i}]", f"{field}[{i}]: token id {t} is outside the vocabulary "
                                                f"[0, {vocab_size}); send ids the model's tokenizer produces")
        out.append(int(t))
    return out


def check_sampling(params: SamplingParams) -> None:
    """The integer fields of SamplingParams are ints within the bounds the engine buffers hold
    (SamplingParams itself checks the values' meaning)."""
    check_int(params.max_tokens, "max_tokens", 1)
    check_int(params.top_k, "top_k", 0)
    if params.seed is not None:
        check_int(params.seed, "seed")
    if params.k is not None:
        check_int(params.k, "spec_k", 1)
    if params.relaxed is not None:
        check_int(params.relaxed.top_k, "relaxed_acceptance.top_k", 0)
    for i, t in enumerate(params.stop_token_ids):
        check_int(t, f"stop_token_ids[{i}]")
    for i, s in enumerate(params.stop):
        check_text(s, f"stop[{i}]")
    for name in ("temperature", "top_p", "p_min"):
        value = getattr(params, name)
        if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)):
            raise RequestError(name, f"{name} must be a number, got {type(value).__name__}")


def check_token_filters(params: SamplingParams, bad_words: list[list[int]], stop_ids: frozenset[int]) -> None:
    """RequestError where allowed_token_ids, bad_words and min_tokens leave no token to generate: the
    engine would take a forbidden one (an EOS before min_tokens ends the answer at once, unasked)."""
    if params.allowed_token_ids is None:
        return
    left = set(params.allowed_token_ids) - {w[0] for w in bad_words if len(w) == 1}
    if not left:
        raise RequestError("allowed_token_ids", "allowed_token_ids: every id is banned by bad_words, so no token "
                           "could be generated; allow another token or drop the bad word")
    if params.min_tokens and left <= stop_ids:
        raise RequestError("min_tokens", f"min_tokens ({params.min_tokens}) bans EOS and the stop ids until that many "
                           "tokens are out, and allowed_token_ids leaves only those: allow other tokens, lower "
                           "min_tokens, or send ignore_eos")

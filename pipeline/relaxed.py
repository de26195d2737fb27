"""Relaxed acceptance on the host side: which setting a request runs with, whether it can run
(thinking-only needs the tokenizer's <think> / </think> tokens), and the verify graph's relaxed
inputs for each round. The rule itself is in the graph (export/acceptance.py).

Per round, for a sequence verifying rows [pending T, d_1 .. d_k]: relaxed_topk and relaxed_delta
come from its setting (0 when it has none), and row i may relax (relaxed_rows[i] = 1) when the
setting is not thinking-only, or when the sequence is inside a thinking span after tokens + d_1..d_i
(the tokens row i's logits see). A span opens at <think> and closes at </think>; a prompt that
ends inside one (a chat template's "<think>\\n") starts there. So a draft </think> may itself be
accepted relaxed, and every row after it judges exactly.

What has been scanned is remembered per sequence (only new tokens are read each round). Engine
dirs built before relaxed acceptance have no relaxed inputs: the runner does not bind them and
those engines accept exactly, whatever the request asks (rebuild to use it).
"""

from __future__ import annotations

import weakref

from tandem.pipeline.request_checks import RequestError
from tandem.pipeline.sampling_params import RelaxedAcceptance, SamplingParams

THINK_BEGIN, THINK_END = "<think>", "</think>"


def think_markers(tokenizer) -> tuple[int, int] | None:
    """(<think>, </think>) token ids from a tokenizers.Tokenizer, or None unless it has both."""
    begin, end = tokenizer.token_to_id(THINK_BEGIN), tokenizer.token_to_id(THINK_END)
    return None if begin is None or end is None else (begin, end)


class RelaxedRows:
    def __init__(self, default: RelaxedAcceptance | None = None, markers: tuple[int, int] | None = None,
                 source: str = "the tokenizer"):
        if default is not None and not isinstance(default, RelaxedAcceptance):
            raise ValueError(f"RuntimeConfig.relaxed_acceptance must be a RelaxedAcceptance or None, got "
                             f"{type(default).__name__}")
        self.default, self.markers, self.source = default, markers, source
        if default is not None and default.on and default.thinking_only and markers is None:
            raise ValueError(f"RuntimeConfig.relaxed_acceptance is thinking_only, but {source} has no "
                             f"{THINK_BEGIN} / {THINK_END} tokens; set thinking_only=False or serve a model "
                             "whose tokenizer has them")
        self._scanned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # seq -> (tokens read, inside)

    def setting(self, params: SamplingParams) -> RelaxedAcceptance | None:
        """The request's own setting, else the engine's default; None when off or not greedy."""
        r = params.relaxed if params.relaxed is not None else self.default
        return r if r is not None and r.on and params.greedy else None

    def check(self, params: SamplingParams) -> None:
        """RequestError when the request asks for thinking-only relaxing and there is no span to find."""
        r = params.relaxed
        if r is not None and r.on and r.thinking_only and self.markers is None:
            raise RequestError("relaxed_acceptance", f"relaxed_acceptance.thinking_only needs {THINK_BEGIN} and "
                               f"{THINK_END} tokens, but {self.source} has none; send thinking_only: false")

    def inside(self, seq) -> bool:
        """Whether seq.tokens (pending token included) end inside a thinking span."""
        read, inside = self._scanned.get(seq, (0, False))
        if read > len(seq.tokens):   # tokens were cut back: read them again
            read, inside = 0, False
        for t in seq.tokens[read:]:
            inside = self._step(inside, t)
        self._scanned[seq] = (len(seq.tokens), inside)
        return inside

    def _step(self, inside: bool, token: int) -> bool:
        begin, end = self.markers
        return True if token == begin else False if token == end else inside

    def fill(self, seqs, drafts: dict[str, list[int]], rows) -> None:
        """Set each verify Rows' relaxed inputs (rows[i] belongs to seqs[i]). Rows past a sequence's
        drafts that judge a filler (contract.FILLER_DRAFT: the call is wider than its drafts) never relax."""
        for seq, r in zip(seqs, rows):
            setting = self.setting(seq.params)
            if setting is None:
                continue
            r.relaxed_topk, r.relaxed_delta = setting.top_k, setting.delta
            n = len(drafts[seq.request_id])
            fillers = [0] * (len(r.ids) - n) if len(r.ids) > n + 1 else []
            if not setting.thinking_only:
                r.relaxed_rows = [1] * len(r.ids) if not fillers else [1] * n + fillers
                continue
            inside, mask = self.inside(seq), []
            for d in drafts[seq.request_id]:   # row i sees tokens + d_1..d_i
                mask.append(int(inside))
                inside = self._step(inside, d)
            r.relaxed_rows = [*mask, *(fillers or [int(inside)])]

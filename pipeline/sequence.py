"""One request's state through the pipeline. Plain data; the engine and scheduler mutate it.

Invariants while decoding (positions are 0-based):
    tokens[-1] is the pending token: not yet run through the target
    committed == len(tokens) - 1                      target K/V and states cover tokens[:-1]
    head_committed == committed (speculative): head row i pairs tokens[i+1] with the target hidden
        h_i, so the last committed head row pairs the pending token with h_{committed-1}, the
        pending hidden (it lives in the heads' KV; no copy is kept on the host)
    draft, chain_hidden: head 0's draft d_1 and hidden g_0 at that last row
    Heads anchored on the previous head (MTPSpec.anchor) lag: head j has committed head_committed - j
        rows (row q pairs tokens[q+1+j] with head j-1's hidden at row q); carries[j] is its hidden
        at its last committed row, which head j+1's next row pairs with
Randomness: the token at index x of tokens is decided by U(seed, x) (pipeline/sampler.py), so a
request's samples depend on its seed and positions only.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from tandem.pipeline.allocator import PageTables
from tandem.pipeline.detokenizer import IncrementalDetokenizer
from tandem.pipeline.sampling_params import SamplingParams


class Status(str, Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    finished: float | None = None
    rounds: int = 0                      # verify steps
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    preemptions: int = 0

    def record_round(self, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        for lst, n in ((self.drafted_per_position, drafted), (self.accepted_per_position, accepted)):
            lst.extend([0] * (drafted - len(lst)))  # both as long as the drafts: positions line up
            for i in range(n):
                lst[i] += 1

    @property
    def accept_length(self) -> float:
        """Tokens committed per verify step (accepted drafts + the target's own token)."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0


@dataclass(eq=False)  # identity: a sequence is one request
class Sequence:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    page_size: int
    speculative: bool
    k: int                      # most drafts per round for this sequence (pages are reserved for k+1 rows)
    k_fixed: bool = False       # set by the request or globally; otherwise the round's batch size decides
    tokens: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    slot: int | None = None
    prefilled: int = 0
    committed: int = 0
    head_committed: int = 0
    draft: int | None = None
    draft_prob: float = 1.0
    chain_hidden: np.ndarray | None = None
    ahead: list = field(default_factory=list)  # unified round: (d_s, p_s, g_{s-1}) for s = 2..k, after draft
    carries: dict[int, np.ndarray] = field(default_factory=dict)  # previous-head anchoring: head j's hidden
                                                                   # at its last committed row
    emitted: int = -1           # tokens[:emitted] were handed out as outputs (-1: none yet, set to len(prompt))
    finish_reason: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    seed: int | None = None     # the request's, else drawn from OS entropy at creation
    table: PageTables = field(default=None)   # one block table per page group (the scheduler's groups on admission)
    rules: object | None = None     # its grammar and logits processors (pipeline/logits_processors.TokenRules),
                                    # which follow output_ids(); None: the logits as the target gives them
    stop_ids: frozenset[int] | None = None   # the ids that end it (ending_ids, on its first output)
    logprobs: list | None = None    # params.logprobs: a pipeline.logprobs.TokenLogprob per generated token
    prompt_logprobs: list | None = None   # params.prompt_logprobs: one per prompt token after the first
    cached_tokens: int = 0      # positions its last admission resumed from the prefix cache

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt)
        if self.emitted < 0:
            self.emitted = len(self.prompt)
        self.table = self.table or PageTables(self.page_size)
        if self.seed is None:
            self.seed = self.params.seed if self.params.seed is not None else secrets.randbits(64)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = []

    @property
    def shaped(self) -> bool:
        """Whether the host needs each row it decides (rules shape its logits, or it reports logprobs):
        such a sequence takes one token a step when plain, and the multi-call round."""
        return self.rules is not None or self.logprobs is not None

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def prefill_target(self) -> int:
        """Tokens the target must process before decoding: all of a fresh prompt, or all but the
        pending token when resuming after preemption."""
        return len(self.tokens) - (1 if self.num_generated else 0)

    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt) :]

    def ending_ids(self, eos_ids) -> frozenset[int]:
        """The token ids that end it (`eos_ids` unless ignore_eos, and its stop ids), made on the
        first ask and kept: the engine asks for every sequence every step."""
        if self.stop_ids is None:
            self.stop_ids = self.params.ending_ids(eos_ids)
        return self.stop_ids

    def decode_rows(self, steps: int, samples: bool) -> int:
        """Rows one plain decode step may write for this sequence, up to `steps` (a decode burst,
        pipeline/decode_burst.py, or a multi-step decode graph's call, which takes exactly its n):
        where the decode path decides tokens on the host between its calls (`samples`: a burst) any
        request, and where it does not (a multi-step graph takes its argmax in the graph) a greedy one
        without rules or logprobs, as many as its token budget holds, so no position past the
        request's admitted length is written (pages, max_seq_len); else 1. Also 1 while its first
        token is not out yet: the time to first token does not wait for several steps."""
        if (steps > 1 and (samples or (self.params.greedy and not self.shaped))
                and self.emitted > len(self.prompt)):
            return max(1, min(steps, self.params.max_tokens - self.num_generated))
        return 1

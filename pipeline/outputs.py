"""What the engine hands out: each step's outputs per request, and its global counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.pipeline.sequence import Sequence


@dataclass
class StepOutput:
    request_id: str
    text: str                 # new text since the last output
    token_ids: list[int]      # new tokens since the last output
    finished: bool
    finish_reason: str | None
    sequence: Sequence
    logprobs: list | None = None      # a TokenLogprob per token in token_ids, where the request asked


@dataclass
class RoundStats:
    """Global counters (the server's /metrics and `tandem profile` read them)."""

    rounds: int = 0
    round_seconds: float = 0.0
    engine_seconds: float = 0.0
    finished: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    verify_rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    phase_seconds: dict[str, float] = field(default_factory=dict)  # prefill/draft/grammar/verify/commit/reanchor/decode

    @property
    def host_share(self) -> float:
        """Share of a decode step's wall time spent outside engine calls."""
        return 1.0 - self.engine_seconds / self.round_seconds if self.round_seconds else 0.0

    @property
    def accept_length(self) -> float:
        return (self.accepted + self.verify_rounds) / self.verify_rounds if self.verify_rounds else 0.0

    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def add_finished(self, seq: Sequence) -> None:
        m = seq.metrics
        self.finished += 1
        self.generated_tokens += seq.num_generated
        self.prompt_tokens += len(seq.prompt)
        self.verify_rounds += m.rounds
        self.drafted += m.drafted
        self.accepted += m.accepted
        for mine, theirs in ((self.drafted_per_position, m.drafted_per_position),
                             (self.accepted_per_position, m.accepted_per_position)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v


@dataclass(frozen=True)
class LLMStats:
    """What an LLM is doing now, read in one call (`LLM.stats()`): the server's gauges and a replica
    router's load. Counters only grow; the rest is the moment's."""

    running: int                      # sequences decoding or prefilling
    waiting: int                      # admitted requests not yet running
    kv_pages_free: int                # every page group's free pages
    kv_pages_total: int               # every page group's pages (scratch pages left out)
    pages_held: dict[str, int]        # pages in use per page group, by block-table name
    acceptance_per_position: list[float]   # draft i's acceptance given drafts 1..i-1 were, so far
    prefix_caching: bool = False
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_entries: int = 0

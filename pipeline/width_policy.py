"""The adaptive width's settings (WidthPolicy) and its figures for one width (WidthEstimate); the
controller that uses them is pipeline/width_control.py."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WidthPolicy:
    probe_every: int = 8        # decode steps between probes after the choice changed
    probe_max: int = 128        # the interval doubles after each probe that changed nothing, up to this
    decay: float = 0.9          # acceptance counts are multiplied by this each observed round
    samples: int = 8            # round times kept per width (their median is the cost)
    min_samples: int = 2        # a drafting width counts as measured with this many kept round times
    rejudge_rounds: int = 256   # engine rounds a probes' verdict of off holds for new requests (RoundLoop.step)
    stale_rows: float = 0.25    # a draft position whose aged count falls below this many rows is stale
    min_gain: float = 0.05      # drafting is chosen over plain steps only where its rate is this much higher
    confirm_probes: int = 3     # probes from off in a row that look unpromising (the widest among them): hopeless

    def __post_init__(self):
        if not 1 <= self.probe_every <= self.probe_max:
            raise ValueError(f"need 1 <= probe_every <= probe_max, got {self.probe_every}, {self.probe_max}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")
        if not 1 <= self.min_samples <= self.samples:
            raise ValueError(f"need 1 <= min_samples <= samples, got {self.min_samples}, {self.samples}")
        if self.rejudge_rounds < 1:
            raise ValueError(f"rejudge_rounds must be >= 1, got {self.rejudge_rounds}")
        if self.min_gain < 0:
            raise ValueError(f"min_gain must be >= 0, got {self.min_gain}")
        if self.stale_rows <= 0:
            raise ValueError(f"stale_rows must be > 0, got {self.stale_rows}")
        if self.confirm_probes < 1:
            raise ValueError(f"confirm_probes must be >= 1, got {self.confirm_probes}")


@dataclass(frozen=True)
class WidthEstimate:
    """One width's figures in a bucket: expected tokens per sequence, seconds per round (None:
    not measured), the seconds the rate counts (the cost, or where not measured the largest of a
    narrower width's: rounds only grow with width), and the rate used to choose."""

    width: int
    expected_tokens: float
    cost: float | None
    bound: float
    rate: float

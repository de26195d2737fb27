"""The kinds of graph tandem exports and runs, as a type: the target step, verify (greedy or
sampled), MTP head j, the unified round and the multi-step decode. Every stage names graphs
through it; nothing else parses the names.

    kind            name            engines                     rows
    target step     target_step     one per build               1 (decode) or a prefill chunk
    verify          verify_greedy   one per verify width W      W = k + 1: [pending, d_1..d_k]
                    verify_sample
    MTP head j      mtp_head_{j}    one per build               1 .. max(prefill chunk, max W)
    unified round   round_greedy_k{k}  one per k = W - 1        W: verify, re-anchor the heads,
                    round_sample_k{k}                           the next k drafts, in one call
                    (round_greedy_reused_k{k}: every draft step on head 0; else chained heads)
    multi-step      decode_greedy_n{n}  one per n            1 in, n tokens out: n greedy decode steps
    decode                                                   in one call (export/decode_graph.py)

`name` is the string in export file names, engine file names and manifests (unchanged, so
existing engine directories stay valid). A verify engine is lowered for one width (the lowering
unrolls its W rows), so its engine key carries the width: verify_greedy.w3.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from functools import cached_property


class Role(str, Enum):
    TARGET_STEP = "target_step"
    VERIFY = "verify"
    MTP_HEAD = "mtp_head"
    ROUND = "round"
    DECODE = "decode"


MAX_DECODE_STEPS = 16   # multi-step decode: tokens per call (its graph unrolls them); decode bursts too

_HEAD = re.compile(r"mtp_head_(0|[1-9][0-9]*)")
_ROUND = re.compile(r"round_(greedy|sample)(_reused)?_k([1-9][0-9]*)")
_DECODE = re.compile(r"decode_greedy_n([2-9]|[1-9][0-9]+)")


@dataclass(frozen=True)
class GraphKind:
    role: Role
    sampling: bool = False      # verify / round: sample-then-compare acceptance (else greedy)
    head: int | None = None     # MTP head: which head layer
    reused: bool = False        # round: every draft step on head 0 (else chained: head s % n)
    drafts: int | None = None   # round: k, the drafts it verifies and the drafts it makes (its graph unrolls k)
    steps: int | None = None    # multi-step decode: n, the greedy tokens one call makes (its graph unrolls n)

    def __post_init__(self):
        if (self.head is not None) != (self.role == Role.MTP_HEAD):
            raise ValueError(f"an MTP head graph needs a head index and no other graph has one "
                             f"(role {self.role.value}, head {self.head})")
        if self.head is not None and self.head < 0:
            raise ValueError(f"MTP head index must be >= 0, got {self.head}")
        if self.sampling and self.role not in (Role.VERIFY, Role.ROUND):
            raise ValueError(f"only a verify or round graph samples, not {self.role.value}")
        if (self.reused or self.drafts is not None) and self.role != Role.ROUND:
            raise ValueError(f"only a round graph has a head mode and a draft count, not {self.role.value}")
        if self.role == Role.ROUND and not (isinstance(self.drafts, int) and self.drafts >= 1):
            raise ValueError(f"a round graph needs a draft count k >= 1, got {self.drafts}")
        if (self.steps is not None) != (self.role == Role.DECODE):
            raise ValueError(f"a multi-step decode graph needs a step count and no other graph has one "
                             f"(role {self.role.value}, steps {self.steps})")
        if self.steps is not None and not (isinstance(self.steps, int) and self.steps >= 2):
            raise ValueError(f"a multi-step decode graph makes n >= 2 tokens a call, got {self.steps}")

    def __hash__(self) -> int:   # kept: the runner's per-call lookups key by kind (the dataclass one rehashes)
        return self._hash

    @cached_property
    def _hash(self) -> int:
        return hash((self.role, self.sampling, self.head, self.reused, self.drafts, self.steps))

    @classmethod
    def verify(cls, sampling: bool) -> GraphKind:
        return cls(Role.VERIFY, sampling=sampling)

    @classmethod
    def mtp_head(cls, j: int) -> GraphKind:
        return cls(Role.MTP_HEAD, head=j)

    @classmethod
    def round(cls, sampling: bool, reused: bool, drafts: int) -> GraphKind:
        return cls(Role.ROUND, sampling=sampling, reused=reused, drafts=drafts)

    @classmethod
    def decode(cls, steps: int) -> GraphKind:
        return cls(Role.DECODE, steps=steps)

    @classmethod
    def parse(cls, name: str) -> GraphKind:
        """The kind a graph name (as `name` writes it) stands for; ValueError for any other string."""
        if name == "target_step":
            return TARGET_STEP
        if name in ("verify_greedy", "verify_sample"):
            return cls.verify(sampling=name == "verify_sample")
        if isinstance(name, str) and _HEAD.fullmatch(name):
            return cls.mtp_head(int(name[len("mtp_head_"):]))
        match = _ROUND.fullmatch(name) if isinstance(name, str) else None
        if match:
            return cls.round(sampling=match.group(1) == "sample", reused=bool(match.group(2)),
                             drafts=int(match.group(3)))
        match = _DECODE.fullmatch(name) if isinstance(name, str) else None
        if match:
            return cls.decode(int(match.group(1)))
        raise ValueError(f"{name!r} is not a graph kind: expected target_step, verify_greedy, verify_sample, "
                         "mtp_head_<j>, round_{greedy,sample}[_reused]_k<k> or decode_greedy_n<n>")

    @cached_property
    def name(self) -> str:       # cached: the runner keys its per-call counters by it
        if self.role == Role.VERIFY:
            return "verify_sample" if self.sampling else "verify_greedy"
        if self.role == Role.MTP_HEAD:
            return f"mtp_head_{self.head}"
        if self.role == Role.ROUND:
            mode = ("sample" if self.sampling else "greedy") + ("_reused" if self.reused else "")
            return f"round_{mode}_k{self.drafts}"
        if self.role == Role.DECODE:
            return f"decode_greedy_n{self.steps}"
        return self.role.value

    @property
    def is_target_step(self) -> bool:
        return self.role == Role.TARGET_STEP

    @property
    def is_verify(self) -> bool:
        return self.role == Role.VERIFY

    @property
    def is_head(self) -> bool:
        return self.role == Role.MTP_HEAD

    @property
    def is_round(self) -> bool:
        return self.role == Role.ROUND

    @property
    def is_decode(self) -> bool:
        return self.role == Role.DECODE

    @property
    def per_width(self) -> bool:
        """Whether engines of this kind are lowered for one rows count each (verify, round: W)."""
        return self.is_verify or self.is_round

    def engine_key(self, rows: int) -> str:
        """The engine of this kind serving `rows` rows: its file stem and the runtime's lookup key."""
        return f"{self.name}.w{rows}" if self.per_width else self.name

    def __str__(self) -> str:
        return self.name


TARGET_STEP = GraphKind(Role.TARGET_STEP)
VERIFY_GREEDY = GraphKind.verify(sampling=False)
VERIFY_SAMPLE = GraphKind.verify(sampling=True)


def round_kinds(reused: bool, widths) -> list[GraphKind]:
    """The unified round graphs of one head mode for verify widths W (k = W - 1): greedy and sampled."""
    return [GraphKind.round(sampling, reused, w - 1) for w in widths for sampling in (False, True)]


def exported_kinds(num_heads: int, extra: tuple[GraphKind, ...] = ()) -> list[GraphKind]:
    """Every graph an export writes, in file order: target step, both verify graphs, the heads,
    then the graphs asked for (unified rounds, multi-step decode)."""
    return [TARGET_STEP, VERIFY_GREEDY, VERIFY_SAMPLE, *(GraphKind.mtp_head(j) for j in range(num_heads)), *extra]

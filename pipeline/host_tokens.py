"""The tokens the host decides from a target step's logits: a prompt's first token, plain decode
steps, a decode burst's steps and width-1 rounds. Greedy rows take the argmax, sampled rows the draw
of the uniform at the position they fill (pipeline/sampler.py), and a row with rules (grammar, logits
processors: pipeline/logits_processors.py) decides from its processed logits; a request that asks
for logprobs gets the raw row's (pipeline/logprobs.py).

Shared by the engine (pipeline/engine.py) and the decode burst (pipeline/decode_burst.py), so that
a token is decided the same way whichever of them runs the step.
"""

from __future__ import annotations

import numpy as np

from tandem.pipeline import logprobs
from tandem.pipeline.sampler import HostSampler, uniforms
from tandem.pipeline.sequence import Sequence


def next_token(sampler: HostSampler, seq: Sequence, logits: np.ndarray) -> int:
    """The token appended next, from one row of logits (masked by the request's grammar, if any); a
    sampled one takes the uniform of the position it fills (greedy rows skip computing it: it is on
    every plain decode step)."""
    if seq.rules is not None:
        logits = seq.rules.process(logits, seq.output_ids())
    if seq.params.greedy:
        return int(np.argmax(logits))
    return sampler.one(logits, seq.params, float(uniforms([seq.seed], np.array([len(seq.tokens)]))[0]))


def append_token(sampler: HostSampler, seq: Sequence, logits: np.ndarray) -> int:
    """Append the token one row of logits decides (with its logprobs, where the request asks)."""
    token = next_token(sampler, seq, logits)
    seq.tokens.append(token)
    if seq.logprobs is not None:
        seq.logprobs.append(logprobs.from_logits(logits, token, seq.params.logprobs))
    return token


def next_tokens(sampler: HostSampler, seqs: list[Sequence], logits: np.ndarray) -> list[int]:
    """next_token for each sequence's row of logits [n, V]: greedy rows by one argmax over the batch,
    sampled rows without rules drawn together (sampler.rows), rows with rules one at a time."""
    free = [b for b, s in enumerate(seqs) if s.rules is None and not s.params.greedy]
    tokens = np.argmax(logits, axis=-1)
    if free:
        u = uniforms([seqs[b].seed for b in free], np.array([len(seqs[b].tokens) for b in free]))
        tokens[free] = sampler.rows(logits[free], [seqs[b].params for b in free], u)
    return [t if s.rules is None else next_token(sampler, s, row)
            for s, t, row in zip(seqs, tokens.tolist(), logits)]


def append_tokens(sampler: HostSampler, seqs: list[Sequence], logits: np.ndarray) -> list[int]:
    """next_tokens, appended to each sequence (with their logprobs, where asked)."""
    out = next_tokens(sampler, seqs, logits)
    for seq, token, row in zip(seqs, out, logits):
        seq.tokens.append(token)
        if seq.logprobs is not None:
            seq.logprobs.append(logprobs.from_logits(row, token, seq.params.logprobs))
    return out

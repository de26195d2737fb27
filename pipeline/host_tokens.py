"""The tokens the host decides from a target step's logits: a prompt's first token, plain decode
steps, a decode burst's steps and width-1 rounds. Greedy rows take the argmax, sampled rows the draw
of the uniform at the position they fill (pipeline/sampler.py), and a row with rules (grammar, logits
processors: pipeline/logits_processors.py) decides from its processed logits; a request that asks
for logprobs gets the raw row's (pipeline/logprobs.py).

Shared by the engine (pipeline/round_loop.py) and the decode burst (pipeline/decode_burst.py), so that
a token is decided the same way whichever of them runs the step.
"""

from __future__ import annotations

import numpy as np

from tandem.pipeline import logprobs
from tandem.pipeline.logits_processors import process_rows
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
    """next_token for each sequence's row of logits [n, V]: the rows with rules processed together
    (process_rows), then greedy rows by one argmax over the batch and sampled rows drawn together
    (sampler.rows): the same tokens as one row at a time."""
    ruled = [b for b, s in enumerate(seqs) if s.rules is not None]
    if ruled:
        logits = logits.astype(np.float32, copy=True)
        logits[ruled] = process_rows([seqs[b].rules for b in ruled], [seqs[b].output_ids() for b in ruled],
                                     logits[ruled])
    sampled = [b for b, s in enumerate(seqs) if not s.params.greedy]
    tokens = np.argmax(logits, axis=-1)
    if sampled:
        u = uniforms([seqs[b].seed for b in sampled], np.array([len(seqs[b].tokens) for b in sampled]))
        tokens[sampled] = sampler.rows(logits[sampled], [seqs[b].params for b in sampled], u)
    return tokens.tolist()


def append_tokens(sampler: HostSampler, seqs: list[Sequence], logits: np.ndarray) -> list[int]:
    """next_tokens, appended to each sequence (with their logprobs, where asked: all in one pass)."""
    out = next_tokens(sampler, seqs, logits)
    asked = [b for b, s in enumerate(seqs) if s.logprobs is not None]
    if asked:
        scored = sampler.logprobs(logits[asked], [out[b] for b in asked], [seqs[b].params.logprobs for b in asked])
        for b, entry in zip(asked, scored):
            seqs[b].logprobs.append(entry)
    for seq, token in zip(seqs, out):
        seq.tokens.append(token)
    return out

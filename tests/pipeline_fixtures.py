"""Engine directories for pipeline tests and test-double drafters.

The doubles replace RoundLoop._draft (tests only): each returns the drafts a real drafter would,
so the verify / commit / re-anchor path runs unchanged."""

from __future__ import annotations

import numpy as np

from tandem.engines.builder import build_engines
from tandem.engines.options import BuildOptions
from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.round_loop import RoundLoop
from tandem.pipeline.sampling_params import SamplingParams
from tandem.testing.tiny_checkpoints import write_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
OPTIONS = BuildOptions(batch_sizes=(1, 2, 4, 8), spec_k=3, prefill_chunk=8, max_seq_len=512, page_size=4)


def build_test_engines(tiny_root, tmp_path_factory) -> dict:
    out = {}
    for kind in ("qwen3_5_mtp3", "qwen3_next"):
        path = tmp_path_factory.mktemp("engines") / kind
        build_engines(tiny_root / kind, path, OPTIONS, show_progress=False)
        out[kind] = path
    return out


def tiny_engines(root, kinds, options: BuildOptions) -> dict:
    """kind -> (tiny checkpoint folder, engine dir built with `options`), written under `root`."""
    out = {}
    for kind in kinds:
        write_tiny_checkpoint(root / kind, kind)
        build_engines(root / kind, root / f"{kind}.engines", options, show_progress=False)
        out[kind] = (root / kind, root / f"{kind}.engines")
    return out


def install_drafter(monkeypatch, kind: str, reference: dict[str, list[int]] | None = None, vocab: int = 384,
                    seed: int = 0):
    """kind: 'wrong' (never the greedy token), 'oracle' (always it; needs reference outputs by
    request id), 'random', 'prefix:N' (right for N drafts, then wrong)."""
    rng = np.random.default_rng(seed)

    def draft(self: RoundLoop, seqs):
        out = {}
        for s in seqs:
            k = self.round_k(s, len(seqs))      # as many as the engine's drafter would take
            ref = (reference or {}).get(s.request_id, [])
            start = s.num_generated          # drafts predict tokens after the pending one
            truth = ref[start : start + k] + [0] * k
            if kind == "wrong":
                d = [(t + 1) % vocab for t in truth[:k]]
            elif kind == "oracle":
                d = ref[start : start + k]   # right as far as the reference goes (no guesses past its end)
            elif kind == "random":
                d = [int(x) for x in rng.integers(0, vocab, k)]
            else:
                n = int(kind.split(":")[1])
                d = truth[:n] + [(t + 1) % vocab for t in truth[n:k]]
            out[s.request_id] = d
        return out

    monkeypatch.setattr(RoundLoop, "_draft", draft)


def run(engine_dir, prompts, params=GREEDY, config=None, stagger: int = 0):
    """Submit prompts (one more every `stagger` steps when > 0) and collect outputs by id."""
    llm = LLM(engine_dir, config or RuntimeConfig())
    pending = list(enumerate(prompts))
    seqs = {}
    steps = 0
    while pending or any(s.finish_reason is None for s in seqs.values()):
        while pending and (stagger == 0 or steps % stagger == 0 or not seqs):
            i, p = pending.pop(0)
            seqs[i] = llm.add_request(p, params, request_id=f"r{i}")
            if stagger:
                break
        llm.step()
        steps += 1
    llm.test_sequences = list(seqs.values())
    return {i: s.output_ids() for i, s in seqs.items()}, llm


def after_one_round(monkeypatch, engine_dir, prompt, plain_tokens, n_right: int, max_tokens: int = 12):
    """A speculative LLM after its first verify round, whose test-double drafter had the first
    `n_right` drafts right (of `plain_tokens`, the plain greedy output), and a plain LLM decoded to
    the same committed length: (spec LLM, its sequence, plain LLM, its sequence)."""
    install_drafter(monkeypatch, f"prefix:{n_right}", {"x": plain_tokens})
    spec = LLM(engine_dir)
    seq = spec.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id="x")
    while seq.metrics.rounds == 0:
        spec.step()
    assert seq.metrics.accepted == n_right and seq.committed == len(prompt) + n_right + 1
    base = LLM(engine_dir, RuntimeConfig(decode_burst=1))      # one token a step: it stops at that length
    other = base.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, speculative=False))
    while other.committed < seq.committed:
        base.step()
    return spec, seq, base, other


def round_drafts(tokens: list[int], prompts, max_tokens: int, k: int) -> int:
    """Drafts a round takes at this point of a request (`tokens`: its tokens, the pending one last):
    k, but no more than its token budget leaves after the round's own token (RoundLoop.round_k)."""
    prompt = max((p for p in prompts if list(tokens[: len(p)]) == list(p)), key=len)
    return min(k, max(0, max_tokens - (len(tokens) - len(prompt)) - 1))


def record_drafts(monkeypatch) -> list[tuple[list[int], list[int]]]:
    """Wrap RoundLoop._draft (the real drafter still runs): every round's (tokens when it drafted,
    ending with the pending token; its drafts), per sequence that drafted (a sequence whose budget
    leaves it no draft takes a plain step)."""
    rounds = []
    real = RoundLoop._draft

    def draft(self, seqs):
        out = real(self, seqs)
        rounds.extend((list(s.tokens), out[s.request_id]) for s in seqs if out[s.request_id])
        return out

    monkeypatch.setattr(RoundLoop, "_draft", draft)
    return rounds


def record_logits(monkeypatch) -> list[np.ndarray]:
    """Wrap the engine's token choice (the real one still runs): the logits row behind every token
    a sequence appends outside verify rounds (a prompt's first token, plain decode steps, bursts) of
    the LLMs opened after this call."""
    from tandem.pipeline import decode_burst, host_tokens, native_burst

    rows = []
    one, batch, burst = host_tokens.next_token, host_tokens.next_tokens, decode_burst._greedy
    monkeypatch.setattr(host_tokens, "next_token",
                        lambda sampler, seq, row: rows.append(row.copy()) or one(sampler, seq, row))
    monkeypatch.setattr(host_tokens, "next_tokens",
                        lambda sampler, seqs, logits: rows.extend(logits.copy()) or batch(sampler, seqs, logits))
    monkeypatch.setattr(decode_burst, "_greedy", lambda logits: rows.extend(logits.copy()) or burst(logits))
    # bursts take their tokens with numpy's argmax, not in the native step (LLMs opened from here on)
    monkeypatch.setattr(native_burst, "load", lambda library: None)
    return rows

"""Pipeline behaviour beyond the greedy contract: transformers parity, state commit, no leaks,
sampling distribution, stops, detokenization, CLI."""

from __future__ import annotations

import numpy as np
import pytest

from tandem import contract as c
from tandem.cli import main
from tandem.engines.manifest import signed
from tandem.pipeline.detokenizer import IncrementalDetokenizer
from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.sampling_params import SamplingParams
from tandem.pipeline.width_control import WidthController

from ..pipeline_fixtures import after_one_round, record_drafts, round_drafts

PROMPTS = [[5, 17, 33, 200, 7], [9, 120, 77, 301, 15, 2, 88, 91, 14, 250, 3], [44, 3]]


def test_plain_greedy_equals_transformers_generate(engine_dirs, tiny_root):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    for kind in engine_dirs:
        model = transformers.AutoModelForCausalLM.from_pretrained(tiny_root / kind, dtype=torch.float32)
        llm = LLM(engine_dirs[kind])
        ours = llm.generate(PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True, speculative=False))
        spec = llm.generate(PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True))
        for prompt, mine, mine_spec in zip(PROMPTS, ours, spec):
            with torch.no_grad():
                ref = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
            assert mine.token_ids == ref, kind
            assert mine_spec.token_ids == ref, kind


@pytest.mark.parametrize("n_right", [0, 1, 2, 3])
def test_commit_of_n_accepted_rows_equals_n_decode_steps(engine_dirs, monkeypatch, n_right):
    """After one verify round that accepts n drafts, the pools hold exactly what n+1 plain decode
    steps leave: the GDN states of the slot, and the K/V rows of the committed positions."""
    path = engine_dirs["qwen3_5_mtp3"]
    plain = LLM(path)
    ref = plain.generate([PROMPTS[1]], SamplingParams(max_tokens=8, ignore_eos=True, speculative=False))[0].token_ids
    spec, seq, base, other = after_one_round(monkeypatch, path, PROMPTS[1], ref, n_right, max_tokens=8)
    for i, states in spec.pools.states.items():
        np.testing.assert_allclose(states["recurrent"][seq.slot], base.pools.states[i]["recurrent"][other.slot],
                                   atol=1e-5)
        np.testing.assert_allclose(states["conv"][seq.slot], base.pools.states[i]["conv"][other.slot], atol=1e-6)
    page = spec.page_size
    for layer in base.runner.trunk_kv:
        for pos in range(seq.committed):
            a = spec.pools.paged[layer]["key"][seq.table.pages[pos // page], pos % page]
            b = base.pools.paged[layer]["key"][other.table.pages[pos // page], pos % page]
            np.testing.assert_allclose(a, b, atol=1e-5)


def test_no_page_or_slot_leaks_after_many_requests_and_aborts(engine_dirs):
    llm = LLM(engine_dirs["qwen3_next"], RuntimeConfig(memory_budget_bytes=2 << 20))
    pages0, slots0 = llm.pages.num_free, llm.slots.num_free
    rng = np.random.default_rng(0)
    live = []
    for i in range(40):
        prompt = [int(x) for x in rng.integers(0, 300, rng.integers(1, 20))]
        live.append(llm.add_request(prompt, SamplingParams(max_tokens=int(rng.integers(1, 12)),
                                                           speculative=bool(i % 3))))
        llm.step()
        if i % 5 == 0:
            llm.abort(live[int(rng.integers(0, len(live)))].request_id)
    llm.abort("no-such-request")
    for _ in range(2000):  # bounded: a leak that starves admission fails instead of hanging
        if not llm.scheduler.has_work():
            break
        llm.step()
    assert llm.pages.available == pages0 and llm.slots.num_free == slots0   # (free, or held by the prefix cache)
    assert all(s.finish_reason is not None for s in live)
    llm.reset_prefix_cache()
    assert llm.pages.num_free == pages0 and llm.prefix_cache.rows.num_free == llm.prefix_cache.rows.size - 1


def test_rejection_sampling_preserves_the_target_distribution(engine_dirs):
    """First token after one verify (draft fixed) vs the target's own filtered distribution."""
    from tandem.pipeline.model_runner import Rows
    from tandem.pipeline.sampler import filtered_probs

    llm = LLM(engine_dirs["qwen3_5_mtp3"])
    seq = llm.add_request(PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True, speculative=False))
    while seq.committed < len(PROMPTS[0]):
        llm.step()
    pending = seq.tokens[-1]
    rows = Rows(ids=[pending], context=seq.committed, pages=seq.table.pages, slot=seq.slot)
    logits = llm.runner.target_step([rows]).row(0)[c.LOGITS][0].copy()
    p = filtered_probs(logits, 1.5, 6, 1.0)
    support = np.flatnonzero(p)
    draft = int(support[np.argsort(p[support])[-2]])  # plausible but not the top token
    rng = np.random.default_rng(0)
    counts = np.zeros(len(p))
    n = 0
    for _ in range(300):
        batch = [Rows(ids=[pending, draft], context=seq.committed, pages=seq.table.pages, slot=seq.slot,
                      temperature=1.5, top_k=6, top_p=1.0, uniforms=rng.random(2).astype(np.float32))
                 for _ in range(8)]
        for out in llm.runner.verify(batch, sampling=True).rows():
            counts[draft if out[c.ACCEPTED] == 1 else int(out[c.NEXT_TOKEN])] += 1
            n += 1
    expected = n * p[support]
    chi2 = (((counts[support] - expected) ** 2) / expected).sum()
    assert chi2 < 20.5 and counts.sum() == counts[support].sum()  # 99.9% quantile, 5 dof


def test_stops_eos_and_max_tokens(engine_dirs):
    llm = LLM(engine_dirs["qwen3_5_mtp3"])
    free = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    stop_at = free.token_ids[5]
    stopped = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=12, stop_token_ids=(stop_at,)))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[: free.token_ids.index(stop_at)]
    assert llm.generate([PROMPTS[1]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids == free.token_ids[:3]
    text = free.text
    needle = text[len(text) // 2 : len(text) // 2 + 2]
    if needle and "\ufffd" not in needle:
        cut = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=12, stop=(needle,), ignore_eos=True))[0]
        assert cut.finish_reason == "stop" and cut.text == text[: text.index(needle)]
        one = LLM(engine_dirs["qwen3_5_mtp3"], RuntimeConfig(speculative=False, decode_burst=1)).generate(
            [PROMPTS[1]], SamplingParams(max_tokens=12, stop=(needle,), ignore_eos=True))[0]
        assert cut.token_ids == one.token_ids      # a round of several tokens ends where one a step ends


def test_a_round_ends_at_its_first_stop_id_or_at_max_tokens(engine_dirs):
    """A round commits several tokens at once: the output ends at the first stop id or at
    max_tokens, whichever comes first; a stop id right past the budget is never reached."""
    llm = LLM(engine_dirs["qwen3_5_mtp3"])

    def output(new: list[int], max_tokens: int) -> tuple:
        seq = llm.add_request([5, 17, 33], SamplingParams(max_tokens=max_tokens, stop_token_ids=(7,), ignore_eos=True))
        llm.scheduler.waiting.remove(seq)       # not run: its round's tokens are set here
        seq.tokens += new
        out = llm.round_loop._postprocess(seq)
        return out.finish_reason, out.token_ids

    assert output([1, 2, 3], 8) == (None, [1, 2, 3])
    assert output([1, 7, 3], 8) == ("stop", [1])
    assert output([7, 2], 8) == ("stop", [])
    assert output([1, 2, 3], 2) == ("length", [1, 2])
    assert output([1, 2, 7], 2) == ("length", [1, 2])
    assert output([1, 7, 3], 2) == ("stop", [1])


def test_incremental_detokenizer_never_splits_characters(tiny_root):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_root / "qwen3_5_mtp1" / "tokenizer.json"))
    text = "héllo wörld ∑ 🙂 naïve café 日本語"
    ids = tok.encode(text).ids
    detok = IncrementalDetokenizer(tok)
    pieces = []
    for t in ids:
        detok.add([t])
        pieces.append(detok.take(final=False))
    pieces.append(detok.take(final=True))
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_incremental_detokenizer_releases_invalid_bytes_and_keeps_its_window_small(tiny_root):
    """A byte that never completes a character (0xFF is never valid UTF-8) is released as U+FFFD
    once more tokens than a character can span follow; the decode window stays bounded, so a
    generation of such tokens costs O(1) per token, not O(length)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_root / "qwen3_5_mtp1" / "tokenizer.json"))
    invalid = tok.token_to_id("\u00ff")          # byte-level BPE's character for the byte 0xFF
    assert invalid is not None and tok.decode([invalid]) == "\ufffd"
    ids = [invalid] * 40 + tok.encode(" ok é").ids
    detok = IncrementalDetokenizer(tok)
    pieces = []
    for t in ids:
        detok.add([t])
        assert len(detok.pending) <= 4
        pieces.append(detok.take(final=False))
    pieces.append(detok.take(final=True))
    assert "".join(pieces) == tok.decode(ids)


def test_stop_strings_are_found_across_steps_and_only_in_new_text(tiny_root):
    """find_stop searches what each step added plus the tail a stop string may start in: a stop
    string split across steps is found where it starts, whichever step completes it, and the
    text searched per step does not grow with the generation."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_root / "qwen3_5_mtp1" / "tokenizer.json"))
    text = "aaaa b END; more text"
    for step in (1, 2, 3):
        detok = IncrementalDetokenizer(tok, stop=("END;", "zz"))
        ids, found = tok.encode(text).ids, -1
        for i in range(0, len(ids), step):
            detok.add(ids[i : i + step])
            found = detok.find_stop()
            if found >= 0:
                break
        assert found == text.index("END;") and detok.text.startswith(text[:found]), step
    detok = IncrementalDetokenizer(tok, stop=("END;",))
    for _ in range(50):
        detok.add(tok.encode(" abc").ids)
        assert detok.find_stop() == -1
    assert detok._searched == len(detok.text)
    detok.text += "xyz"     # what a step adds is searched from `_hold` chars before it, no further back
    calls = []
    real = detok.text

    class Spy(str):
        def find(self, sub, start=0, *rest):
            calls.append(start)
            return str.find(self, sub, start, *rest)
    detok.text = Spy(real)
    assert detok.find_stop() == -1 and calls == [len(real) - 3 - 3]


def test_tokens_added_several_at_a_time_end_at_the_one_that_completes_a_stop_string(tiny_root):
    """A speculative round or a decode burst hands the detokenizer several tokens: it takes them up
    to the one that completes a stop string, as one token a step would have ended there."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_root / "qwen3_5_mtp1" / "tokenizer.json"))
    text = "aaaa b END; more text"
    ids = tok.encode(text).ids
    one = IncrementalDetokenizer(tok, stop=("END;",))
    last = next(i for i, t in enumerate(ids) if one.add_until_stop([t])[1] >= 0)
    for step in (2, 3, len(ids)):
        detok, taken = IncrementalDetokenizer(tok, stop=("END;",)), 0
        for i in range(0, len(ids), step):
            added, at = detok.add_until_stop(ids[i : i + step])
            taken += added
            if at >= 0:
                break
        assert taken == last + 1 and at == text.index("END;"), step
    plain = IncrementalDetokenizer(tok)
    assert plain.add_until_stop(ids) == (len(ids), -1) and plain.text == text


def test_generate_cli(engine_dirs, capsys, monkeypatch):
    # drafting every round (random tiny weights: the adaptive width would stop it, plain bursts cost less)
    monkeypatch.setattr(WidthController, "hopeless", lambda self, batch, constrained=False: False)
    assert main(["generate", str(engine_dirs["qwen3_5_mtp3"]), "--prompt", "def add(a, b):", "--max-tokens", "8",
                 "--ignore-eos", "--spec-k", "3"]) == 0
    out = capsys.readouterr().out
    assert "accept length" in out and "tokens/s" in out


@pytest.mark.parametrize("mode", ["chained", "reused"])
def test_drafts_match_the_reference_drafter(engine_dirs, tiny_root, monkeypatch, mode):
    """The real heads inside the pipeline draft what the torch reference drafts from the same
    committed tokens: re-anchoring uses the target's hidden, chaining the heads' own."""
    pytest.importorskip("torch")
    from tandem.checkpoint.families.qwen_hybrid.reference import MTPReference, greedy_draft, load_target

    text_model, lm_head, cfg = load_target(tiny_root / "qwen3_5_mtp3")
    ref = MTPReference.from_checkpoint(tiny_root / "qwen3_5_mtp3", text_model, lm_head, cfg)
    seen = record_drafts(monkeypatch)
    llm = LLM(engine_dirs["qwen3_5_mtp3"], RuntimeConfig(mtp_mode=mode))
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=10, ignore_eos=True))
    assert len(seen) >= 6
    for tokens, drafts in seen:
        _, expected = greedy_draft(text_model, lm_head, ref, tokens[:-1], k=3, chained=mode == "chained")
        assert drafts == expected[: round_drafts(tokens, PROMPTS[:2], 10, 3)]


def test_host_sampler_follows_the_filtered_distribution():
    from tandem.pipeline.sampler import filtered_probs, sample

    rng = np.random.default_rng(0)
    logits = rng.standard_normal(12) * 2
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)
    p = filtered_probs(logits, 0.8, 6, 0.9)
    assert np.count_nonzero(p) <= 6 and abs(p.sum() - 1) < 1e-12
    counts = np.bincount([sample(logits, params, u) for u in rng.random(20000)], minlength=12)
    support = np.flatnonzero(p)
    assert counts[np.flatnonzero(p == 0)].sum() == 0
    chi2 = (((counts[support] - 20000 * p[support]) ** 2) / (20000 * p[support])).sum()
    assert chi2 < 3 * len(support) + 10
    assert sample(logits, SamplingParams(), 0.5) == int(np.argmax(logits))


def test_probability_floor_stops_drafting_early_and_keeps_the_output(engine_dirs):
    llm = LLM(engine_dirs["qwen3_5_mtp3"])
    free = llm.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
    floor = llm.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True, p_min=0.5))
    assert [r.token_ids for r in free] == [r.token_ids for r in floor]
    drafted = lambda rs: sum(r.metrics.drafted for r in rs)  # noqa: E731
    assert drafted(floor) < drafted(free)


def test_verify_width_per_batch_comes_from_runtime_settings(engine_dirs, tmp_path):
    import json
    import shutil

    path = tmp_path / "engines"
    shutil.copytree(engine_dirs["qwen3_5_mtp3"], path)
    (path / "runtime_settings.json").write_text(json.dumps({"verify_width_per_batch": {"1": 2, "8": 2}}))
    llm = LLM(path)
    assert llm.width_per_batch[1] == 2
    r = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert len(r.metrics.drafted_per_position) == 1  # one draft per round
    fixed = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=10, ignore_eos=True, k=3))[0]
    assert len(fixed.metrics.drafted_per_position) == 3  # a request's own k wins (but where its budget is short)
    assert r.token_ids == fixed.token_ids


def test_global_metrics(engine_dirs):
    llm = LLM(engine_dirs["qwen3_next"])
    llm.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True))
    st = llm.round_loop.stats
    assert st.finished == 3 and st.generated_tokens == 18 and st.prompt_tokens == sum(map(len, PROMPTS))
    assert st.verify_rounds > 0 and st.accept_length >= 1.0 and 0.0 <= st.host_share < 1.0
    assert len(st.acceptance_per_position()) >= 1 and set(llm.runner.seconds) >= {"target_step", "mtp_head_0"}


def test_engines_of_a_backend_that_cannot_run_here_are_refused_with_the_fix(engine_dirs, tmp_path):
    import json
    import shutil

    from tandem.engines.backends.common import BackendUnavailable

    path = tmp_path / "engines"
    shutil.copytree(engine_dirs["qwen3_5_mtp3"], path)
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps(signed({**manifest, "backend": "tensorrt"})))
    with pytest.raises(BackendUnavailable, match="holds TensorRT engines, which run only where.*--backend onnxruntime"):
        LLM(path)


@pytest.mark.parametrize("speculative", [False, True])
def test_more_sequences_than_the_largest_batch_equal_smaller_batches(engine_dirs, speculative):
    """16 sequences decode in two calls of the largest batch (8) on one binding: the first part's
    outputs must survive the second part's run (they are copied before it)."""
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(3, 300, 6)] for _ in range(16)]
    params = SamplingParams(max_tokens=8, ignore_eos=True, speculative=speculative)
    path = engine_dirs["qwen3_5_mtp3"]
    wide = LLM(path, RuntimeConfig(max_num_seqs=16)).generate(prompts, params)
    narrow = LLM(path, RuntimeConfig(max_num_seqs=8)).generate(prompts, params)
    assert [o.token_ids for o in wide] == [o.token_ids for o in narrow]

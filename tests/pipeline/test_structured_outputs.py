"""Structured outputs under speculative decoding: the grammar mask inside the verify graph's
acceptance (a draft the grammar forbids is rejected even where the target's argmax is that draft;
the correction comes from the masked distribution), the host matcher's draft masks, and the
shipped model's outputs under JSON schemas: every one parses and validates, speculation on or off,
greedy or sampled, unified or multi-call rounds, and greedy speculative == greedy plain token for token."""

from __future__ import annotations

import concurrent.futures
import json
from dataclasses import replace
from pathlib import Path

import jsonschema
import numpy as np
import onnx
import pytest

from tandem import contract as c
from tandem.checkpoint import open_checkpoint
from tandem.engines.builder import build_engines
from tandem.engines.options import BuildOptions
from tandem.pipeline.grammar import Grammars, GrammarSpec, allowed, allowed_tokens
from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.request_checks import RequestError
from tandem.pipeline.sampling_params import SamplingParams
from tandem.testing.acceptance_reference import accept

from ..paged_driver import PagedState, function_body_graphs, prefilled, session
from ..pipeline_fixtures import install_drafter

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "tandem-tiny-code"
K = 3
PROMPTS = [[5, 17, 33, 200, 7, 64, 91], [9, 120, 77, 301, 15]]

SCHEMAS = {
    "nested": {"type": "object", "additionalProperties": False, "required": ["user", "kind", "score"], "properties": {
        "user": {"type": "object", "additionalProperties": False, "required": ["id", "tags"], "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}}},
        "kind": {"enum": ["add", "remove", "list"]},
        "score": {"type": "integer", "minimum": -5, "maximum": 5}}},
    "array": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "additionalProperties": False, "required": ["name", "ok"],
        "properties": {"name": {"type": "string", "maxLength": 10}, "ok": {"type": "boolean"}}}},
    "bounded": {"type": "object", "additionalProperties": False, "required": ["x", "label"], "properties": {
        "x": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25},
        "label": {"type": "string", "pattern": "^[a-z]{1,6}$"}}},
}
CODE_PROMPTS = ["def fibonacci(n):\n    ", "import os\n\n\ndef list_files(root):\n    ", "class Stack:\n    def "]


def _bits(vocab: int, allowed_ids) -> np.ndarray:
    """A bitmask row [words] allowing exactly `allowed_ids`."""
    keep = np.zeros(c.mask_words(vocab) * 32, np.uint8)
    keep[list(allowed_ids)] = 1
    return np.packbits(keep, bitorder="little").view(np.int32)


# ---- the mask inside the verify graph ---------------------------------------------------------

@pytest.fixture(scope="module")
def graphs(tiny_root):
    return function_body_graphs(tiny_root / "qwen3_5_mtp1")


def _prefilled(desc, target):
    return prefilled(desc, target, PROMPTS)


def _greedy_chain(desc, target):
    """[pending, d_1..d_K] where every draft is the target's argmax (all accepted unmasked), and the
    target's logits over those rows."""
    _, pending = _prefilled(desc, target)
    ids = pending[:, None]
    for _ in range(K):
        state, _ = _prefilled(desc, target)
        logits = state.run(target, {c.INPUT_IDS: ids, c.STATE_ROWS: np.full(len(ids), ids.shape[1])})[c.LOGITS]
        ids = np.concatenate([ids, logits[:, -1].argmax(-1)[:, None]], 1)
    state, _ = _prefilled(desc, target)
    return ids, state.run(target, {c.INPUT_IDS: ids, c.STATE_ROWS: np.full(len(ids), K + 1)})[c.LOGITS]


def test_a_draft_the_grammar_forbids_is_rejected_where_the_target_would_accept_it(graphs):
    desc, target, verify, verify_sample = graphs
    ids, logits = _greedy_chain(desc, target)
    n, v = len(ids), desc.vocab_size
    all_ones = np.full((n, K + 1, c.mask_words(v)), -1, np.int32)
    sampling = {c.TEMPERATURE: np.zeros(n, np.float32), c.TOP_K: np.zeros(n, np.int64),
                c.TOP_P: np.ones(n, np.float32), c.UNIFORMS: np.full((n, K + 1), 0.5, np.float32)}
    for sess, extra in ((verify, {}), (verify_sample, sampling)):
        state, _ = _prefilled(desc, target)
        free = state.run(sess, {c.INPUT_IDS: ids, c.TOKEN_BITMASK: all_ones, **extra})
        assert (free[c.ACCEPTED] == K).all()                         # unmasked: every draft is the argmax
        masks = all_ones.copy()
        masks[:, 1] = [_bits(v, set(range(v)) - {int(ids[b, 2])}) for b in range(n)]   # row 1 forbids d_2
        state, _ = _prefilled(desc, target)
        out = state.run(sess, {c.INPUT_IDS: ids, c.TOKEN_BITMASK: masks, **extra})
        np.testing.assert_array_equal(out[c.ACCEPTED], 1)
        second = np.argsort(-logits[:, 1], axis=-1, kind="stable")[:, 1]   # the masked distribution's argmax
        np.testing.assert_array_equal(out[c.NEXT_TOKEN], second)


def test_masked_acceptance_matches_the_reference_on_masked_logits(graphs):
    """Random masks (each keeps a random half of the tokens plus the row's argmax or not), greedy and
    sampled rows: accepted / next token == the numpy reference run on logits with -inf where masked,
    and no accepted draft or next token is ever a forbidden one."""
    desc, target, _, verify_sample = graphs
    ids, logits = _greedy_chain(desc, target)
    n, v = len(ids), desc.vocab_size
    rng = np.random.default_rng(0)
    for trial in range(6):
        keep = rng.random((n, K + 1, v)) < 0.5
        masks = np.stack([np.stack([_bits(v, np.flatnonzero(keep[b, i])) for i in range(K + 1)]) for b in range(n)])
        temp = np.array([0.0, 0.9] if trial % 2 else [0.7, 0.0], np.float32)
        top_k, top_p = np.array([0, 20]), np.array([1.0, 0.9], np.float32)
        u = rng.random((n, K + 1)).astype(np.float32)
        state, _ = _prefilled(desc, target)
        out = state.run(verify_sample, {c.INPUT_IDS: ids, c.TOKEN_BITMASK: masks, c.TEMPERATURE: temp,
                                        c.TOP_K: top_k, c.TOP_P: top_p, c.UNIFORMS: u})
        ref_acc, ref_next = accept(np.where(keep, logits, -np.inf), ids, temp, top_k, top_p, u)
        np.testing.assert_array_equal(out[c.ACCEPTED], ref_acc)
        np.testing.assert_array_equal(out[c.NEXT_TOKEN], ref_next)
        for b in range(n):
            a = int(out[c.ACCEPTED][b])
            assert all(keep[b, i, ids[b, i + 1]] for i in range(a)) and keep[b, a, out[c.NEXT_TOKEN][b]]


# ---- the host matcher ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def grammars():
    desc = open_checkpoint(SHIPPED).description
    return Grammars(SHIPPED / "tokenizer.json", desc.vocab_size, desc.eos_token_ids)


def test_draft_masks_follow_the_drafts_and_roll_back(grammars):
    """Row i's mask is the state after d_1..d_i; after a forbidden draft the rows are all ones (the
    verify graph rejects it there, later rows decide nothing); the matcher is left where it was."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(SHIPPED / "tokenizer.json"))
    m = grammars.matcher(GrammarSpec("regex", "ab(c|d)ef"))
    ids = tok.encode("abcef", add_special_tokens=False).ids
    out = ids[:1]
    bad = tok.encode("x", add_special_tokens=False).ids[0]
    drafts, masks = m.draft_masks(out, [bad, ids[1]])                # after "ab": c or d, not x
    assert drafts == [bad, ids[1]] and masks.shape == (3, grammars.words)
    assert not allowed(masks[0], bad) and allowed(masks[0], ids[1]) and (masks[1:] == -1).all()
    drafts, masks = m.draft_masks(out, ids[1:])
    assert drafts == ids[1:] and allowed(masks[0], ids[1]) and allowed(masks[1], ids[2])
    eos = sorted(grammars.tokenizer.eos_tokens)
    assert np.flatnonzero(allowed_tokens(masks[2], grammars.vocab_size)).tolist() == eos   # "abcef" is complete
    again, masks_again = m.draft_masks(out, ids[1:])                  # rolled back: the same state as before
    assert again == drafts and (masks_again == masks).all()
    # where the grammar allows one token only, that token replaces a wrong draft; once it is complete
    # every row allows EOS only, and every draft becomes EOS (under ignore_eos the answer goes on)
    done = grammars.matcher(GrammarSpec("regex", "abc"))
    drafts, masks = done.draft_masks(tok.encode("abc", add_special_tokens=False).ids, [bad, bad])
    assert drafts == [eos[0], eos[0]]
    assert all(np.flatnonzero(allowed_tokens(row, grammars.vocab_size)).tolist() == eos for row in masks)
    assert done.draft_masks(tok.encode("abc", add_special_tokens=False).ids, [bad])[0] == eos[:1]   # rolled back
    drafts, masks = m.draft_masks(out, [*ids[1:], bad, bad])        # complete after the drafts of "abcef"
    assert drafts == [*ids[1:], eos[0], eos[0]]
    assert all(np.flatnonzero(allowed_tokens(row, grammars.vocab_size)).tolist() == eos
               for row in masks[len(ids) - 1 :])


def test_bad_grammars_are_refused_naming_the_field(grammars):
    with pytest.raises(RequestError, match="response_format.*does not compile"):
        grammars.compile(GrammarSpec.json_schema({"type": "objectx"}))
    with pytest.raises(RequestError, match="guided_regex.*does not compile"):
        grammars.compile(GrammarSpec("regex", "a(b", field="guided_regex"))
    with pytest.raises(RequestError, match="allows no output"):
        GrammarSpec.json_schema(False)
    assert grammars.compile(GrammarSpec.json_schema(True))        # any JSON value
    with pytest.raises(RequestError, match="grammar kind"):
        GrammarSpec("yaml", "x")
    with pytest.raises(RequestError, match="empty"):
        GrammarSpec("regex", " ")


# ---- the shipped model under JSON schemas -------------------------------------------------------

_BUILT: dict[str, Path] = {}   # tests/server/test_tool_calls.py imports the fixture: one build per session


@pytest.fixture(scope="session")
def shipped(tmp_path_factory):
    if "shipped" not in _BUILT:
        out = tmp_path_factory.mktemp("shipped_grammar") / "engines"
        build_engines(SHIPPED, out, BuildOptions(batch_sizes=(1, 4), spec_k=3, prefill_chunk=32, max_seq_len=256),
                      show_progress=False)
        _BUILT["shipped"] = out
    return _BUILT["shipped"]


@pytest.mark.parametrize("mode", ["unified", "multi"])
def test_every_output_validates_and_speculative_greedy_equals_plain(shipped, mode):
    """unified: every schema, greedy and sampled; multi-call rounds: greedy (the same masks, other callers)."""
    llm = LLM(shipped, RuntimeConfig(round=mode, adaptive_width=False))   # fixed k: rounds every step
    temps = (0.0, 0.9) if mode == "unified" else (0.0,)
    for name, schema in SCHEMAS.items():
        g = GrammarSpec.json_schema(schema)
        runs = {}
        for spec in (True, False):
            for temp in temps:
                params = SamplingParams(max_tokens=120, grammar=g, speculative=spec, temperature=temp, seed=7)
                runs[spec, temp] = llm.generate(CODE_PROMPTS, params)
                for r in runs[spec, temp]:
                    assert r.finish_reason == "stop", (name, spec, temp, r.text)
                    jsonschema.validate(json.loads(r.text), schema)
        for temp in temps:   # the seed's uniforms decide sampled tokens whatever the drafts
            assert [r.token_ids for r in runs[True, temp]] == [r.token_ids for r in runs[False, temp]], (name, temp)
        assert sum(r.metrics.accepted for r in runs[True, 0.0]) > 0


def test_past_its_grammar_s_end_an_ignore_eos_answer_is_eos_with_speculation_as_without(shipped):
    """ignore_eos goes on after the JSON is complete: every token after it is EOS, the only token
    the grammar then allows, and speculative greedy decoding gives plain greedy decoding's tokens
    (verify rows past the end once took any token: the answer went on as free text)."""
    llm = LLM(shipped, RuntimeConfig(adaptive_width=False))
    params = SamplingParams(max_tokens=60, ignore_eos=True, grammar=GrammarSpec.json_schema(SCHEMAS["nested"]))
    plain = llm.generate(CODE_PROMPTS, replace(params, speculative=False))
    spec = llm.generate(CODE_PROMPTS, params)
    eos = set(open_checkpoint(SHIPPED).description.eos_token_ids)
    for p, s in zip(plain, spec):
        assert s.token_ids == p.token_ids and len(p.token_ids) == 60
        end = next(i for i, t in enumerate(p.token_ids) if t in eos)
        jsonschema.validate(json.loads(p.text), SCHEMAS["nested"])
        assert end < 50 and set(p.token_ids[end:]) <= eos
    assert sum(s.metrics.accepted for s in spec) > 0


@pytest.mark.parametrize("speculative", [True, False])
def test_a_grammar_and_token_filters_that_leave_no_token_refuse_the_request(shipped, speculative):
    """Where the grammar and allowed_token_ids / min_tokens together allow no token, the engine can only
    take one they forbid: the request is refused naming both, at the position, with speculation as
    without (a forbidden EOS ended it quietly before min_tokens; another token broke the grammar as
    "a bug in masking upstream")."""
    llm = LLM(shipped, RuntimeConfig(adaptive_width=False))
    schema = GrammarSpec.json_schema(SCHEMAS["nested"])
    base = SamplingParams(max_tokens=60, grammar=schema, speculative=speculative)
    with pytest.raises(RequestError, match="position 0 no token is allowed by both the grammar and allowed_token_ids"):
        llm.generate([CODE_PROMPTS[0]], replace(base, allowed_token_ids=tuple(range(100, 200))))
    end = len(llm.generate([CODE_PROMPTS[0]], base)[0].token_ids)        # the JSON's length, then EOS
    with pytest.raises(RequestError, match=f"position {end} no token .* min_tokens \\(50\\)") as e:
        llm.generate([CODE_PROMPTS[0]], replace(base, min_tokens=50))
    assert e.value.param == "response_format"
    assert len(llm.generate([CODE_PROMPTS[0]], replace(base, min_tokens=end))[0].token_ids) == end
    assert len(llm.generate([CODE_PROMPTS[0]], replace(base, min_tokens=50, ignore_eos=True))[0].token_ids) == 60
    # a grammar request beside it in the batch is unaffected once the refused one is gone
    fine = llm.generate(CODE_PROMPTS[:2], base)
    assert all(r.finish_reason == "stop" for r in fine)


def test_a_stop_id_taken_in_a_dead_end_past_the_first_verify_row_is_refused(shipped, monkeypatch):
    """Drafts that are right up to the JSON's end and EOS after it: the verify rows past the end allow
    EOS only, which min_tokens bans, so they are empty and recorded; the target takes EOS there and the
    answer would end. The grammar's matcher refuses it as it follows the output (the heads' re-anchor),
    and the engine's output step would if nothing followed."""
    llm = LLM(shipped, RuntimeConfig(adaptive_width=False))
    base = SamplingParams(max_tokens=60, grammar=GrammarSpec.json_schema(SCHEMAS["nested"]))
    json_ids = llm.generate([CODE_PROMPTS[0]], replace(base, speculative=False))[0].token_ids
    eos = open_checkpoint(SHIPPED).description.eos_token_ids[-1]
    install_drafter(monkeypatch, "oracle", {"r": json_ids + [eos] * 8})
    k = next(k for k in (2, 3) if (len(json_ids) - 1) % (k + 1))   # the end falls past a round's first row
    llm.add_request(CODE_PROMPTS[0], replace(base, min_tokens=50, k=k), request_id="r")
    with pytest.raises(RequestError, match=f"position {len(json_ids)} no token .* min_tokens"):
        while llm.scheduler.running or llm.scheduler.waiting:
            llm.step()


def test_a_grammar_request_in_the_batch_leaves_the_others_unchanged(shipped):
    """Rows without a grammar get all-ones masks inside the masked branch: their tokens are plain greedy
    decoding's (speculative, one round call with the grammar request)."""
    llm = LLM(shipped, RuntimeConfig(adaptive_width=False))
    free = SamplingParams(max_tokens=40, ignore_eos=True)
    alone = llm.generate(CODE_PROMPTS[:2], SamplingParams(max_tokens=40, ignore_eos=True, speculative=False))
    grammar = SamplingParams(max_tokens=40, grammar=GrammarSpec.json_schema(SCHEMAS["nested"]))
    mixed = llm.generate(CODE_PROMPTS[:3], [free, free, grammar])
    assert [r.token_ids for r in mixed[:2]] == [r.token_ids for r in alone]
    assert mixed[2].metrics.rounds > 0


def test_engines_without_the_mask_input_run_grammar_requests_without_drafting(tiny_root, tmp_path, monkeypatch):
    """An engine dir built before grammar masks: a grammar request decodes plainly (valid output,
    no verify rounds) instead of verifying drafts the grammar never saw."""
    from tandem.export import acceptance

    greedy, sampled = acceptance.greedy, acceptance.sampled
    options = BuildOptions(batch_sizes=(1,), spec_k=2, prefill_chunk=8, max_seq_len=128, page_size=4)
    with monkeypatch.context() as old:
        verify_io = c.verify_step_io
        old.setattr(c, "verify_step_io", lambda *a, **k: (
            [s for s in verify_io(*a, **k)[0]
             if s.name not in (c.TOKEN_BITMASK, c.LOGIT_EDIT_IDS, c.LOGIT_EDITS, c.MIN_P_LOG)], verify_io(*a, **k)[1]))
        old.setattr(acceptance, "greedy", lambda *a, relaxed=None, bitmask=None, **_: greedy(*a, relaxed=relaxed))
        old.setattr(acceptance, "sampled", lambda *a, relaxed=None, bitmask=None, **_: sampled(*a, relaxed=relaxed))
        build_engines(tiny_root / "qwen3_5_mtp1", tmp_path / "old", options, show_progress=False)
    llm = LLM(tmp_path / "old")
    verify_files = [e["file"] for e in llm.manifest["engines"] if e["graph"].startswith("verify")]
    assert verify_files and all(c.TOKEN_BITMASK not in {i.name for i in onnx.load(tmp_path / "old" / f).graph.input}
                                for f in verify_files)
    schema = SCHEMAS["bounded"]   # every string and number bounded: a random model ends it within max_tokens
    grammar = GrammarSpec.json_schema(schema)
    r = llm.generate("def f(x):", SamplingParams(max_tokens=100, grammar=grammar))[0]
    jsonschema.validate(json.loads(r.text), schema)
    assert r.metrics.rounds == 0
    plain = llm.generate("def f(x):", SamplingParams(max_tokens=100, grammar=grammar, speculative=False))[0]
    assert r.token_ids == plain.token_ids


# ---- the server: response_format and guided_* through the official openai client ---------------

@pytest.fixture(scope="module")
def live(shipped):
    from ..server.test_server import Live

    with Live(shipped, default_max_tokens=120) as server:
        yield server


def _client(live):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


def _json_schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.mark.server
@pytest.mark.parametrize("speculative", [True, False])
def test_chat_json_schema_streamed_and_not_validates(live, speculative):
    c = _client(live)
    messages = [{"role": "user", "content": "Give me a record."}]
    for name in (("nested",) if speculative else ("array",)):   # the pipeline tests cover every schema
        schema = SCHEMAS[name]
        for temperature in (0.0, 0.9):
            kw = dict(model="tiny", messages=messages, temperature=temperature, seed=3,
                      response_format=_json_schema_format(schema), extra_body={"speculative": speculative})
            whole = c.chat.completions.create(**kw)
            text = whole.choices[0].message.content
            jsonschema.validate(json.loads(text), schema)
            streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(**kw, stream=True)
                               if ch.choices)
            assert streamed == text, (name, temperature)


@pytest.mark.server
def test_json_object_and_guided_regex_and_grammar(live):
    c = _client(live)
    out = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=0.0,
                                    response_format={"type": "json_object"}, max_tokens=120)
    if out.choices[0].finish_reason == "stop":    # an unbounded object may run past max_tokens
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    out = c.completions.create(model="tiny", prompt="def f(x):", temperature=0.0, max_tokens=20,
                               extra_body={"guided_regex": "(yes|no) [0-9]{2}"})
    assert out.choices[0].text in {f"{w} {n:02d}" for w in ("yes", "no") for n in range(100)}
    out = c.completions.create(model="tiny", prompt="x = ", temperature=0.5, seed=1, max_tokens=20,
                               extra_body={"guided_grammar": 'start: "[" num ("," num)* "]"\nnum: /[0-9]/'})
    assert json.loads(out.choices[0].text) and all(0 <= v <= 9 for v in json.loads(out.choices[0].text))


@pytest.mark.server
def test_bad_grammars_are_400_and_the_server_keeps_serving(live):
    import httpx

    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    cases = [({"response_format": _json_schema_format({"type": "objectx"})}, "response_format.json_schema.schema"),
             ({"response_format": {"type": "json_schema"}}, "response_format"),
             ({"guided_regex": "a(b"}, "guided_regex"),
             ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
             ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
             ({"response_format": {"type": "xml"}}, "response_format.type"),
             ({"response_format": _json_schema_format({"type": "object", "required": ["next"], "properties": {
                 "next": {"$ref": "#"}}})}, "response_format.json_schema.schema"),      # no finite value
             ({"guided_json": {"$defs": {"n": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/n"}}},
                               "$ref": "#/$defs/n"}}, "guided_json")]
    for extra, param in cases:
        r = httpx.post(f"{live.url}/v1/chat/completions", json={**body, **extra}, timeout=60)
        assert r.status_code in (400, 422), (extra, r.text)
        assert r.json()["error"]["param"] == param, (extra, r.json())
    ok = _client(live).chat.completions.create(model="tiny", messages=body["messages"], max_tokens=4)
    assert ok.choices[0].finish_reason in ("length", "stop")


@pytest.mark.server
def test_constraints_that_leave_no_token_are_400_streamed_or_not_and_the_others_are_served(live):
    """A schema with allowed_token_ids it cannot use is refused once it runs (400 naming
    response_format; in a stream, an error event with code 400), while a request beside it finishes."""
    import httpx

    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
            "response_format": _json_schema_format(SCHEMAS["nested"]), "allowed_token_ids": list(range(100, 200))}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        other = pool.submit(httpx.post, f"{live.url}/v1/completions",
                            json={"model": "tiny", "prompt": "def f(x):", "max_tokens": 24}, timeout=60)
        r = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=60)
        assert other.result().status_code == 200 and other.result().json()["choices"][0]["text"]
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema.schema", r.text
    assert "allowed_token_ids" in r.json()["error"]["message"]
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == 400 and events[-1]["error"]["param"] == "response_format.json_schema.schema"


# ---- drafts under the grammar -------------------------------------------------------------------

def test_a_head_drafts_the_best_token_its_last_rows_mask_allows(tiny_root):
    """The MTP head graph takes the draft at last_row under that row's mask: the masked argmax, with
    the masked softmax's probability; the other rows' masks do not matter."""
    from tandem.export.graphs import mtp_head
    from tandem.export.layers import Weights

    ckpt = open_checkpoint(tiny_root / "qwen3_5_mtp1")
    desc = ckpt.description
    head = session(mtp_head(desc, Weights(ckpt), 0))
    rng = np.random.default_rng(3)
    feeds = {c.INPUT_IDS: rng.integers(0, desc.vocab_size, (2, 3)), c.LAST_ROW: np.array([2, 1]),
             c.HIDDEN_IN: rng.standard_normal((2, 3, desc.hidden_size)).astype(np.float32)}

    def draft(masks):
        out = PagedState(desc, 2, kv_layers=[c.mtp_layer_name(0)]).run(head, {**feeds, c.TOKEN_BITMASK: masks})
        return out[c.DRAFT_TOKEN], out[c.DRAFT_PROB]

    words = c.mask_words(desc.vocab_size)
    free, _ = draft(np.full((2, 3, words), -1, np.int32))
    masks = np.zeros((2, 3, words), np.int32)                 # every row but last_row forbids everything
    for b, last in enumerate((2, 1)):
        masks[b, last] = _bits(desc.vocab_size, set(range(desc.vocab_size)) - {int(free[b])})
    second, _ = draft(masks)
    assert (second != free).all() and all(allowed(masks[b, last], int(second[b])) for b, last in enumerate((2, 1)))
    for b, last in enumerate((2, 1)):                         # one token allowed: it, with probability 1
        masks[b, last] = _bits(desc.vocab_size, {7 + b})
    only, p_only = draft(masks)
    assert only.tolist() == [7, 8] and np.allclose(p_only, 1.0)


def test_a_head_drafts_the_argmax_of_its_last_rows_edited_logits(tiny_root):
    """Logits processors' edits reach the MTP head too: its draft is the argmax of last_row's logits
    after its edit list (a bias can move it to any token; a ban of the free draft moves it away), its
    probability the edited softmax's; identity edits leave the free draft."""
    from tandem.export.graphs import mtp_head
    from tandem.export.layers import Weights

    ckpt = open_checkpoint(tiny_root / "qwen3_5_mtp1")
    desc = ckpt.description
    head = session(mtp_head(desc, Weights(ckpt), 0))
    rng = np.random.default_rng(5)
    feeds = {c.INPUT_IDS: rng.integers(0, desc.vocab_size, (2, 3)), c.LAST_ROW: np.array([2, 1]),
             c.HIDDEN_IN: rng.standard_normal((2, 3, desc.hidden_size)).astype(np.float32)}

    def draft(ids, values):
        out = PagedState(desc, 2, kv_layers=[c.mtp_layer_name(0)]).run(
            head, {**feeds, c.LOGIT_EDIT_IDS: np.asarray(ids, np.int64), c.LOGIT_EDITS: np.asarray(values, np.float32)})
        return out[c.DRAFT_TOKEN].tolist(), out[c.DRAFT_PROB]

    identity = np.tile(np.float32([0.0, 1.0, 0.0]), (2, 3, 2, 1))
    free, _ = draft(np.zeros((2, 3, 2)), identity)
    biased = identity.copy()
    biased[0, 2, 0] = [100.0, 1.0, 0.0]             # sequence 0, its last row: token 11 biased up
    biased[1, 1, 1] = [-100.0, 1.0, 0.0]            # sequence 1, its last row: its free draft banned
    biased[0, 0, 0] = biased[1, 2, 0] = [100.0, 1.0, 0.0]   # rows other than last_row: not read
    ids = np.zeros((2, 3, 2), np.int64)
    ids[0, :, 0], ids[1, :, 1], ids[1, 2, 0] = 11, free[1], 5
    got, prob = draft(ids, biased)
    assert got[0] == 11 and prob[0] == pytest.approx(1.0, abs=1e-6)
    assert got[1] != free[1] and got[1] != 5


def test_every_draft_of_a_grammar_request_is_one_its_grammar_allows(shipped, monkeypatch):
    """Under a schema the heads draft under the request's masks, so every draft reaching the verify
    step is allowed where it stands (the grammar's forced-token replacement is not needed)."""
    from tandem.pipeline import grammar as grammar_module

    seen, refused = [], []
    real = grammar_module.Matcher.draft_masks

    def check(self, output, drafts):
        new, masks = real(self, output, drafts)
        seen.append(len(drafts))
        refused.extend((i, d) for i, d in enumerate(drafts) if not allowed(masks[i], d))
        return new, masks

    monkeypatch.setattr(grammar_module.Matcher, "draft_masks", check)
    llm = LLM(shipped, RuntimeConfig(adaptive_width=False))
    for schema in SCHEMAS.values():
        llm.generate(CODE_PROMPTS[:2], SamplingParams(max_tokens=40, k=K, grammar=GrammarSpec.json_schema(schema)))
    assert max(seen) == K and sum(seen) > 50 and not refused, (seen, refused[:5])

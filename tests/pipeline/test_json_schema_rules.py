"""What a JSON schema's grammar alone does not ensure, and tandem does: no key twice in one object
(pipeline/json_keys.py, a guard on every mask row), a schema with no finite value refused
(pipeline/json_schema_checks.py), and oneOf compiled (as anyOf where llguidance cannot prove the
branches disjoint)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from tandem.checkpoint import open_checkpoint
from tandem.pipeline.grammar import Grammars, GrammarSpec, allowed, allowed_tokens
from tandem.pipeline.json_keys import KeyScanner
from tandem.pipeline.json_schema_checks import infinite_ref
from tandem.pipeline.request_checks import RequestError

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "tandem-tiny-code"


@pytest.fixture(scope="module")
def grammars():
    desc = open_checkpoint(SHIPPED).description
    return Grammars(SHIPPED / "tokenizer.json", desc.vocab_size, desc.eos_token_ids)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(str(SHIPPED / "tokenizer.json"))


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def _token(grammars, piece: bytes) -> int:
    return grammars.key_table.token_bytes.index(piece)


def test_scanner_keeps_each_objects_keys():
    s = KeyScanner()
    s.feed(b'{"a": {"b": [1, {"c": "x\\"y", "d": null}], "\\u0065": 2, "')
    assert [o.keys for o in s.stack] == [{b"a"}, {b"b", b"e"}] and s.open_key() is not None
    s.feed(b'e\\u0065": 3}, "f": ')
    assert [o.keys for o in s.stack] == [{b"a", b"f"}]
    s.feed(b'{"g": "v", "')
    assert s.open_key() is not None and s.stack[-1].keys == {b"g"}
    s.feed(b'h"')
    assert s.open_key() is None and s.stack[-1].keys == {b"g", b"h"}


@pytest.mark.parametrize("schema", [{"type": "object"}, {"type": "object", "properties": {"a": {"type": "integer"}},
                                                          "additionalProperties": {"type": "integer"}}])
def test_a_key_its_object_has_cannot_close_again(grammars, tok, schema):
    """After {"a": 1, " the tokens that would close the key as a (directly, or after an escape that
    decodes to a) are masked; b may close; the masks of drafts roll back."""
    m = grammars.matcher(GrammarSpec.json_schema(schema))
    a, b, quote = _token(grammars, b"a"), _token(grammars, b"b"), _token(grammars, b'"')
    closing = grammars.key_table.closing[b""]       # tokens that start with a quote: ", ":, ", ...
    assert quote in closing and len(closing) > 3
    out = _ids(tok, '{"a": 1, "')
    m.sync(out + [a])
    mask = m.mask()
    assert allowed(mask, a) and not any(allowed(mask, t) for t in closing)   # "aa" may follow, "a" may not close
    m_b = grammars.matcher(GrammarSpec.json_schema(schema))
    m_b.sync(out + [b])
    assert allowed(m_b.mask(), quote)
    drafts, masks = m_b.draft_masks(out + [b], [quote, _token(grammars, b":"), _token(grammars, b" "), _token(
        grammars, b"2"), *_ids(tok, ', "'), b])
    assert allowed(masks[0], quote) and not allowed(masks[-1], quote)   # after "b" closed, b may not close again
    m_b.sync(out + [b])
    m_b._masks.clear()                                  # computed again, not the one kept:
    assert (m_b.mask() == masks[0]).all()               # the drafts (and the key guard) rolled back
    for written, closes in (('{"x\\"y": 1, "x\\"y', False), ('{"x\\"y": 1, "x', True)):   # keys with escapes
        escaped = grammars.matcher(GrammarSpec.json_schema(schema))
        escaped.sync(_ids(tok, written))
        assert allowed(escaped.mask(), quote) == closes, written


CLOSERS = [b'"', b"}", b",", b":", b" ", b"1"]


def test_a_walk_that_wants_a_key_twice_writes_it_once(grammars, tok):
    """A greedy walk whose 'model' prefers the text {"a": 1, "a": 2, "a": 3} gets a JSON object with
    distinct keys: where it would close a again the guard gives it another token."""
    m = grammars.matcher(GrammarSpec.json_schema({"type": "object", "additionalProperties": {"type": "integer"},
                                                  "maxProperties": 3}))
    want = '{"a": 1, "a": 2, "a": 3}'
    pieces = grammars.key_table.token_bytes
    out, text = [], b""
    eos = set(grammars.tokenizer.eos_tokens)
    for _ in range(60):
        m.sync(out)
        ok = np.flatnonzero(allowed_tokens(m.mask(), grammars.vocab_size))
        if set(ok.tolist()) <= eos:
            break
        rest = want.encode()[len(text):] if want.encode().startswith(text) else b""
        fits = [t for t in ok if t not in eos and pieces[t] and rest.startswith(pieces[t])]
        # off the wanted text: close what is open as soon as the grammar lets it (shortest tokens first)
        t = max(fits, key=lambda t: len(pieces[t])) if fits else \
            min(ok, key=lambda t: (t in eos, CLOSERS.index(pieces[t][:1]) if pieces[t][:1] in CLOSERS else 9,
                                   len(pieces[t])))
        out.append(int(t))
        text += pieces[t]
    pairs = json.loads(text, object_pairs_hook=lambda kv: kv)
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)) and keys[0] == "a" and len(keys) >= 2


def test_schemas_without_a_finite_value_are_refused(grammars):
    linked = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
    assert infinite_ref(linked) == "#"
    with pytest.raises(RequestError, match=r"response_format.*no finite value.*#"):
        GrammarSpec.json_schema(linked).check()
    deep = {"$defs": {"node": {"type": "object", "required": ["kids"], "properties": {
        "kids": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/node"}}}}}, "$ref": "#/$defs/node"}
    assert infinite_ref(deep) == "#/$defs/node"
    with pytest.raises(RequestError, match="guided_json"):
        grammars.compile(GrammarSpec("json_schema", json.dumps(deep), "guided_json"))
    # recursion with a way out is a schema like any other
    finite = [{"type": "object", "properties": {"next": {"$ref": "#"}}},                    # next optional
              {"type": "object", "required": ["next"], "properties": {"next": {"anyOf": [{"$ref": "#"},
                                                                                     {"type": "null"}]}}},
              {"$defs": {"node": {"type": "object", "required": ["kids"], "properties": {
                  "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}, "$ref": "#/$defs/node"}]
    for schema in finite:
        assert infinite_ref(schema) is None
        assert grammars.compile(GrammarSpec.json_schema(schema))


def test_one_of_compiles(grammars, tok):
    """Branches llguidance cannot prove disjoint compile too (as anyOf); a value takes one branch."""
    schema = {"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]}
    m = grammars.matcher(GrammarSpec.json_schema(schema))
    m.sync(_ids(tok, '{"b": "x"}'))
    assert m.ll.is_accepting()

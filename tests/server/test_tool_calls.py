"""Tool calls and reasoning content: each format's parser round-trips calls (nested JSON, quotes,
newlines, several calls) and its streamed deltas, split at every character boundary, join to the
one-piece result; the reasoning span splits the same way; each family declares its formats and the
engine dir carries them; through the server, `tool_choice: required` and a named function always
give a valid call, tool answers go back in, and streamed deltas join to the non-streamed message."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tandem.checkpoint.families import FAMILIES
from tandem.engines.manifest import chat_formats, read_manifest
from tandem.server.reasoning import REASONING_FORMATS, ReasoningParser, Split
from tandem.server.tool_calls import FORMATS, AnswerParser, ToolCallParser, message

from ..pipeline.test_structured_outputs import shipped  # noqa: F401 (the shipped model's engine dir, module-scoped)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city", "days"],
        "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1,
                                                                              "maximum": 7}}}}},
    {"type": "function", "function": {"name": "run_code", "parameters": {
        "type": "object", "required": ["code", "options"],
        "properties": {"code": {"type": "string"}, "options": {"type": "object"}}}}},
]
CALLS = [("get_weather", {"city": "Paris", "days": 3}),
         ("run_code", {"code": 'print("hi")\nx = {"a": [1, 2]}\n', "options": {"nested": {"deep": [1, "two", None]},
                                                                             "quote": "she said \"no\""}})]


def render(fmt: str, name: str, args: dict) -> str:
    """A call as the model's template writes it (values: text for strings, JSON otherwise)."""
    val = lambda v: v if isinstance(v, str) else json.dumps(v)  # noqa: E731
    if fmt == "hermes_json":
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"
    if fmt == "qwen3_xml":
        params = "".join(f"<parameter={k}>\n{val(v)}\n</parameter>\n" for k, v in args.items())
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"
    params = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{val(v)}</arg_value>\n" for k, v in args.items())
    return f"<tool_call>{name}\n{params}</tool_call>"


def _pieces(parser, text: str, cut: int) -> tuple[str, list]:
    a, calls_a = parser.feed(text[:cut])
    b, calls_b = parser.feed(text[cut:])
    return a + b + parser.finish(), calls_a + calls_b


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_parsers_round_trip_and_stream_split_anywhere(fmt):
    text = "Let me check.\n" + "\n".join(render(fmt, n, a) for n, a in CALLS) + "\n"
    whole, calls = _pieces(ToolCallParser(fmt, TOOLS), text, len(text))
    assert whole == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    for cut in range(len(text) + 1):
        got, got_calls = _pieces(ToolCallParser(fmt, TOOLS), text, cut)
        assert got == whole and [(c.name, c.arguments) for c in got_calls] == [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_broken_call_stays_text_and_an_unfinished_one_leaves_no_markup(fmt):
    broken = "<tool_call>\n{not json or markup</tool_call>" if fmt == "hermes_json" else "<tool_call></tool_call>"
    text, calls = _pieces(ToolCallParser(fmt, TOOLS), "a " + broken, 3)
    assert (text, calls) == ("a " + broken, [])
    whole = render(fmt, *CALLS[0])
    for cut in range(2, len(whole)):     # cut off anywhere (max_tokens): the text before it, no half call
        assert _pieces(ToolCallParser(fmt, TOOLS), "b " + whole[:cut], 4) == ("b", []), cut
    assert _pieces(ToolCallParser(fmt, TOOLS), "x < y", 5) == ("x < y", [])   # a '<' that opens nothing stays


FORCED = [{"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "required": ["city", "seats"],
    "properties": {"city": {"type": "string", "minLength": 3, "maxLength": 8},
                   "seats": {"type": "integer", "minimum": 1, "maximum": 4},
                   "cabin": {"type": "string", "enum": ["economy", "first"]},
                   "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}}}}}]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_forced_call_satisfies_its_schema_whatever_is_sampled(fmt, shipped):  # noqa: F811
    """Random tokens under the call grammar: every walk parses to arguments the schema accepts
    (minLength, enum, pattern and optional properties included)."""
    import numpy as np

    from tandem.pipeline.grammar import Grammars, allowed_tokens
    from tandem.server.tool_calls import tool_choice_grammar

    manifest = read_manifest(shipped)
    vocab = manifest["description"]["vocab_size"]
    grammars = Grammars(shipped / "tokenizer.json", vocab, tuple(manifest["description"]["eos_token_ids"]))
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(shipped / "tokenizer.json"))
    spec = tool_choice_grammar(fmt, FORCED, {"type": "function", "function": {"name": "book"}}, False)
    rng, seen = np.random.default_rng(0), set()
    for _ in range(12):
        m, out = grammars.matcher(spec), []
        while not m.ll.is_stopped() and len(out) < 300:
            choices = np.flatnonzero(allowed_tokens(m.mask(), vocab))
            out.append(int(rng.choice(choices)))
            m.sync(out)
        assert m.ll.is_stopped(), repr(tok.decode(out, skip_special_tokens=False))
        text = tok.decode([t for t in out if t not in grammars._eos_ids], skip_special_tokens=False)
        done, calls = _pieces(ToolCallParser(fmt, FORCED), text, len(text))
        assert done == "" and len(calls) == 1, text
        args = json.loads(calls[0].arguments)
        jsonschema.validate(args, FORCED[0]["function"]["parameters"])
        seen |= set(args)
    assert seen == {"city", "seats", "cabin", "code"}     # the optional properties are reachable


def _reasoning(prompt: str, text: str, cut: int) -> Split:
    p = ReasoningParser("think", prompt)
    out = p.feed(text[:cut])
    out += p.feed(text[cut:])
    out += p.finish()
    return out


@pytest.mark.parametrize("prompt, text, reasoning, content", [
    ("<|im_start|>assistant\n", "<think>\nplan: a < b </thin k>\n</think>\n\nThe answer.", "\nplan: a < b </thin k>\n",
     "\n\nThe answer."),
    ("<|im_start|>assistant\n<think>\n", "still thinking</think>done", "still thinking", "done"),   # template opened it
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "no thinking here <", "", "no thinking here <"),
])
def test_reasoning_splits_the_same_at_every_boundary(prompt, text, reasoning, content):
    for cut in range(len(text) + 1):
        got = _reasoning(prompt, text, cut)
        assert (got.reasoning, got.content) == (reasoning, content), cut


def test_answer_deltas_join_to_the_message():
    text = "<think>weigh it</think>" + render("qwen3_xml", *CALLS[0]) + "\n" + render("qwen3_xml", *CALLS[1])
    formats = {"tool_calls": "qwen3_xml", "reasoning": "think"}
    one = AnswerParser(formats, "", TOOLS, True)
    whole = message(one.feed(text) + one.finish())
    assert whole["reasoning_content"] == "weigh it" and whole["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["tool_calls"]] == CALLS
    for cut in range(0, len(text) + 1, 7):
        p = AnswerParser(formats, "", TOOLS, True)
        deltas = p.feed(text[:cut]) + p.feed(text[cut:]) + p.finish()
        got = message(deltas)
        assert got["reasoning_content"] == whole["reasoning_content"] and got["content"] is None
        assert [c["function"] for c in got["tool_calls"]] == [c["function"] for c in whole["tool_calls"]]
        assert [d["tool_calls"][0]["index"] for d in deltas if "tool_calls" in d] == [0, 1]


def test_every_family_declares_known_formats_and_the_engine_dir_carries_them(shipped):  # noqa: F811
    for arch, module in FAMILIES.items():
        formats = module.CHAT_FORMATS[arch]
        assert formats["tool_calls"] in (*FORMATS, None) and formats["reasoning"] in (*REASONING_FORMATS, None)
    manifest = read_manifest(shipped)
    arch = manifest["description"]["architecture"]
    assert manifest["chat_formats"] == chat_formats(manifest) == FAMILIES[arch].CHAT_FORMATS[arch]
    del manifest["chat_formats"]                      # an engine dir built before: its family's declaration
    assert chat_formats(manifest) == FAMILIES[arch].CHAT_FORMATS[arch]


# ---- through the server ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def live(shipped):  # noqa: F811
    from .test_server import Live

    with Live(shipped, default_max_tokens=160) as server:
        yield server


def _client(live):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


def _valid(calls, allowed: set[str]):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert calls
    for call in calls:
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_tool_choice_always_give_a_valid_call(live, choice):
    c = _client(live)
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    allowed = {"get_weather", "run_code"} if choice == "required" else {"get_weather"}
    for temperature, spec in ((0.0, True), (0.9, False)):
        kw = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
                  tool_choice=tool_choice, temperature=temperature, seed=5, parallel_tool_calls=False,
                  extra_body={"speculative": spec})
        out = c.chat.completions.create(**kw)
        assert out.choices[0].finish_reason == "tool_calls"
        _valid(out.choices[0].message.tool_calls, allowed)
        assert len(out.choices[0].message.tool_calls) == 1
        chunks = list(c.chat.completions.create(**kw, stream=True))
        streamed = [t for ch in chunks if ch.choices for t in (ch.choices[0].delta.tool_calls or [])]
        assert [(t.function.name, t.function.arguments) for t in streamed] == [
            (t.function.name, t.function.arguments) for t in out.choices[0].message.tool_calls]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_answers_go_back_in_and_bad_tool_requests_are_400(live):
    import httpx

    c = _client(live)
    first = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
                                      tool_choice="required", temperature=0.0, parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    second = c.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert second.choices[0].message.tool_calls is None and second.usage.prompt_tokens > first.usage.prompt_tokens
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    for extra, param in (({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
                         ({"tool_choice": "required", "guided_regex": "a"}, "tool_choice")):
        r = httpx.post(f"{live.url}/v1/chat/completions", json={**body, **extra}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    for params in ({"type": "banana"}, {"type": "object", "properties": {"a": {"type": "strin"}}},
                   {"type": "object", "properties": [1]}, {"type": "object", "required": "a"},
                   {"type": "string"}, {"type": "object", "properties": {"a": {"minLength": "x"}}}):
        tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
        r = httpx.post(f"{live.url}/v1/chat/completions", json={**body, "tools": tools}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.parameters", r.text
    for calls in ("abc", [1, 2], [{"id": "c1", "type": "function"}], [{"function": {"arguments": "{}"}}]):
        history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": calls}]
        r = httpx.post(f"{live.url}/v1/chat/completions", json={**body, "messages": history}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages[1].tool_calls"), r.text


def test_a_call_cut_off_by_max_tokens_leaves_no_markup(live):
    """tool_choice auto: the model starts a call (a regex makes it) and max_tokens ends it halfway."""
    c = _client(live)
    start = "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, temperature=0.0,
              max_tokens=14, extra_body={"guided_regex": start.replace(".", "\\.").replace("\n", "\\n") + "[a-z]{60}"})
    out = c.chat.completions.create(**kw).choices[0]
    assert out.finish_reason == "length" and out.message.content == "Sure." and not out.message.tool_calls
    chunks = list(c.chat.completions.create(**kw, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "Sure."


def test_reasoning_content_streamed_deltas_join_to_the_non_streamed_fields(live):
    """The shipped model's template does not open <think>; a grammar makes it write a span so the
    split is exercised end to end (streamed and not, the same tokens)."""
    c = _client(live)
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Think first."}], temperature=0.0,
              extra_body={"guided_regex": "<think>[a-z ]{1,20}</think>\n[a-z]{1,10}"})
    whole = c.chat.completions.create(**kw).choices[0].message
    reasoning = whole.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in whole.content and whole.content
    chunks = list(c.chat.completions.create(**kw, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == whole.content


def test_tools_and_template_kwargs_reach_the_chat_template():
    from tandem.server.chat_template import ChatTemplate
    from tandem.server.protocol import ChatMessage
    from tandem.server.tool_calls import template_messages

    t = ChatTemplate("{% for tool in tools %}[{{ tool.function.name }}]{% endfor %}{{ enable_thinking }}|"
                     "{% for m in messages %}{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}"
                     "{{ c.function.arguments.city }}{% endfor %}{{ m.tool_call_id }};{% endfor %}", {})
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    msgs = [ChatMessage(role="assistant", content="", tool_calls=[call]),
            ChatMessage(role="tool", content="21", tool_call_id="c1")]
    out = t.render(template_messages(msgs), tools=TOOLS, kwargs={"enable_thinking": False})
    assert out == "[get_weather][run_code]False|assistant:Oslo;tool:21c1;"

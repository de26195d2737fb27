"""Tool calls: each family's syntax parsed into OpenAI `tool_calls` (streamed too), and the grammar
that makes `tool_choice: required` or a named function produce a valid call.

Formats (a model family's CHAT_FORMATS["tool_calls"], read from the engine dir; no family names here):
    hermes_json   <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>        Qwen3, Qwen3-Next
    qwen3_xml     <tool_call>\n<function=f>\n<parameter=k>\nv\n</parameter>\n</function>\n</tool_call>
                                                                                       Qwen3.5 (transformers 5.24)
    glm           <tool_call>f\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n</tool_call>   GLM-4.5 / GLM-5
In the XML formats a value is text for string parameters and JSON otherwise (as the templates
write them); the tool's parameter schema says which. Several calls follow one another (parallel).

ToolCallParser is fed the answer's content in any pieces and returns text and whole calls as soon
as they are known; a piece that may start a call waits. Its deltas concatenate to one feed's result.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from tandem.pipeline.grammar import JSON_OPTIONS, GrammarSpec
from tandem.pipeline.request_checks import RequestError
from tandem.server.reasoning import held_back

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str            # JSON text of an object
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}", compare=False)

    def openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _params(tools: list[dict], name: str) -> dict:
    """The parameter schema of tool `name` ({} if unknown)."""
    for t in tools:
        if t.get("function", {}).get("name") == name:
            return t["function"].get("parameters") or {}
    return {}


def _value(raw: str, schema: dict):
    """An XML-format argument: text for a string parameter, else JSON (text if it does not parse)."""
    if schema.get("type") == "string":
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _lark(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _json_value(schema: dict) -> str:
    """A Lark rule for a JSON value of `schema`, written compactly (no whitespace padding)."""
    return f"%json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}"


def _string_value(schema: dict, stop: str) -> str:
    """A Lark rule for a string argument written as text: one of its `enum` / `const` values, else a
    regex of its `pattern`, else minLength..maxLength characters with no '<' (the closing tag) and no
    character of `stop`."""
    choices = [schema["const"]] if "const" in schema else schema.get("enum")
    if choices:
        return "(" + " | ".join(_lark(c if isinstance(c, str) else json.dumps(c)) for c in choices) + ")"
    if isinstance(schema.get("pattern"), str):   # the whole value matches it (the schema asks for a match in it)
        pattern = schema["pattern"].removeprefix("^")
        pattern = pattern[:-1] if pattern.endswith("$") and not pattern.endswith("\\$") else pattern
        return "/" + pattern.replace("/", "\\/") + "/"
    least, most = schema.get("minLength", 0), schema.get("maxLength")
    return f"/[^<{stop}]{{{least},{most if most is not None else ''}}}/"


def _arguments(params: dict, argument) -> str:
    """The Lark rule of a call's arguments in an XML format: each property in the schema's order,
    required ones always, optional ones maybe; `argument(key, value_schema)` is one argument's rule."""
    props, required = params.get("properties", {}), params.get("required", [])
    parts = []
    for key in [*props, *(k for k in required if k not in props)]:
        rule = argument(key, props.get(key, {}))
        parts.append(rule if key in required else f"({rule})?")
    return " ".join(parts)


class HermesJson:
    def parse(self, body: str, tools: list[dict]) -> ToolCall:
        call = json.loads(body)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError("a tool call needs a string name")
        args = call.get("arguments", call.get("parameters", {}))
        return ToolCall(call["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))

    def call_rule(self, name: str, params: dict) -> str:
        if "properties" in params and "additionalProperties" not in params:
            params = {**params, "additionalProperties": False}   # the declared arguments only, as the XML formats
        schema = {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                  "properties": {"name": {"const": name}, "arguments": params or {"type": "object"}}}
        return f'{_lark(OPEN + chr(10))} {_json_value(schema)} {_lark(chr(10) + CLOSE)}'


class QwenXml:
    _function = re.compile(r"^\s*<function=([^>\n]+)>(.*)</function>\s*$", re.S)
    _param = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)

    def parse(self, body: str, tools: list[dict]) -> ToolCall:
        m = self._function.match(body)
        if not m:
            raise ValueError("no <function=...> ... </function> in the tool call")
        props = _params(tools, m.group(1)).get("properties", {})
        args = {k: _value(v, props.get(k, {})) for k, v in self._param.findall(m.group(2))}
        return ToolCall(m.group(1), json.dumps(args, ensure_ascii=False))

    def call_rule(self, name: str, params: dict) -> str:
        def argument(key: str, value: dict) -> str:
            text = _string_value(value, r"\n") if value.get("type") == "string" else _json_value(value)
            return f'{_lark(f"<parameter={key}>{chr(10)}")} {text} {_lark(chr(10) + "</parameter>" + chr(10))}'

        return f'{_lark(f"{OPEN}{chr(10)}<function={name}>{chr(10)}")} {_arguments(params, argument)} ' \
               f'{_lark(f"</function>{chr(10)}{CLOSE}")}'


class GlmXml:
    _call = re.compile(r"^\s*([^<\n]+?)\s*(<arg_key>.*)?$", re.S)
    _arg = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def parse(self, body: str, tools: list[dict]) -> ToolCall:
        m = self._call.match(body)
        if not m:
            raise ValueError("no function name in the tool call")
        props = _params(tools, m.group(1)).get("properties", {})
        args = {k: _value(v, props.get(k, {})) for k, v in self._arg.findall(m.group(2) or "")}
        return ToolCall(m.group(1), json.dumps(args, ensure_ascii=False))

    def call_rule(self, name: str, params: dict) -> str:
        def argument(key: str, value: dict) -> str:
            text = _string_value(value, "") if value.get("type") == "string" else _json_value(value)
            return f'{_lark(f"<arg_key>{key}</arg_key>{chr(10)}<arg_value>")} {text} {_lark("</arg_value>" + chr(10))}'

        return f'{_lark(f"{OPEN}{name}{chr(10)}")} {_arguments(params, argument)} {_lark(CLOSE)}'


FORMATS = {"hermes_json": HermesJson(), "qwen3_xml": QwenXml(), "glm": GlmXml()}


def tool_choice_grammar(fmt: str, tools: list[dict], choice, parallel: bool) -> GrammarSpec | None:
    """`required` or {"type": "function", "function": {"name": f}}: a grammar of one call (several when
    parallel and required) of the allowed tools, nothing else. `auto` / `none`: None."""
    if choice in (None, "auto", "none"):
        return None
    names = [t["function"]["name"] for t in tools]
    if choice != "required":
        names = [choice["function"]["name"]]
        parallel = False
    calls = " | ".join(FORMATS[fmt].call_rule(n, _params(tools, n)) for n in names)
    more = ' ("\\n" call)*' if parallel else ""
    return GrammarSpec("lark", f"start: call{more}\ncall: {calls}\n", "tool_choice")


def check_tools(fmt: str | None, tools: list[dict] | None, choice) -> None:
    """RequestError (-> 400) for tools this engine dir cannot parse, a parameter schema that is not a valid
    object schema (checked by the grammar compiler that enforces it), or a tool_choice naming no tool."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise RequestError("tool_choice", "tool_choice needs tools: send the tools it may call")
        return
    if fmt is None:
        raise RequestError("tools", "this model's tool-call syntax is not known to tandem (its family declares no "
                                    "tool-call format), so tool calls cannot be parsed; send the request without tools")
    for i, tool in enumerate(tools):
        params, where = tool["function"].get("parameters"), f"tools[{i}].function.parameters"
        if params is None:
            continue
        if params.get("type", "object") != "object":
            raise RequestError(where, f"{where}: a tool's parameters are an object schema "
                                      '({"type": "object", "properties": {...}}), got type ' + repr(params["type"]))
        GrammarSpec.json_schema(params, where).check()
    names = [t["function"]["name"] for t in tools]
    if isinstance(choice, dict) and choice["function"]["name"] not in names:
        raise RequestError("tool_choice", f"tool_choice names {choice['function']['name']!r}, which is not among "
                                          f"the tools ({', '.join(names)})")


class ToolCallParser:
    """Content text -> (text, calls) as it streams. A block that does not parse stays text."""

    def __init__(self, fmt: str, tools: list[dict]):
        self.fmt, self.tools = FORMATS[fmt], tools
        self._pending = ""
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        buf, out, calls = self._pending + text, "", []
        while buf:
            at = buf.find(OPEN)
            if at < 0:   # hold back what may start a call, and trailing whitespace (dropped if a call follows)
                head = buf[: len(buf) - held_back(buf, OPEN)]
                keep = len(buf) - len(head.rstrip())
                out, buf = out + buf[: len(buf) - keep], buf[len(buf) - keep:]
                break
            end = buf.find(CLOSE, at + len(OPEN))
            if end < 0:                     # a call has begun: wait for its end
                out, buf = out + buf[:at].rstrip(), buf[at:]
                break
            try:
                calls.append(self.fmt.parse(buf[at + len(OPEN) : end], self.tools))
                out += buf[:at].rstrip()
            except (ValueError, KeyError, TypeError):
                out += buf[: end + len(CLOSE)]
            buf = buf[end + len(CLOSE):]
        self._pending = buf
        self.calls += len(calls)
        return out, calls

    def finish(self) -> str:
        """Text still held back. An unfinished call (the model stopped inside it, cut off by max_tokens)
        is dropped, markup and all: a client reads finish_reason "length", never half a call as content.
        Trailing whitespace after a call is dropped too."""
        rest, self._pending = self._pending, ""
        opened = rest.strip()
        if opened.startswith(OPEN) or len(opened) > 1 and OPEN.startswith(opened):
            return ""
        return rest.rstrip() if self.calls and not opened else rest


def template_messages(messages) -> list[dict]:
    """Chat messages as the model's template reads them: an assistant's tool calls with their
    arguments as objects (templates iterate them), a tool answer with its call id."""
    out = []
    for i, msg in enumerate(messages):
        m = {"role": msg.role, "content": msg.text()}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(msg, key) is not None:
                m[key] = getattr(msg, key)
        calls = []
        for j, call in enumerate(msg.tool_calls or []):
            fn = {"name": call.function.name, "arguments": call.function.arguments}
            if isinstance(fn["arguments"], str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError as e:
                    where = f"messages[{i}].tool_calls[{j}].function.arguments"
                    raise RequestError(where, f"{where} is not JSON ({e}); send the arguments as the JSON text "
                                              "the server returned") from None
            calls.append({**({"id": call.id} if call.id is not None else {}), "type": "function", "function": fn})
        if calls:
            m["tool_calls"] = calls
        out.append(m)
    return out


class AnswerParser:
    """A chat answer's text -> OpenAI deltas: reasoning_content, content, tool_calls (in that order of
    checking: the thinking span first, tool calls only outside it)."""

    def __init__(self, formats: dict, prompt: str, tools: list[dict] | None, parse_tools: bool):
        from tandem.server.reasoning import ReasoningParser

        self.reasoning = ReasoningParser(formats["reasoning"], prompt) if formats.get("reasoning") else None
        fmt = formats.get("tool_calls")
        self.tools = ToolCallParser(fmt, tools or []) if parse_tools and tools and fmt else None
        self.calls = 0

    def feed(self, text: str) -> list[dict]:
        if self.reasoning is None:
            return self._content(text)
        split = self.reasoning.feed(text)
        return ([{"reasoning_content": split.reasoning}] if split.reasoning else []) + self._content(split.content)

    def finish(self) -> list[dict]:
        deltas = []
        if self.reasoning is not None:
            split = self.reasoning.finish()
            deltas += [{"reasoning_content": split.reasoning}] if split.reasoning else []
            deltas += self._content(split.content)
        if self.tools is not None:
            rest = self.tools.finish()
            deltas += [{"content": rest}] if rest else []
        return deltas

    def _content(self, text: str) -> list[dict]:
        if self.tools is None:
            return [{"content": text}] if text else []
        out, calls = self.tools.feed(text)
        deltas = [{"content": out}] if out else []
        for call in calls:
            deltas.append({"tool_calls": [call.openai(self.calls)]})
            self.calls += 1
        return deltas


def message(deltas: list[dict]) -> dict:
    """The non-streamed assistant message: the deltas joined."""
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls = [{k: v for k, v in c.items() if k != "index"} for d in deltas for c in d.get("tool_calls", [])]
    out = {"role": "assistant", "content": content if content or not calls else None}
    if reasoning:
        out["reasoning_content"] = reasoning
    if calls:
        out["tool_calls"] = calls
    return out

"""OpenAI-compatible request bodies (pydantic) and their translation into SamplingParams.

Extensions beyond the OpenAI schema (as vLLM accepts them): `top_k`, `ignore_eos`, and the
speculative options `speculative` (bool, default true), `spec_k` (draft tokens per round) and
`relaxed_acceptance` ({"top_k": 10, "delta": 0.5, "thinking_only": true}: accept near-greedy drafts,
greedy requests only; {"top_k": 0, ...} turns a server default off; docs/server.md). Structured
outputs: `response_format` and vLLM's `guided_json` / `guided_regex` / `guided_grammar` (server/structured.py)."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

from tandem.pipeline.request_checks import INT64_MAX, INT64_MIN, RequestError, check_text
from tandem.pipeline.sampling_params import RelaxedAcceptance, SamplingParams
from tandem.server.structured import StructuredFields

# Strict as the OpenAI API types them: no "yes" for a boolean, no true or "1" for an integer,
# no "0.5" for a number (a JSON integer is a number). Integers stop at int64, as the engines' do.
Int64 = Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)]


def Int(low: int = INT64_MIN, high: int = INT64_MAX):  # noqa: N802 - a type, as Int64
    """An int64 in [low, high] (a bound given beside an Annotated type's own is not applied)."""
    return Annotated[StrictInt, Field(ge=low, le=high)]



class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False   # vLLM's: every chunk carries its choice's usage so far


class RelaxedAcceptanceBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    top_k: Int(0)
    delta: StrictFloat = Field(ge=0.0, le=1.0)
    thinking_only: StrictBool = False


FiniteFloat = Annotated[StrictFloat, Field(allow_inf_nan=False)]
MAX_LOGPROBS = 20           # top_logprobs / logprobs at most (OpenAI's and vLLM's default max_logprobs)
MAX_LOGIT_BIAS = 100.0      # |bias| at most, as OpenAI


class _Common(StructuredFields):   # response_format and guided_* (server/structured.py)
    # Fields the models do not declare are kept (model_extra) and refused by the server (unknown_field),
    # unless it runs with --allow-extra-fields.
    model_config = ConfigDict(extra="allow")

    model: StrictStr
    max_tokens: Int(1) | None = None
    temperature: FiniteFloat = Field(default=1.0, ge=0.0, le=2.0)
    top_p: FiniteFloat = Field(default=1.0, gt=0.0, le=1.0)
    top_k: Int(-1) = 0           # vLLM's -1 and 0 both: off
    min_p: FiniteFloat = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: FiniteFloat = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: FiniteFloat = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: FiniteFloat = Field(default=1.0, gt=0.0, le=2.0)
    logit_bias: dict[StrictStr, FiniteFloat] | None = None
    seed: Int64 | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[Int64] | None = None
    include_stop_str_in_output: StrictBool = False
    min_tokens: Int(0) = 0
    bad_words: list[StrictStr] | None = None
    allowed_token_ids: list[Int64] | None = Field(default=None, min_length=1)
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    prompt_logprobs: Int(0, MAX_LOGPROBS) | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Int(1) = 1
    best_of: Int(1) | None = None
    ignore_eos: StrictBool = False
    return_token_ids: StrictBool = False     # vLLM's: prompt_token_ids and each choice's token_ids
    speculative: StrictBool = True
    spec_k: Int(1, 8) | None = None
    relaxed_acceptance: RelaxedAcceptanceBody | None = None
    user: StrictStr | None = None
    cache_salt: StrictStr | None = Field(default=None, min_length=1)   # vLLM's: shares cached prefixes only alike

    def length_asked(self) -> int | None:
        return self.max_tokens

    def candidates(self) -> int:
        """Engine requests this request runs: n choices, picked from best_of candidates."""
        return max(self.n, self.best_of or 1)

    def logprobs_asked(self) -> int | None:
        """Top logprobs per emitted token (0: the chosen token's only), None: no logprobs."""
        return None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(max_tokens=self.length_asked() or default_max_tokens, temperature=self.temperature,
                              top_k=max(self.top_k, 0), top_p=self.top_p, seed=self.seed, stop=stop,
                              stop_token_ids=tuple(self.stop_token_ids or ()),
                              ignore_eos=self.ignore_eos, speculative=self.speculative, k=self.spec_k,
                              relaxed=RelaxedAcceptance(**self.relaxed_acceptance.model_dump())
                              if self.relaxed_acceptance else None, grammar=self.grammar(),
                              min_p=self.min_p, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                              logit_bias=self._logit_bias(), min_tokens=self.min_tokens,
                              bad_words=tuple(self.bad_words or ()),
                              allowed_token_ids=tuple(self.allowed_token_ids) if self.allowed_token_ids else None,
                              logprobs=self.logprobs_asked(), prompt_logprobs=self.prompt_logprobs_asked(),
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              skip_special_tokens=self.skip_special_tokens, cache_salt=self.cache_salt,
                              spaces_between_special_tokens=self.spaces_between_special_tokens)

    def prompt_logprobs_asked(self) -> int | None:
        return self.prompt_logprobs

    def _logit_bias(self) -> tuple[tuple[int, float], ...]:
        """logit_bias's keys as token ids; RequestError (-> 400) for a key that is not one or a bias out of range."""
        out = []
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.lstrip("-").isdigit()):
                raise RequestError("logit_bias", f"logit_bias: key {key!r} is not a token id; send token ids as "
                                                 'strings of digits, {"1234": -100}')
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise RequestError("logit_bias", f"logit_bias[{key}] = {bias} is out of range: a bias must be in "
                                                 f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
            out.append((int(key), bias))
        return tuple(out)

    def not_honoured(self) -> tuple[str, str] | None:
        """(field, why) for a field whose value this server cannot honour yet (-> 400), else None."""
        if self.best_of is not None and self.best_of < self.n:
            return "best_of", f"best_of={self.best_of} must be >= n={self.n}: it is how many candidates the n " \
                              "choices are picked from"
        if self.stream and self.candidates() > self.n:
            return "best_of", "best_of > n cannot be streamed (the best candidates are known only at the end): " \
                              "drop stream, or send best_of equal to n"
        return None

    def check_text_fields(self) -> None:
        """ValueError (-> 400) naming a text field that is not valid Unicode (a lone surrogate)."""
        check_text(self.model, "model")
        for i, s in enumerate([self.stop] if isinstance(self.stop, str) else self.stop or []):
            check_text(s, "stop" if isinstance(self.stop, str) else f"stop[{i}]")
        for i, s in enumerate(self.bad_words or []):
            check_text(s, f"bad_words[{i}]")
        for key in self.logit_bias or {}:
            check_text(key, "logit_bias")
        if self.user is not None:
            check_text(self.user, "user")
        if self.cache_salt is not None:
            check_text(self.cache_salt, "cache_salt")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


def unknown_field(body: BaseModel, path: str = "") -> str | None:
    """The first field of a request (nested models included) that its model does not declare, as a
    path ('frobnicate', 'messages[0].colour'), or None."""
    for key in body.model_extra or {}:
        return f"{path}.{key}" if path else key
    for name in type(body).model_fields:
        value = getattr(body, name)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, BaseModel):
                where = f"{path}.{name}" if path else name
                if (found := unknown_field(item, f"{where}[{i}]" if isinstance(value, list) else where)) is not None:
                    return found
    return None


PROMPT_FORMS = "a string, a list of token ids, a list of strings or a list of token-id lists"


class CompletionRequest(_Common):
    # one prompt or several (each its own n choices); ids are range-checked against the vocabulary (400)
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    echo: StrictBool = False
    logprobs: Int(0, MAX_LOGPROBS) | None = None
    suffix: StrictStr | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_form(cls, value):
        """One message for every malformed prompt (pydantic's would name one union member)."""
        def ids(x) -> bool:
            return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(value, str) or ids(value):
            return value
        if isinstance(value, list) and value and (all(isinstance(p, str) for p in value)
                                                  or all(ids(p) for p in value)):
            return value
        if value == []:
            raise ValueError(f"prompt is empty: send {PROMPT_FORMS}")
        raise ValueError(f"prompt must be {PROMPT_FORMS}, none of them empty")

    def prompts(self) -> list[str | list[int]]:
        """Each prompt the request sends."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    def logprobs_asked(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_asked(self) -> int | None:
        """echo with logprobs scores the prompt's tokens too (as OpenAI's legacy completions do)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def not_honoured(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix is not supported: these models have no fill-in-the-middle format; send the " \
                             "text before the gap as the prompt"
        return super().not_honoured()

    def check_text_fields(self) -> None:
        super().check_text_fields()
        several = len(self.prompts()) > 1 or isinstance(self.prompt, list) and isinstance(self.prompt[0], str)
        for i, prompt in enumerate(self.prompts()):
            if isinstance(prompt, str):
                check_text(prompt, f"prompt[{i}]" if several else "prompt")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: StrictStr
    text: StrictStr | None = None


class HistoryFunction(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: StrictStr
    arguments: StrictStr | dict = "{}"


class HistoryToolCall(BaseModel):
    """A tool call an earlier assistant message made, as the server returned it."""
    model_config = ConfigDict(extra="allow")

    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: HistoryFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[HistoryToolCall] | None = None
    tool_call_id: StrictStr | None = None
    reasoning_content: StrictStr | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # [{"type": "text", "text": ...}, ...]
            return "".join(part.text or "" for part in self.content)
        return self.content or ""


class FunctionBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: StrictStr = Field(min_length=1, max_length=128, pattern=r"^[^<>\n]+$")   # no markup in a call's name
    description: StrictStr | None = None
    parameters: dict | None = None
    strict: StrictBool | None = None


class ToolBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: FunctionBody


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: StrictStr


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int(1) | None = None   # OpenAI's current name; wins over max_tokens
    logprobs: StrictBool = False
    top_logprobs: Int(0, MAX_LOGPROBS) | None = None
    add_generation_prompt: StrictBool = True
    tools: list[ToolBody] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    chat_template_kwargs: dict | None = None     # e.g. {"enable_thinking": false}, passed to the template

    def length_asked(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def not_honoured(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        return super().not_honoured()

    def tool_dicts(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def tool_choice_value(self):
        """"none" / "auto" / "required" / {"type": "function", "function": {"name": ...}}; tools default to auto."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.model_dump()
        return self.tool_choice or ("auto" if self.tools else "none")

    def check_text_fields(self) -> None:
        super().check_text_fields()
        check_chat_texts(self.messages, self.tools)
        if self.chat_template_kwargs is not None:
            check_text(json.dumps(self.chat_template_kwargs, ensure_ascii=False), "chat_template_kwargs")


def check_chat_texts(messages: list[ChatMessage], tools: list[ToolBody] | None) -> None:
    """RequestError (-> 400) naming the first text of a chat's messages or tools that is not valid
    Unicode (a lone surrogate), or a content part that is not text."""
    for i, msg in enumerate(messages):
        if isinstance(msg.content, str):
            check_text(msg.content, f"messages[{i}].content")
        for j, part in enumerate(msg.content if isinstance(msg.content, list) else []):
            where = f"messages[{i}].content[{j}]"
            if check_text(part.type, f"{where}.type") != "text":
                raise RequestError(where, f"{where}: parts of type {part.type!r} are not supported: this model "
                                          "reads text only (send {\"type\": \"text\", \"text\": ...})")
            check_text(part.text or "", f"{where}.text")
        for name in ("name", "tool_call_id", "reasoning_content"):
            if getattr(msg, name) is not None:
                check_text(getattr(msg, name), f"messages[{i}].{name}")
        for j, call in enumerate(msg.tool_calls or []):
            where = f"messages[{i}].tool_calls[{j}]"
            check_text(call.id or "", f"{where}.id")
            check_text(call.function.name, f"{where}.function.name")
            check_text(call.function.arguments if isinstance(call.function.arguments, str)
                       else json.dumps(call.function.arguments, ensure_ascii=False), f"{where}.function.arguments")
    for i, tool in enumerate(tools or []):
        check_text(tool.function.name, f"tools[{i}].function.name")
        check_text(tool.function.description or "", f"tools[{i}].function.description")
        check_text(json.dumps(tool.function.parameters or {}, ensure_ascii=False),
                   f"tools[{i}].function.parameters")


def error_body(message: str, kind: str, status: int, param: str | None = None) -> dict:
    """The OpenAI error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def json_bytes(body: dict) -> bytes:
    """JSON as ASCII: a lone surrogate echoed from a request (a model name, say) is written as
    its \\u escape instead of failing the UTF-8 encoding."""
    return json.dumps(body, ensure_ascii=True, separators=(",", ":")).encode("ascii")

"""OpenAI-compatible request bodies (pydantic) and their translation into SamplingParams.

Extensions beyond the OpenAI schema (as vLLM accepts them): `top_k`, `ignore_eos`, and the
speculative options `speculative` (bool, default true), `spec_k` (draft tokens per round) and
`relaxed_acceptance` ({"top_k": 10, "delta": 0.5, "thinking_only": true}: accept near-greedy drafts,
greedy requests only; {"top_k": 0, ...} turns a server default off; docs/server.md). Structured
outputs: `response_format` and vLLM's `guided_json` / `guided_regex` / `guided_grammar` (server/structured.py)."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from tandem.pipeline.request_checks import INT64_MAX, INT64_MIN, RequestError, check_text
from tandem.pipeline.sampling_params import RelaxedAcceptance, SamplingParams
from tandem.server.structured import StructuredFields

# Strict as the OpenAI API types them: no "yes" for a boolean, no true or "1" for an integer,
# no "0.5" for a number (a JSON integer is a number). Integers stop at int64, as the engines' do.
Int64 = Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class RelaxedAcceptanceBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    top_k: Int64 = Field(ge=0)
    delta: StrictFloat = Field(ge=0.0, le=1.0)
    thinking_only: StrictBool = False


class _Common(StructuredFields):   # response_format and guided_* (server/structured.py)
    model_config = ConfigDict(extra="allow")

    model: StrictStr
    max_tokens: Int64 | None = Field(default=None, ge=1)
    temperature: StrictFloat = Field(default=1.0, ge=0.0, le=2.0)
    top_p: StrictFloat = Field(default=1.0, gt=0.0, le=1.0)
    top_k: Int64 = Field(default=0, ge=0)
    seed: Int64 | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Int64 = 1
    ignore_eos: StrictBool = False
    speculative: StrictBool = True
    spec_k: Int64 | None = Field(default=None, ge=1, le=8)
    relaxed_acceptance: RelaxedAcceptanceBody | None = None
    user: StrictStr | None = None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(max_tokens=self.max_tokens or default_max_tokens, temperature=self.temperature,
                              top_k=self.top_k, top_p=self.top_p, seed=self.seed, stop=stop,
                              ignore_eos=self.ignore_eos, speculative=self.speculative, k=self.spec_k,
                              relaxed=RelaxedAcceptance(**self.relaxed_acceptance.model_dump())
                              if self.relaxed_acceptance else None, grammar=self.grammar())

    def check_text_fields(self) -> None:
        """ValueError (-> 400) naming a text field that is not valid Unicode (a lone surrogate)."""
        check_text(self.model, "model")
        for i, s in enumerate([self.stop] if isinstance(self.stop, str) else self.stop or []):
            check_text(s, "stop" if isinstance(self.stop, str) else f"stop[{i}]")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictInt]    # ids are range-checked against the vocabulary (400)
    echo: StrictBool = False

    def check_text_fields(self) -> None:
        super().check_text_fields()
        if isinstance(self.prompt, str):
            check_text(self.prompt, "prompt")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # [{"type": "text", "text": ...}, ...]
            return "".join(part.text or "" for part in self.content)
        return self.content or ""


class FunctionBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: StrictStr = Field(min_length=1, max_length=128, pattern=r"^[^<>\n]+$")   # no markup in a call's name
    description: StrictStr | None = None
    parameters: dict | None = None


class ToolBody(BaseModel):
    type: Literal["function"]
    function: FunctionBody


class NamedFunction(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool = True
    tools: list[ToolBody] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    chat_template_kwargs: dict | None = None     # e.g. {"enable_thinking": false}, passed to the template

    def tool_dicts(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def tool_choice_value(self):
        """"none" / "auto" / "required" / {"type": "function", "function": {"name": ...}}; tools default to auto."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.model_dump()
        return self.tool_choice or ("auto" if self.tools else "none")

    def check_text_fields(self) -> None:
        super().check_text_fields()
        for i, msg in enumerate(self.messages):
            if isinstance(msg.content, str):
                check_text(msg.content, f"messages[{i}].content")
            for j, part in enumerate(msg.content if isinstance(msg.content, list) else []):
                where = f"messages[{i}].content[{j}]"
                if check_text(part.type, f"{where}.type") != "text":
                    raise RequestError(where, f"{where}: parts of type {part.type!r} are not supported: this model "
                                              "reads text only (send {\"type\": \"text\", \"text\": ...})")
                check_text(part.text or "", f"{where}.text")


def error_body(message: str, kind: str, status: int, param: str | None = None) -> dict:
    """The OpenAI error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def json_bytes(body: dict) -> bytes:
    """JSON as ASCII: a lone surrogate echoed from a request (a model name, say) is written as
    its \\u escape instead of failing the UTF-8 encoding."""
    return json.dumps(body, ensure_ascii=True, separators=(",", ":")).encode("ascii")

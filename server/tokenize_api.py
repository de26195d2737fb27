"""vLLM's /tokenize and /detokenize: a prompt (text, or chat messages rendered with the model's
template) to the token ids the engines would read, and ids back to text.

    POST /tokenize    {"prompt": "..."} | {"messages": [...]}  ->  {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"tokens": [...]}                        ->  {"prompt": "..."}

A chat is tokenized exactly as /v1/chat/completions reads it (same template, tools and kwargs), so
`count` is the `usage.prompt_tokens` a chat request would report.
"""

from __future__ import annotations

import json
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictStr, Tag

from tandem.pipeline.llm import LLM
from tandem.pipeline.request_checks import RequestError, check_text, check_token_ids
from tandem.server.chat_template import ChatTemplate
from tandem.server.protocol import ChatMessage, Int64, ToolBody, check_chat_texts
from tandem.server.tool_calls import template_messages


class _Tokenize(BaseModel):
    model_config = ConfigDict(extra="allow")   # unknown fields: refused by the server (unknown_field)

    model: StrictStr | None = None
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeText(_Tokenize):
    prompt: StrictStr


class TokenizeChat(_Tokenize):
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool = True
    tools: list[ToolBody] | None = None
    chat_template_kwargs: dict | None = None


def _kind(body) -> str:
    """A body with `messages` is a chat, any other a prompt (so errors name the fields of the one meant;
    capitalized tags are left out of error paths)."""
    return "Chat" if isinstance(body, TokenizeChat) or isinstance(body, dict) and "messages" in body else "Text"


TokenizeBody = Annotated[Annotated[TokenizeChat, Tag("Chat")] | Annotated[TokenizeText, Tag("Text")],
                         Discriminator(_kind)]


class Detokenize(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    tokens: list[Int64]


def tokenize(llm: LLM, template: ChatTemplate | None, req: TokenizeText | TokenizeChat) -> dict:
    """The response body; RequestError (-> 400) for text that is not valid Unicode or a chat
    without a template (ChatTemplateError: the template refused the messages)."""
    if isinstance(req, TokenizeChat):
        check_chat_texts(req.messages, req.tools)
        if req.chat_template_kwargs is not None:
            check_text(json.dumps(req.chat_template_kwargs, ensure_ascii=False), "chat_template_kwargs")
        if template is None:
            raise RequestError("messages", "this model has no chat template (tokenizer_config.json); send a prompt")
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        text = template.render(template_messages(req.messages), req.add_generation_prompt, tools,
                               req.chat_template_kwargs)
    else:
        text = check_text(req.prompt, "prompt")
    ids = llm.tokenizer.encode(text, add_special_tokens=req.add_special_tokens).ids
    if ids:     # (ids of tokens a tokenizer added beyond the vocabulary: refused, as a prompt's are)
        ids = check_token_ids(ids, llm.desc.vocab_size)
    return {"count": len(ids), "max_model_len": llm.max_seq_len, "tokens": ids,
            "token_strs": [llm.tokenizer.id_to_token(t) for t in ids] if req.return_token_strs else None}


def detokenize(llm: LLM, req: Detokenize) -> dict:
    """The ids' text, special tokens included (as vLLM's /detokenize); RequestError for an id outside
    the vocabulary."""
    ids = check_token_ids(req.tokens, llm.desc.vocab_size, "tokens")
    return {"prompt": llm.tokenizer.decode(ids, skip_special_tokens=False)}

"""OpenAI-shaped responses from the serve loop's outputs: a request with `n` choices (or `best_of`
candidates) runs as that many generations per prompt, one queue each; this module turns their
outputs into one response body, or into the SSE chunks of a stream, choice by choice.

    prompts         a completion may send several (a list of strings or of token-id lists): prompt p's
                    choices are p * n .. p * n + n - 1, as vLLM numbers them
    n choices       choice i of a prompt is its generation i (seed + i where the request sets a seed)
    best_of > n     best_of candidates, the n whose tokens have the highest summed logprob returned
    usage           each prompt's tokens once, completion tokens of every candidate (as OpenAI bills them);
                    with stream_options.continuous_usage_stats every chunk carries its choice's so far
    token ids       vLLM's return_token_ids: prompt_token_ids and each choice's token_ids (streamed:
                    the prompt's on a choice's first chunk, each chunk its new tokens)
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from tandem.pipeline.llm import LLM
from tandem.pipeline.sampling_params import SamplingParams
from tandem.server.logprobs_format import LogprobText
from tandem.server.protocol import error_body
from tandem.server.tool_calls import AnswerParser, message

INT64 = 1 << 63


def candidate_params(params: SamplingParams, n: int, count: int) -> list[SamplingParams]:
    """The sampling parameters of a request's `count` candidates: candidate i draws with seed + i
    (wrapped into int64) when a seed is set, so the choices differ and each is reproducible; best_of
    (count > n) ranks candidates by their summed logprob, so each computes its tokens' logprobs."""
    if count > n and params.logprobs is None:
        params = dataclasses.replace(params, logprobs=0)
    if params.seed is None:
        return [params] * count
    return [dataclasses.replace(params, seed=(params.seed + i + INT64) % (2 * INT64) - INT64) for i in range(count)]


class GenerationFailed(Exception):
    """A generation of this response failed (its message is the pipeline's; status and param as the
    serve loop's error says: 400 for a request refused once it ran, else 500)."""

    def __init__(self, message: str, status: int = 500, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


@dataclass
class Collected:
    """One generation, run to its end."""

    text: str
    finish: str
    seq: object                         # pipeline.sequence.Sequence
    scored: list = field(default_factory=list)   # a TokenLogprob per generated token, if asked
    token_ids: list = field(default_factory=list)

    @property
    def cumulative_logprob(self) -> float:
        return sum(e.logprob for e in self.scored)


async def collect(out: asyncio.Queue, failure: type) -> Collected:
    """Read one generation's queue to its final output; `failure`: the queue's error type."""
    text, scored, ids = [], [], []
    while True:
        item = await out.get()
        if isinstance(item, failure):
            raise GenerationFailed(str(item), getattr(item, "status", 500), getattr(item, "param", None))
        text.append(item.text)
        scored += item.logprobs or ()
        ids += item.token_ids
        if item.finished:
            return Collected("".join(text), item.finish_reason, item.sequence, scored, ids)


def best(results: list[Collected], n: int, per_prompt: int) -> list[int]:
    """best_of: per prompt (its `per_prompt` candidates in a row), the indices of the n candidates with
    the highest summed logprob, in that order (ties: the earlier); all of them, in order, when there
    are n."""
    kept = []
    for first in range(0, len(results), per_prompt):
        order = range(first, first + per_prompt)
        kept += list(order) if per_prompt == n else sorted(order, key=lambda i: -results[i].cumulative_logprob)[:n]
    return kept


def usage(prompt_lens: list[int], completion: int) -> dict:
    prompt = sum(prompt_lens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Responses:
    def __init__(self, llm: LLM, model_name: str):
        self.llm, self.model_name = llm, model_name
        self.shown = LogprobText(llm.tokenizer, llm.token_bytes)

    def usage(self, seqs: list, per_prompt: int) -> dict:
        """Every candidate's; the prompts' tokens once per prompt (its `per_prompt` candidates in a row)."""
        rounds = sum(s.metrics.rounds for s in seqs)
        committed = sum(s.metrics.accepted + s.metrics.rounds for s in seqs)
        return {**usage([len(s.prompt) for s in seqs[::per_prompt]], sum(s.num_generated for s in seqs)),
                # the prompt tokens the prefix cache restored (each prompt's first candidate: one prompt, once)
                "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in seqs[::per_prompt])},
                "speculative": {"accept_length": round(committed / rounds, 3) if rounds else 0.0,
                                "verify_steps": rounds}}

    def echoed(self, req, seq, prompt) -> str:
        """A completion's prompt as `echo` returns it: the text sent, or the token ids' text."""
        return prompt if isinstance(prompt, str) else \
            self.llm.tokenizer.decode(seq.prompt, skip_special_tokens=req.skip_special_tokens)

    # ---- whole responses -----------------------------------------------------------------
    def whole(self, rid: str, created: int, req, chat: bool, results: list[Collected],
              answers: list[AnswerParser] | None, kept: list[int], prompts: list) -> dict:
        """`results`: every candidate of every prompt (`prompts`: each prompt as sent; its candidates in
        a row), for the usage; `kept`: the ones returned as choices, in order."""
        shown, choices, per_prompt = self.shown, [], len(results) // len(prompts)
        for i, k in enumerate(kept):
            r = results[k]
            seq = r.seq
            if chat:
                answer = answers[k]
                msg = message(answer.feed(r.text) + answer.finish())
                finish = "tool_calls" if msg.get("tool_calls") and r.finish == "stop" else r.finish
                choice = {"index": i, "message": msg, "logprobs": shown.chat(r.scored) if req.logprobs
                          else None, "finish_reason": finish}
            else:
                logprobs = None
                if req.logprobs is not None:
                    logprobs = shown.completion(r.scored, prompt=(seq.prompt, seq.prompt_logprobs) if req.echo
                                                else None)
                    del logprobs["end"]
                choice = {"index": i, "text": (self.echoed(req, seq, prompts[k // per_prompt]) if req.echo else "")
                          + r.text, "logprobs": logprobs, "finish_reason": r.finish}
                if req.prompt_logprobs is not None:     # vLLM: in the choice (completions), beside them (chat)
                    choice["prompt_logprobs"] = shown.prompt_logprobs(seq.prompt, seq.prompt_logprobs)
                if req.return_token_ids:
                    choice["prompt_token_ids"] = list(seq.prompt)
            if req.return_token_ids:
                choice["token_ids"] = r.token_ids
            choices.append(choice)
        body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": self.model_name, "choices": choices,
                "usage": self.usage([r.seq for r in results], per_prompt)}
        if chat and req.prompt_logprobs is not None:
            seq = results[0].seq
            body["prompt_logprobs"] = shown.prompt_logprobs(seq.prompt, seq.prompt_logprobs)
        if chat and req.return_token_ids:
            body["prompt_token_ids"] = list(results[0].seq.prompt)
        return body

    # ---- streams -------------------------------------------------------------------------
    async def chunks(self, rid: str, created: int, req, chat: bool, outs: list[asyncio.Queue],
                     answers: list[AnswerParser] | None, failure: type,
                     on_unfinished: Callable[[list[int]], None], prompts: list, prompt_ids: list[list[int]]
                     ) -> AsyncIterator[str]:
        """The SSE events of every prompt's n choices as their outputs come (each chunk names its
        choice's index; `prompts`, each as sent, and their token ids: choice i answers prompt i // n);
        `on_unfinished(indices)` when the stream ends before those choices did (the client left)."""
        per_prompt = len(outs) // len(prompts)
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, out: asyncio.Queue):
            while True:
                item = await out.get()
                await merged.put((i, item))
                if isinstance(item, failure) or item.finished:
                    return

        pumps = [asyncio.create_task(pump(i, out)) for i, out in enumerate(outs)]
        choices = [_ChoiceStream(self, req, chat, i, answers[i] if answers else None, prompts[i // per_prompt])
                   for i in range(len(outs))]
        kind = "chat.completion.chunk" if chat else "text_completion"
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

        def event(choice: dict | None, **extra) -> str:
            if continuous and choice is not None:     # the choice's usage so far
                extra["usage"] = usage([len(prompt_ids[choice["index"] // per_prompt])],
                                       choices[choice["index"]].tokens)
            body = {"id": rid, "object": kind, "created": created, "model": self.model_name,
                    "choices": [] if choice is None else [choice], **extra}
            return f"data: {json.dumps(body)}\n\n"

        try:
            if chat:
                for c in choices:
                    ids = {"prompt_token_ids": prompt_ids[c.index // per_prompt]} if req.return_token_ids else {}
                    yield event({"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}, **ids)
            while any(c.seq is None or not c.done for c in choices):
                i, item = await merged.get()
                if isinstance(item, failure):
                    status = getattr(item, "status", 500)
                    kind = "server_error" if status >= 500 else "invalid_request_error"
                    yield f"data: {json.dumps(error_body(str(item), kind, status, getattr(item, 'param', None)))}\n\n"
                    return
                for choice, extra in choices[i].feed(item):
                    yield event(choice, **extra)
            if req.include_usage:
                yield event(None, usage=self.usage([c.seq for c in choices], per_prompt))
            yield "data: [DONE]\n\n"
        finally:
            for p in pumps:
                p.cancel()
            unfinished = [c.index for c in choices if not c.done]
            if unfinished:
                on_unfinished(unfinished)


class _ChoiceStream:
    """One choice of a stream: its answer parser (chat), echo, logprobs' text offset, the tokens sent."""

    def __init__(self, responses: Responses, req, chat: bool, index: int, answer: AnswerParser | None, prompt):
        self.r, self.req, self.chat, self.index, self.answer = responses, req, chat, index, answer
        self.prompt = prompt                   # as sent (echo)
        self.offset = 0                        # completions: the next token's text_offset
        self.echo = not chat and req.echo
        self.prompt_logprobs = req.prompt_logprobs is not None   # still to send
        self.prompt_ids = bool(req.return_token_ids) and not chat   # still to send (chat: on the role chunk)
        self.seq, self.done, self.tokens = None, False, 0

    def feed(self, item) -> list[tuple[dict, dict]]:
        """(choice, extra top-level fields) per chunk that this output makes."""
        self.seq, shown, req = item.sequence, self.r.shown, self.req
        self.tokens += len(item.token_ids)
        extra, first = {}, {}          # top-level fields (chat) and choice fields of this output's first chunk
        if self.prompt_logprobs:
            self.prompt_logprobs = False
            extra["prompt_logprobs"] = shown.prompt_logprobs(self.seq.prompt, self.seq.prompt_logprobs)
        if self.prompt_ids:
            self.prompt_ids = False
            first["prompt_token_ids"] = list(self.seq.prompt)
        if req.return_token_ids:
            first["token_ids"] = item.token_ids
        out = []
        if self.echo:      # the prompt first, with its logprobs
            self.echo = False
            out.append(self._text(self.r.echoed(req, self.seq, self.prompt), None, [],
                                  (self.seq.prompt, self.seq.prompt_logprobs)))
        if self.chat:      # reasoning, content and tool-call deltas; this output's logprobs on the first
            deltas = self.answer.feed(item.text) + (self.answer.finish() if item.finished else [])
            if not deltas and (item.logprobs and req.logprobs or first or extra):
                deltas = [{}]    # text the parser holds back: its tokens' logprobs and ids still go now
            for j, delta in enumerate(deltas):
                lp = shown.chat(item.logprobs) if req.logprobs and item.logprobs and j == 0 else None
                out.append({"index": self.index, "delta": delta, "logprobs": lp, "finish_reason": None})
            if item.finished:
                stop = "tool_calls" if self.answer.calls and item.finish_reason == "stop" else item.finish_reason
                out.append({"index": self.index, "delta": {}, "logprobs": None, "finish_reason": stop})
        elif item.text or item.finished or item.logprobs or first:
            out.append(self._text(item.text, item.finish_reason if item.finished else None, item.logprobs))
        if first and out:
            out[0] = {**out[0], **first}
        self.done = item.finished
        if extra and out:       # on this output's first chunk: in the choice (completions), beside it (chat)
            if self.chat:
                return [(out[0], extra), *((c, {}) for c in out[1:])]
            out[0] = {**out[0], **extra}
        elif extra:
            self.prompt_logprobs = True     # no chunk yet: on the next one
        return [(c, {}) for c in out]

    def _text(self, text: str, finish: str | None, scored: list | None, prompt: tuple | None = None) -> dict:
        logprobs = None
        if self.req.logprobs is not None and scored is not None:
            logprobs = self.r.shown.completion(scored, self.offset, prompt)
            self.offset = logprobs.pop("end")
        return {"index": self.index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

"""Log-probabilities (pipeline/logprobs.py) in the OpenAI response shapes:

    chat          "logprobs": {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
                  "bytes"}]}]}
    completions   "logprobs": {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}],
                  "text_offset": [...]}; with `echo` the prompt's tokens first (the first one's logprob null)
    vLLM's        "prompt_logprobs": [null, {"<id>": {"logprob", "rank", "decoded_token"}}, ...]

A token's text is what the tokenizer decodes it to alone (a piece of a multi-byte character shows
as U+FFFD: its `bytes` are exact)."""

from __future__ import annotations

from tokenizers import Tokenizer

from tandem.pipeline.logprobs import TokenLogprob


class LogprobText:
    """Token ids -> the text and bytes the responses show, from the engine dir's tokenizer."""

    def __init__(self, tokenizer: Tokenizer, pieces: list[bytes] | None):
        self.tokenizer, self.pieces = tokenizer, pieces
        self._text: dict[int, str] = {}

    def text(self, token: int) -> str:
        out = self._text.get(token)
        if out is None:
            out = self._text[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return out

    def bytes(self, token: int) -> list[int]:
        raw = self.pieces[token] if self.pieces is not None and self.pieces[token] else self.text(token).encode()
        return list(raw)

    def chat(self, entries: list[TokenLogprob]) -> dict:
        def one(token: int, logprob: float) -> dict:
            return {"token": self.text(token), "logprob": logprob, "bytes": self.bytes(token)}
        return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                            for e in entries]}

    def completion(self, entries: list[TokenLogprob], offset: int = 0,
                   prompt: tuple[list[int], list[TokenLogprob]] | None = None) -> dict:
        """`offset`: the first token's text_offset (a streamed chunk's: "end" of the chunk before);
        `prompt`: its ids and logprobs (echo), the first token without one. text_offset counts the
        characters of the tokens' own texts before each, special tokens' included (as vLLM does)."""
        tokens, logprobs, tops = [], [], []
        if prompt is not None:
            ids, scored = prompt
            tokens += [self.text(t) for t in ids]
            logprobs += [None, *(e.logprob for e in scored)]
            tops += [None, *(self._top(e) for e in scored)]
        tokens += [self.text(e.token) for e in entries]
        logprobs += [e.logprob for e in entries]
        tops += [self._top(e) for e in entries]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets,
                "end": offset}

    def prompt_logprobs(self, ids: list[int], scored: list[TokenLogprob]) -> list[dict | None]:
        out = [None]
        for e in scored:
            entry = {str(t): {"logprob": lp, "rank": i + 1, "decoded_token": self.text(t)} for i, (t, lp) in
                     enumerate(e.top)}
            entry.setdefault(str(e.token), {"logprob": e.logprob, "rank": e.rank, "decoded_token": self.text(e.token)})
            out.append(entry)
        return out[: len(ids)]

    def _top(self, e: TokenLogprob) -> dict[str, float]:
        top = {}
        for t, lp in e.top:
            top.setdefault(self.text(t), lp)     # (two ids may decode alike: the likelier one is kept)
        return top

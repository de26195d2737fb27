"""Incremental detokenization that never emits broken UTF-8.

Byte-level BPE tokens can end inside a multi-byte character; decoding such a prefix yields
U+FFFD. Text is released only up to the last point where the decoded tail is whole, using a
small window of previous tokens as context (the approach vLLM and transformers' streamers take).
Text that could still turn into a stop string is held back until it cannot.
"""

from __future__ import annotations

from tokenizers import Tokenizer

_MAX_CHARACTER_TOKENS = 4


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""                 # everything decoded so far (whole characters only)
        self.emitted = 0               # chars of self.text handed out
        self._prefix = 0               # token offsets of the decode window
        self._read = 0
        self.stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_ids: list[int]) -> None:
        for t in token_ids:
            self.ids.append(t)
            prefix_text = self._decode(self.ids[self._prefix : self._read])
            full = self._decode(self.ids[self._prefix :])
            # a UTF-8 character spans at most 4 bytes and each byte-level token holds at least one: a
            # tail of more tokens still ending in U+FFFD holds invalid bytes, not a split character,
            # and is released as decoded (else every later token would decode the growing tail again)
            split = full.endswith("\ufffd") and len(self.ids) - self._read <= _MAX_CHARACTER_TOKENS
            if len(full) > len(prefix_text) and not split:
                self.text += full[len(prefix_text) :]
                self._prefix, self._read = self._read, len(self.ids)

    def find_stop(self) -> int:
        """Index in self.text where the first stop string starts, or -1."""
        hits = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else -1

    def truncate(self, at: int) -> None:
        self.text = self.text[:at]

    def take(self, final: bool) -> str:
        """New text since the last take; while running, the tail that may begin a stop string stays."""
        end = len(self.text) if final or not self.stop else max(self.emitted, len(self.text) - self._hold)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out

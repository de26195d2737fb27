"""Incremental detokenization that never emits broken UTF-8.

Byte-level BPE tokens can end inside a multi-byte character; decoding such a prefix yields
U+FFFD. Two ways to release only whole characters:
- a byte-level tokenizer (its decoder is ByteLevel alone) decodes a text as its tokens' bytes
  joined, then read as UTF-8 (invalid bytes as U+FFFD). With each token's bytes in a table
  (byte_pieces, made once per tokenizer), a step's tokens are one join and one incremental UTF-8
  decode, which holds an unfinished character's bytes back: about 0.3 µs a token where the
  tokenizers library's DecodeStream took 4-5 (tiny model, batch 8: a burst's 64 tokens cost a
  fifth of its host time). llama.cpp's token_to_piece is the same table.
- any other tokenizer: the tokenizers library's DecodeStream releases text only once the tokens
  it holds decode to whole characters, using the previous tokens as context.
For valid UTF-8 both release the same text at the same steps; the table's text is
tokenizer.decode's for the whole sequence also where bytes are invalid (each U+FFFD as soon as the
byte is known invalid; byte_pieces checks its table against tokenizer.decode). Text that could
still turn into a stop string is held back until it cannot.
"""

from __future__ import annotations

import codecs
import json

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

_MAX_CHARACTER_TOKENS = 4


def _byte_level_chars() -> dict[int, int]:
    """GPT-2's byte-level alphabet: the code point that stands for each byte (printable Latin-1
    bytes stand for themselves, the others for 256 + n in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = b
        else:
            chars[b] = 256 + extra
            extra += 1
    return {cp: b for b, cp in chars.items()}


def byte_pieces(tokenizer: Tokenizer, size: int = 0, skip_special_tokens: bool = True) -> list[bytes] | None:
    """Each token id's bytes (b"" for ids the tokenizer lacks, up to `size`: a model's vocabulary may
    be larger than its tokenizer's, and for special tokens where `skip_special_tokens`; decoding skips
    them) where the tokenizer's
    decoder is ByteLevel alone, else None. A token whose characters are all in the byte-level
    alphabet is their bytes; any other (an added token such as "<think>" with a character outside
    it) is its UTF-8, as the tokenizers library's ByteLevel decoder does. Checked against
    tokenizer.decode on a spread of ids and on a text: None where any differs."""
    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    if decoder.get("type") != "ByteLevel":
        return None
    # each alphabet character -> the Latin-1 character of its byte; a code point below 256 that is not
    # in the alphabet -> one above 255, so that the token's Latin-1 encoding fails and it falls back to UTF-8
    table = _byte_level_chars()
    table.update({cp: 0x10000 for cp in range(256) if cp not in table})
    pieces = [b""] * max(size, tokenizer.get_vocab_size(with_added_tokens=True))
    for token, i in tokenizer.get_vocab(with_added_tokens=True).items():
        try:
            pieces[i] = token.translate(table).encode("latin-1")
        except UnicodeEncodeError:
            pieces[i] = token.encode()
    for i, added in tokenizer.get_added_tokens_decoder().items():
        if added.special and skip_special_tokens:
            pieces[i] = b""
    step = max(1, len(pieces) // 512)
    sample = [*range(0, len(pieces), step), *tokenizer.get_added_tokens_decoder(), len(pieces) - 1]
    text = tokenizer.encode("Hé wörld ∑ 🙂 日本語\n\tx = {1, 2};").ids
    for ids in [[i] for i in sample] + [text]:
        decoded = b"".join(pieces[i] for i in ids).decode("utf-8", "replace")
        if decoded != tokenizer.decode(ids, skip_special_tokens=skip_special_tokens):
            return None
    return pieces


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), pieces: list[bytes] | None = None,
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
        """`pieces`: byte_pieces(tokenizer, skip_special_tokens=...), where it has them (made once per
        tokenizer). Special tokens are left out of the text where `skip_special_tokens`; with them in
        it, `spaces_between_special_tokens` false writes two added tokens in a row as their own text,
        without the space some decoders (Metaspace) put before the second, as vLLM does for a fast
        tokenizer (a ByteLevel decoder puts none: the table's text is the same either way)."""
        self.tokenizer = tokenizer
        self.pieces = pieces
        self.skip_special = skip_special_tokens
        # added token id -> its text, where adjacent added tokens are written as they are
        self._added = None if skip_special_tokens or spaces_between_special_tokens else \
            {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self._last_added = False
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if pieces is not None else None
        self.text = ""                 # everything decoded so far (whole characters only)
        self.emitted = 0               # chars of self.text handed out
        self.stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._searched = 0             # chars of self.text searched for stop strings (none found)
        self.matched = 0               # length of the stop string find_stop found
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.pending: list[int] = []   # tokens the stream holds back (a character split across them)

    def add(self, token_ids: list[int]) -> None:
        if self.pieces is not None:     # an unfinished character's bytes stay in the UTF-8 decoder
            pieces = self.pieces
            self.text += self._utf8.decode(b"".join([pieces[t] for t in token_ids]))
            return
        for t in token_ids:
            chunk = self._stream.step(self.tokenizer, t)
            if self._added is not None:
                added = self._added.get(t)
                if added is not None and self._last_added:
                    chunk = added      # no space between two added tokens
                self._last_added = added is not None
            if chunk is not None:
                self.text += chunk
                self.pending.clear()
                continue
            self.pending.append(t)
            # a UTF-8 character spans at most 4 bytes and each byte-level token holds at least one:
            # more held tokens are invalid bytes, not a split character. Release them as decoded
            # (U+FFFD) and restart the stream, whose work per token grows with what it holds.
            if len(self.pending) > _MAX_CHARACTER_TOKENS:
                self.text += self.tokenizer.decode(self.pending, skip_special_tokens=self.skip_special)
                self.pending.clear()
                self._stream = DecodeStream(skip_special_tokens=self.skip_special)

    def add_until_stop(self, token_ids: list[int]) -> tuple[int, int]:
        """Add tokens up to the one that completes a stop string -> (tokens added, index in
        self.text where the stop string starts, or -1). With stop strings, one token at a time: a
        round or burst of several tokens then ends where one token a step would have ended."""
        if not self.stop:
            self.add(token_ids)
            return len(token_ids), -1
        for i, t in enumerate(token_ids):
            self.add([t])
            if (at := self.find_stop()) >= 0:
                return i + 1, at
        return len(token_ids), -1

    def find_stop(self) -> int:
        """Index in self.text where the first stop string starts, or -1. Only the text added since
        the last search is searched, with the `_hold` chars before it that a stop string may start
        in: searching the whole text each step cost O(length) per token (4.8 µs a sequence at 2,600
        chars, non-ASCII)."""
        if not self.stop:
            return -1
        start = max(0, self._searched - self._hold)
        self._searched = len(self.text)
        hits = [(i, -len(s)) for i, s in ((self.text.find(s, start), s) for s in self.stop) if i >= 0]
        if not hits:
            return -1
        at, minus_len = min(hits)      # the first; at one index, the longest stop string
        self.matched = -minus_len
        return at

    def truncate(self, at: int) -> None:
        self.text = self.text[:at]

    def take(self, final: bool) -> str:
        """New text since the last take; while running, the tail that may begin a stop string stays."""
        end = len(self.text) if final or not self.stop else max(self.emitted, len(self.text) - self._hold)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out

"""No key twice in one JSON object: what a grammar cannot say, followed on the host.

A JSON schema's grammar (llguidance) lets an object with additional properties, and any object of
`json_object`, repeat a key: {"a": 1, "a": 2} is in the language, and JSON parsers keep one of the
two values. A grammar cannot forbid it (the keys already written are unbounded context), so the
grammar's Matcher (pipeline/grammar.py) takes a KeyGuard beside it:

    consumed bytes --> KeyScanner: a stack of open objects (the keys each has) and arrays, and the
                       string being written (whether it is a key, its raw bytes so far)
    mask row       --> inside a key: clear the tokens that would close it as a key its object has

A key is identified by its decoded text (`"a"` and `"\\u0061"` are the same key). A token closes the
key at its first unescaped quote; KeyTable indexes the tokens with a quote by the bytes before it,
so a row costs one lookup per key the object has (plus the few tokens whose bytes before the quote
hold a backslash, checked one by one).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

QUOTE, BACKSLASH = ord('"'), ord("\\")


class KeyTable:
    """Per tokenizer: each token's bytes, and the tokens holding a quote by the bytes before it."""

    def __init__(self, token_bytes: list[bytes]):
        self.token_bytes = token_bytes
        self.closing: dict[bytes, list[int]] = defaultdict(list)   # bytes before the first quote -> ids
        self.escaped: list[int] = []      # tokens with a backslash before their first quote (checked alone)
        for t, b in enumerate(token_bytes):
            q = b.find(b'"')
            if q < 0:
                continue
            if BACKSLASH in b[:q]:
                self.escaped.append(t)
            else:
                self.closing[b[:q]].append(t)


@dataclass
class _Object:
    keys: set[bytes] = field(default_factory=set)   # decoded keys, UTF-8
    expect_key: bool = True       # the next string in it is a key (after "{" or ","), else a value


@dataclass
class _String:
    is_key: bool
    raw: bytearray = field(default_factory=bytearray)   # as written, escapes included (keys only)
    escape: int = 0               # bytes of an escape still to come: 1 after "\\", 4 after "\\u"


class KeyScanner:
    """The JSON text read so far, as far as keys go. Bytes that are not JSON structure (scalars,
    whitespace) pass through; the grammar, not this, decides what is valid."""

    def __init__(self):
        self.stack: list[_Object | None] = []    # None: an array
        self.string: _String | None = None

    def feed(self, data: bytes) -> None:
        for c in data:
            s = self.string
            if s is not None:
                self._string_byte(s, c)
            elif c == QUOTE:
                top = self.stack[-1] if self.stack else None
                self.string = _String(is_key=top is not None and top.expect_key)
            elif c == ord("{"):
                self.stack.append(_Object())
            elif c == ord("["):
                self.stack.append(None)
            elif c in (ord("}"), ord("]")):
                if self.stack:
                    self.stack.pop()
            elif c == ord(":"):
                if self.stack and self.stack[-1] is not None:
                    self.stack[-1].expect_key = False
            elif c == ord(",") and self.stack and self.stack[-1] is not None:
                self.stack[-1].expect_key = True

    def _string_byte(self, s: _String, c: int) -> None:
        if s.escape:
            s.escape = 4 if (s.escape == 1 and c == ord("u")) else s.escape - 1
        elif c == BACKSLASH:
            s.escape = 1
        elif c == QUOTE:
            self.string = None
            if s.is_key and self.stack and self.stack[-1] is not None:
                self.stack[-1].keys.add(decoded_key(bytes(s.raw)))
            return
        if s.is_key:
            s.raw.append(c)

    def open_key(self) -> tuple[_String, set[bytes]] | None:
        """(the key being written, the keys its object has) while inside a key of an object that has
        keys, else None."""
        s = self.string
        if s is None or not s.is_key or not self.stack or self.stack[-1] is None or not self.stack[-1].keys:
            return None
        return s, self.stack[-1].keys

    def save(self):
        return ([None if o is None else _Object(set(o.keys), o.expect_key) for o in self.stack],
                None if self.string is None else _String(self.string.is_key, bytearray(self.string.raw),
                                                         self.string.escape))

    def restore(self, saved) -> None:
        self.stack, self.string = saved


def decoded_key(raw: bytes) -> bytes:
    """A key's identity: its text decoded from JSON escapes, as UTF-8 (raw bytes where it has none)."""
    if BACKSLASH not in raw:
        return raw
    try:
        return json.loads(b'"' + raw + b'"').encode("utf-8", "surrogatepass")
    except ValueError:
        return raw


def _closes_as(s: _String, token: bytes) -> bytes | None:
    """The decoded key `token` closes the open key `s` with, or None if it does not close it."""
    probe = KeyScanner()
    probe.stack, probe.string = [_Object()], _String(True, bytearray(s.raw), s.escape)
    for c in token:
        probe._string_byte(probe.string, c)
        if probe.string is None:
            return next(iter(probe.stack[0].keys))
    return None


class KeyGuard:
    """One sequence's scanner over the tokens its grammar consumed, and the mask edit it implies."""

    def __init__(self, table: KeyTable):
        self.table, self.scanner = table, KeyScanner()

    def consume(self, token: int) -> None:
        self.scanner.feed(self.table.token_bytes[token])

    def forbidden(self) -> list[int]:
        """Tokens that would close the open key as one its object already has."""
        found = self.scanner.open_key()
        if found is None:
            return []
        s, keys = found
        out = [t for t in self.table.escaped if _closes_as(s, self.table.token_bytes[t]) in keys]
        if s.escape or BACKSLASH in s.raw:    # the key so far holds an escape: check each closing token
            return out + [t for ts in self.table.closing.values() for t in ts
                          if _closes_as(s, self.table.token_bytes[t]) in keys]
        written = bytes(s.raw)
        for key in keys:
            if key.startswith(written):
                out += self.table.closing.get(key[len(written):], ())
        return out

    def edit(self, row: np.ndarray) -> None:
        """Clear the forbidden tokens' bits in one mask row [words] (int32). Where that would leave no
        token (every key the grammar allows there is taken), the row stays as the grammar made it."""
        ids = self.forbidden()
        if not ids:
            return
        bits = row.view(np.uint32)
        kept = bits.copy()
        ids = np.asarray(ids, np.int64)
        np.bitwise_and.at(bits, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))
        if not bits.any():
            bits[:] = kept

"""The thinking span of a chat answer -> `reasoning_content`, the rest -> `content`, streamed.

A reasoning format (a model family's CHAT_FORMATS["reasoning"], read from the engine dir) names its
markers. The parser is fed the answer's text in whatever pieces it arrives and hands back what it
can already place; a piece that may be the start of a marker waits for the next one. So the
streamed deltas concatenate to exactly what one feed of the whole text gives (tests check every
split point). Where the chat template opens the span itself (the prompt ends inside `<think>`, as
Qwen3.5's does with thinking on), the answer starts inside it.
"""

from __future__ import annotations

from dataclasses import dataclass

REASONING_FORMATS = {"think": ("<think>", "</think>")}


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""

    def __iadd__(self, other: Split) -> Split:
        self.reasoning += other.reasoning
        self.content += other.content
        return self


def held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (it may yet become it)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    def __init__(self, fmt: str, prompt: str = ""):
        if fmt not in REASONING_FORMATS:
            raise ValueError(f"unknown reasoning format {fmt!r}; known: {', '.join(REASONING_FORMATS)}")
        self.open, self.close = REASONING_FORMATS[fmt]
        last_open, last_close = prompt.rfind(self.open), prompt.rfind(self.close)
        self.inside = last_open > last_close and not prompt[last_open + len(self.open):].strip()
        self.seen_close = False
        self._pending = ""

    def feed(self, text: str) -> Split:
        out, buf = Split(), self._pending + text
        while buf:
            marker = self.close if self.inside else self.open
            at = buf.find(marker)
            if at >= 0:
                if self.inside:
                    out.reasoning += buf[:at]
                else:
                    out.content += buf[:at]
                buf = buf[at + len(marker):]
                self.seen_close |= self.inside
                self.inside = not self.inside
                continue
            keep = held_back(buf, marker)
            if self.inside:
                out.reasoning += buf[: len(buf) - keep]
            else:
                out.content += buf[: len(buf) - keep]
            buf = buf[len(buf) - keep:]
            break
        self._pending = buf
        return out

    def finish(self) -> Split:
        """What is still held back (an unfinished marker is text after all)."""
        rest, self._pending = self._pending, ""
        return Split(reasoning=rest) if self.inside else Split(content=rest)

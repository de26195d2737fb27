"""States where a request's rules together allow no token: its grammar with allowed_token_ids,
bad_words or min_tokens, or those filters alone (allowed ids that a multi-token bad word bans after
its first tokens). The engine would take a token the request forbids, so the request is refused
(RequestError naming the field: the server's 400) once its output reaches such a state.

    a row that decides a token now (the host's, a verify's first) empty  -> refused at once
    a row further on (a verify row after drafts, a head's) empty         -> recorded: (where the output
        was, the drafts after it); refused if the output takes that path (`check`, from every commit:
        the grammar's matcher as it follows the output, and the engine's output step)

Keyed by the path, not the position alone: rows of drafts the verify rejects are never reached."""

from __future__ import annotations

from tandem.pipeline.request_checks import RequestError


class DeadEnds:
    """One request's: `field` its grammar's request field (None: no grammar; a refusal then names the
    first filter)."""

    def __init__(self, field: str | None):
        self.field = field
        self.states: dict[int, tuple[int, tuple[int, ...], str]] = {}   # position -> (output length, drafts, filters)
        self.checked = 0            # output positions checked so far

    def refusal(self, position: int, filters: str) -> RequestError:
        field = self.field or filters.split(" ")[0]
        rules = f"both the grammar and {filters}" if self.field else f"{filters} together"
        return RequestError(field, f"{field}: at output position {position} no token is allowed by {rules}: the "
                            "request's constraints contradict each other; loosen one of them")

    def found(self, output: list[int], drafts, filters: str, deciding: bool) -> None:
        """An empty row after output + drafts: refused now where it decides a token, else recorded."""
        position = len(output) + len(drafts)
        if deciding:
            raise self.refusal(position, filters)
        self.states[position] = (len(output), tuple(drafts), filters)

    def check(self, tokens: list[int], base: int = 0, end: int | None = None) -> None:
        """Refuse where an output token past those checked was taken in a recorded state. The output is
        tokens[base:end] (the engine's step passes its sequence's tokens and the prompt's length: no copy)."""
        end = len(tokens) if end is None else end
        if self.states:
            for p in range(self.checked, end - base):
                state = self.states.get(p)
                if state is not None and tuple(tokens[base + state[0] : base + p]) == state[1]:
                    raise self.refusal(p, state[2])
            self.states = {p: s for p, s in self.states.items() if p >= end - base}
        self.checked = max(self.checked, end - base)

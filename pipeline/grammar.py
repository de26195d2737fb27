"""Grammar constraints (structured outputs) on the host: what a request asks for, the compiled
matcher that follows its output, and the token bitmasks the engines and the host sampler apply.

llguidance does the grammar work (docs/structured_outputs.md says why it and not xgrammar): a
JSON schema, a regex or a Lark grammar compiles to a matcher over the engine dir's tokenizer.

    GrammarSpec   what a request asks for (frozen, validated at construction; no tokenizer needed)
    Grammars      the engine dir's tokenizer for llguidance; compiles a spec (RequestError if bad)
    Matcher       one sequence's grammar state: consumed output tokens, masks, draft masks

Bitmask layout (contract.TOKEN_BITMASK): int32 words, bit t % 32 of word t // 32 set where token t
is allowed. A speculative round needs one mask per verify row: row i's mask is the state after
the pending token and the drafts d_1..d_i, so the host consumes the drafts one by one, fills a
mask before each, and rolls them back (the verify graph decides which are kept).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import llguidance
import llguidance.numpy
import numpy as np

from tandem.contract import mask_words
from tandem.pipeline.json_keys import KeyGuard, KeyTable
from tandem.pipeline.json_schema_checks import infinite_ref
from tandem.pipeline.request_checks import RequestError

KINDS = ("json_schema", "json_object", "regex", "lark")
# compact JSON: without it a model may pad with whitespace forever (llguidance's default is flexible);
# a %json rule inside a Lark grammar takes the same options as the schema's "x-guidance" key. oneOf
# compiles as anyOf (coerce_one_of): the same where llguidance proves the branches disjoint, else a
# value satisfies at least one branch (docs/structured_outputs.md)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "coerce_one_of": True}


@dataclass(frozen=True)
class GrammarSpec:
    """kind: json_schema (source: the schema as JSON text), json_object (source ""), regex, lark.
    `field` names the request field it came from, for error messages."""

    kind: str
    source: str = ""
    field: str = "response_format"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise RequestError(self.field, f"{self.field}: grammar kind must be one of {', '.join(KINDS)}, "
                                           f"got {self.kind!r}")
        if not isinstance(self.source, str):
            raise RequestError(self.field, f"{self.field}: the grammar must be a string, got "
                                           f"{type(self.source).__name__}")
        if self.kind != "json_object" and not self.source.strip():
            raise RequestError(self.field, f"{self.field}: an empty {self.kind} was sent; send the {self.kind}")

    @classmethod
    def json_schema(cls, schema: dict | bool, field: str = "response_format") -> GrammarSpec:
        if not isinstance(schema, (dict, bool)):
            raise RequestError(field, f"{field}: a JSON schema must be an object, got {type(schema).__name__}")
        if schema is False:
            raise RequestError(field, f"{field}: the schema false allows no output at all; send a schema some "
                                      "JSON value satisfies")
        schema = {} if schema is True else schema   # true: any JSON value
        return cls("json_schema", json.dumps(schema), field)   # key order kept: properties come out in it

    def llguidance_grammar(self) -> str:
        """The llguidance grammar text (a JSON schema can still be invalid: Grammars.compile says)."""
        if self.kind == "json_schema":
            self._check_finite()
            return llguidance.LLMatcher.grammar_from_json_schema(self.source, overrides=JSON_OPTIONS)
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        return self.source


    def _check_finite(self) -> None:
        """RequestError for a schema every value of which nests a `$ref` in itself without end: its
        grammar would force {"next": {"next": ... until the output stops after "{"."""
        try:
            schema = json.loads(self.source)
        except ValueError:
            return      # the compiler says what is wrong with it
        if (ref := infinite_ref(schema)) is not None:
            raise RequestError(self.field, f"{self.field}: the schema has no finite value: every value must hold "
                                           f"{ref} inside itself without end (a required property or minItems "
                                           "leads back to it); make that property optional, or give it another "
                                           'branch such as {"type": "null"}')

    def check(self) -> None:
        """RequestError naming the field if the grammar does not compile (no tokenizer needed)."""
        try:
            error = llguidance.LLMatcher.validate_grammar(self.llguidance_grammar())
        except (ValueError, RuntimeError) as e:
            error = str(e)
        if error:
            raise RequestError(self.field, f"{self.field}: the {self.kind} does not compile: {error}")


class Grammars:
    """Compiles GrammarSpecs over one tokenizer (tokenizer.json of the engine dir), `vocab_size`
    logits wide (the model's, which may exceed the tokenizer's), ending on any of `eos_ids`."""

    def __init__(self, tokenizer_json: str | Path, vocab_size: int, eos_ids: tuple[int, ...]):
        self.vocab_size, self.words = vocab_size, mask_words(vocab_size)
        self._tokenizer_json, self._eos_ids = Path(tokenizer_json), list(eos_ids)
        self._compiled: dict[GrammarSpec, str] = {}

    @functools.cached_property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """Built on the first grammar request, not with the LLM: 60 ms for the shipped model's 4k
        vocabulary, more for real ones, that a run without grammars should not pay at load."""
        return llguidance.LLTokenizer(self._tokenizer_json.read_text(), n_vocab=self.vocab_size,
                                      eos_token=self._eos_ids)

    def compile(self, spec: GrammarSpec) -> str:
        """The checked grammar text; RequestError naming the field and the parser's message if bad."""
        text = self._compiled.get(spec)
        if text is None:
            try:
                text = spec.llguidance_grammar()
            except (ValueError, RuntimeError) as e:
                raise RequestError(spec.field, f"{spec.field}: the {spec.kind} does not compile: {e}") from None
            failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, self.tokenizer)
            if failed:
                raise RequestError(spec.field, f"{spec.field}: the {spec.kind} does not compile: {messages[0]}")
            if len(self._compiled) > 256:   # a long-running server sees many one-off schemas
                self._compiled.clear()
            self._compiled[spec] = text
        return text

    @functools.cached_property
    def key_table(self) -> KeyTable:
        """Each token's bytes, for the JSON kinds' duplicate-key guard (pipeline/json_keys.py)."""
        return KeyTable([self.tokenizer.decode_bytes([t]) for t in range(self.tokenizer.vocab_size)])

    def matcher(self, spec: GrammarSpec) -> Matcher:
        guard = KeyGuard(self.key_table) if spec.kind in ("json_schema", "json_object") else None
        return Matcher(llguidance.LLMatcher(self.tokenizer, self.compile(spec), log_level=0), self.vocab_size, guard,
                       spec.field)


def allowed(mask: np.ndarray, token: int) -> bool:
    """Whether `token`'s bit is set in one row of a bitmask [words]."""
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)


def allowed_tokens(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool [vocab_size] of one row of a bitmask (int32 little-endian words -> bits in id order)."""
    return np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab_size].astype(bool)


class Matcher:
    """One sequence's grammar state: its output and, within a round, the drafts consumed after it.

    `at(output, drafts)` moves the state to output + drafts: output tokens are only ever appended
    (every commit path: prefill, plain decode, verify, unified rounds), drafts are consumed one by
    one past it, each checked against the mask before it, and rolled back to their common prefix
    when the next call asks for other drafts. Each state's mask is computed once and kept until the
    output moves on (`_masks`, keyed by the drafts): a round's draft steps, its verify rows and the
    re-anchor after it share them, and `fill_masks` computes a batch's missing ones together.
    After the end of the grammar (EOS) only EOS is allowed, and tokens past it are not consumed (the
    sequence stops there). A JSON grammar's `guard` follows the same tokens and takes from each mask
    the tokens that would repeat a key in its object (pipeline/json_keys.py)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, guard: KeyGuard | None = None,
                 field: str = "response_format"):
        self.ll, self.vocab_size, self.words = matcher, vocab_size, mask_words(vocab_size)
        self.guard, self.field = guard, field
        self.consumed = 0                   # output tokens in the state
        self.dead_ends = None       # the request's DeadEnds (pipeline/dead_ends.py), where it has filters too
        self._drafts: list[int] = []        # drafts consumed after them
        self._guard_states: list = []       # the guard's state before each of those drafts
        self._masks: dict[tuple[int, ...], np.ndarray] = {}   # drafts -> the mask after output + drafts

    def _consume(self, t: int, what: str) -> None:
        if not self.ll.consume_token(t):
            raise RuntimeError(f"token {t} ({what}) breaks the request's grammar: {self.ll.get_error()}")
        if self.guard is not None:
            self.guard.consume(t)

    def sync(self, output: list[int]) -> None:
        """State := output (no drafts)."""
        self.at(output, ())

    def at(self, output: list[int], drafts) -> bool:
        """State := output + drafts; False (the state then ends before the first draft that is not
        allowed) where a draft is not allowed or the grammar is complete before it."""
        if len(output) != self.consumed:        # the output moved on: the round's drafts and masks go
            self._back_to(0)
            self._masks.clear()
            if self.dead_ends is not None:      # a token taken where the rules allowed none: refused
                self.dead_ends.check(output)
            for t in output[self.consumed :]:   # a token the grammar refuses is a bug in masking upstream
                if self.ll.is_stopped():
                    break
                self._consume(t, f"output position {self.consumed}: a bug in masking upstream")
                self.consumed += 1
            self.consumed = len(output)
        common = 0
        while common < min(len(drafts), len(self._drafts)) and drafts[common] == self._drafts[common]:
            common += 1
        self._back_to(common)
        for d in drafts[common:]:
            if self.ll.is_stopped() or not allowed(self.mask(), d):
                return False
            self._guard_states.append(self.guard.scanner.save() if self.guard is not None else None)
            self._consume(d, "a draft its own mask allows")
            self._drafts.append(d)
        return True

    def _back_to(self, depth: int) -> None:
        """Roll the drafts after the first `depth` back."""
        if len(self._drafts) > depth:
            self.ll.rollback(len(self._drafts) - depth)
            if self.guard is not None:
                self.guard.scanner.restore(self._guard_states[depth])
            del self._drafts[depth:], self._guard_states[depth:]

    def missing_mask(self) -> bool:
        return tuple(self._drafts) not in self._masks

    def mask(self) -> np.ndarray:
        """The current state's mask [words] (int32; computed once, shared: do not write to it)."""
        key = tuple(self._drafts)
        if key not in self._masks:
            self.keep_mask(self._fill_raw(np.empty(self.words, np.int32)))
        return self._masks[key]

    def keep_mask(self, row: np.ndarray) -> None:
        """Take `row`, llguidance's mask of the current state, as its mask (the key guard's edit applied)."""
        if self.guard is not None:
            self.guard.edit(row)
        self._masks[tuple(self._drafts)] = row

    def _fill_raw(self, row: np.ndarray) -> np.ndarray:
        self.ll.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        return row

    def mask_logits(self, logits: np.ndarray, output: list[int]) -> np.ndarray:
        """A copy of one row of logits [V] with forbidden tokens at -inf, after catching up with `output`."""
        self.sync(output)
        keep = allowed_tokens(self.mask(), self.vocab_size)
        return np.where(keep[: len(logits)], logits, -np.inf).astype(logits.dtype)

    def next_mask(self, output: list[int], drafts: list[int]) -> np.ndarray | None:
        """A copy of the mask [words] of the token after output + drafts (what the next draft may be),
        or None where a draft is not allowed or the grammar is complete before it (nothing drafted
        after it can be kept)."""
        return self.mask().copy() if self.at(output, drafts) else None

    def draft_masks(self, output: list[int], drafts: list[int]) -> tuple[list[int], np.ndarray]:
        """Masks of the verify rows [pending, d_1..d_k] -> (drafts, masks [k + 1, words]).
        Where the grammar allows one token only (or, once complete, only EOS) a wrong draft becomes that
        token. A draft it forbids otherwise stays (the verify graph rejects it: the row's mask lacks it)
        and the rows after it get all-ones masks: nothing they decide is kept. Keeping the drafts'
        count keeps a batch's verify widths equal (one engine call, not one per width)."""
        masks = np.full((len(drafts) + 1, self.words), -1, np.int32)
        drafts = list(drafts)
        self.at(output, ())
        for i, d in enumerate(drafts):
            row = masks[i] = self.mask()
            if self.ll.is_stopped():    # complete: this row and every one after allow EOS only (under
                return self._after_end(drafts, masks, i)    # ignore_eos the answer goes on past EOS)
            if not allowed(row, d):
                forced = np.flatnonzero(allowed_tokens(row, self.vocab_size))
                if len(forced) != 1:
                    break
                drafts[i] = d = int(forced[0])
            self.at(output, drafts[: i + 1])
        else:
            masks[len(drafts)] = self.mask()
            if self.ll.is_stopped():
                return self._after_end(drafts, masks, len(drafts))
        return drafts, masks

    def _after_end(self, drafts: list[int], masks: np.ndarray, i: int) -> tuple[list[int], np.ndarray]:
        """The grammar complete from verify row i: rows i.. take its mask (the EOS tokens only) and
        drafts i.. become its first EOS token, which the target then takes (llguidance does not count
        an EOS consumed after the end as a token to roll back, so none is consumed here)."""
        masks[i:] = masks[i]
        eos = int(np.flatnonzero(allowed_tokens(masks[i], self.vocab_size))[0])
        return drafts[:i] + [eos] * (len(drafts) - i), masks


# llguidance's thread pool computes a batch's masks in parallel; on 2 cores its threads compete with
# the engine's and each mask took longer than in the calling thread (shipped model, nested JSON
# schema, batch 8: 41 µs a mask against 26 µs), so it is used only where there are cores to spare
PARALLEL_MIN_CORES = 4
PARALLEL_MIN_MASKS = 4


@functools.cache
def _executor() -> llguidance.LLExecutor | None:
    cores = os.cpu_count() or 1
    return llguidance.LLExecutor(num_threads=min(cores, 32)) if cores >= PARALLEL_MIN_CORES else None


def fill_masks(matchers: list[Matcher]) -> None:
    """The current states' masks of a batch's matchers, each computed once: those not computed yet,
    in one llguidance call over its thread pool where the machine has cores to spare."""
    todo = [m for m in matchers if m.missing_mask()]
    executor = _executor() if len(todo) >= PARALLEL_MIN_MASKS else None
    if executor is None:
        for m in todo:
            m.mask()
        return
    rows = np.empty((len(todo), todo[0].words), np.int32)
    llguidance.numpy.fill_next_token_bitmask_par(executor, [(m.ll, i) for i, m in enumerate(todo)], rows)
    for m, row in zip(todo, rows):
        m.keep_mask(row)

"""The offline API over an engine directory:

    llm = LLM("engines/")
    for r in llm.generate(["def fib(n):"], SamplingParams(max_tokens=32)):
        print(r.text, r.metrics.accept_length)
    for chunk in llm.stream("def fib(n):", SamplingParams(max_tokens=32)):
        print(chunk, end="")

Reads manifest.json and the files it names; nothing else (no checkpoint, no torch).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from tandem import contract
from tandem.checkpoint.description import description_from_dict
from tandem.engines.backends import get_backend
from tandem.engines.integrity import verify_engine_dir
from tandem.engines.manifest import MANIFEST, ManifestError, read_manifest
from tandem.graph_kinds import MAX_DECODE_STEPS, TARGET_STEP, GraphKind
from tandem.pipeline import native_burst, native_sampler
from tandem.pipeline.allocator import FreeList, PageGroups
from tandem.pipeline.decode_burst import DEFAULT_BUDGET_MS, DEFAULT_STEPS, DecodeBurst
from tandem.pipeline.detokenizer import IncrementalDetokenizer, byte_pieces
from tandem.pipeline.failure_isolation import Isolation, isolate_failure
from tandem.pipeline.grammar import Grammars
from tandem.pipeline.logits_processors import Processors, TokenRules
from tandem.pipeline.model_runner import ModelRunner
from tandem.pipeline.multi_step_decode import MultiStepDecode
from tandem.pipeline.outputs import LLMStats, RoundStats, StepOutput
from tandem.pipeline.pools import Pools, plan_pools
from tandem.pipeline.prefix_cache import PrefixCache
from tandem.pipeline.relaxed import RelaxedRows, think_markers
from tandem.pipeline.request_checks import (
    CheckedRequest,
    RequestError,
    check_sampling,
    check_text,
    check_token_filters,
    check_token_ids,
)
from tandem.pipeline.round_loop import RoundLoop
from tandem.pipeline.runtime_settings import read_runtime_settings
from tandem.pipeline.sampler import HostSampler
from tandem.pipeline.sampling_params import RelaxedAcceptance, SamplingParams
from tandem.pipeline.scheduler import Scheduler
from tandem.pipeline.scratch_calls import latency_cases
from tandem.pipeline.sequence import RequestMetrics, Sequence
from tandem.pipeline.unified_round import UnifiedRound
from tandem.pipeline.width_control import WidthController


@dataclass(frozen=True)
class RuntimeConfig:
    memory_budget_bytes: int = 512 << 20   # KV pages + state slots, target and heads together
    max_num_seqs: int | None = None        # running sequences (None: the largest batch size)
    mtp_mode: str | None = None            # "chained": head s at step s (at most n drafts); "reused": head 0
                                           # k times; None: chained when the model has several heads
    spec_k: int | None = None              # global override of the engines' k
    speculative: bool = True               # global switch; requests can also turn it off
    synthetic_acceptance: float | None = None  # benchmark aid only: accept drafts with this probability
    relaxed_acceptance: RelaxedAcceptance | None = None  # default for greedy requests (off: exact); pipeline/relaxed.py
    adaptive_width: bool = True            # pick the verify width per batch size at run time (1: drafting off)
                                           # from observed acceptance and round times; False: tuned/global only
    spec_policy: str | None = None         # the two above in one word (`tandem serve --spec-policy`): "adaptive"
                                           # (both on), "fixed" (the tuned or global width every round), "off"
                                           # (no drafting); a request's own spec_k or speculative wins over it
    threads: int | None = None
    device: str | None = None              # None: the backend's own (onnxruntime: "cpu", tensorrt: "cuda");
                                           # "cuda" with onnxruntime engines: its CUDA provider and CUDA graphs
    decode_steps: int | None = None        # plain greedy decoding: None runs the engine dir's multi-step decode
                                           # graph where it has one (`build-engines --decode-steps`); 1: one
                                           # token per call
    decode_burst: int = DEFAULT_STEPS      # plain decoding (greedy or sampled) without a multi-step graph: up to
                                           # this many target steps per engine step, back to back (1: one) ...
    decode_burst_ms: float = DEFAULT_BUDGET_MS  # ... within about this time (pipeline/decode_burst.py)
    verify: bool = True                    # load: hash the engine files against the manifest (first load, and
                                           # after a file changed); False: sizes only (engines/integrity.py)
    prefix_cache: bool = True              # resume prompts from earlier requests' pages and states
                                           # (pipeline/prefix_cache.py)
    prefix_snapshot_mb: float = 64.0       # memory for the cache's recurrent-state snapshots, beside the budget
                                           # (models with Gated DeltaNet or conv states: one snapshot an entry)
    round: str = "unified"                 # "unified": one engine call per round where the engine dir has the
                                           # round graph (its head mode and widths); "multi": verify, re-anchor
                                           # and draft calls

    def __post_init__(self):
        if self.decode_steps not in (None, 1):
            raise ValueError(f"decode_steps must be None (the engine dir's multi-step decode graph, where built) or 1 "
                             f"(one token per call), got {self.decode_steps!r}; the steps per call are a build option "
                             "(`tandem build-engines --decode-steps N`)")
        if not isinstance(self.decode_burst, int) or not 1 <= self.decode_burst <= MAX_DECODE_STEPS:
            raise ValueError(f"decode_burst must be 1..{MAX_DECODE_STEPS} target steps per engine step (1: off), got "
                             f"{self.decode_burst!r}")
        if not self.decode_burst_ms > 0:
            raise ValueError(f"decode_burst_ms must be > 0 (a burst's time budget), got {self.decode_burst_ms!r}")
        if not (self.prefix_snapshot_mb >= 0 and math.isfinite(self.prefix_snapshot_mb)):
            raise ValueError(f"prefix_snapshot_mb must be a number of MiB >= 0, got {self.prefix_snapshot_mb!r}")
        if self.spec_policy is not None:
            if self.spec_policy not in ("adaptive", "fixed", "off"):
                raise ValueError(f"spec_policy must be adaptive, fixed or off, got {self.spec_policy!r}")
            if self.spec_policy != "off" and not self.speculative or self.spec_policy == "adaptive" and \
                    not self.adaptive_width:
                raise ValueError(f"spec_policy={self.spec_policy!r} contradicts speculative={self.speculative}, "
                                 f"adaptive_width={self.adaptive_width}: set one or the other")
            object.__setattr__(self, "speculative", self.spec_policy != "off")
            object.__setattr__(self, "adaptive_width", self.adaptive_width and self.spec_policy == "adaptive")
        if self.round not in ("unified", "multi"):
            raise ValueError(f"round must be 'unified' or 'multi', got {self.round!r}")
        if self.mtp_mode not in (None, "chained", "reused"):
            raise ValueError(f"mtp_mode must be 'chained' or 'reused', got {self.mtp_mode!r}")
        if self.synthetic_acceptance is not None and not 0.0 <= self.synthetic_acceptance <= 1.0:
            raise ValueError("synthetic_acceptance must be in [0, 1]")


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    metrics: RequestMetrics
    logprobs: list | None = None          # SamplingParams.logprobs: a pipeline.logprobs.TokenLogprob per token
    prompt_logprobs: list | None = None   # SamplingParams.prompt_logprobs: one per prompt token after the first


class LLM:
    def __init__(self, engine_dir: str | Path, config: RuntimeConfig | None = None):
        self.engine_dir = Path(engine_dir)
        self.config = config = config or RuntimeConfig()
        self.manifest = m = read_manifest(self.engine_dir)
        backend = get_backend(m["backend"])
        if not hasattr(backend, "Runner"):
            raise ValueError(f"{self.engine_dir} holds {m['backend']} engines, which the pipeline cannot serve yet: it "
                             "keeps K/V and state pools in host memory, read in place only by the onnxruntime "
                             "backend. Build the engine dir with --backend onnxruntime to serve it.")
        if m.get("contract_version") != contract.CONTRACT_VERSION:  # graphs' inputs/outputs or their meaning changed
            raise ManifestError(f"{self.engine_dir} was built for graph contract {m.get('contract_version')}, but this "
                                f"tandem speaks contract {contract.CONTRACT_VERSION}; rebuild it with `tandem "
                                f"build-engines MODEL_DIR --out {engine_dir}`")
        # before any file the manifest names is read
        self.verification = verify_engine_dir(self.engine_dir, m, hashes=config.verify)
        try:
            self.desc = description_from_dict(m["description"])
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"{self.engine_dir / MANIFEST}: its model description is damaged ({e!r}); rebuild "
                                f"the engine directory with `tandem build-engines MODEL_DIR --out {engine_dir}`") from e
        rt = m["runtime"]
        self.page_size, self.max_seq_len = rt["page_size"], rt["max_seq_len"]
        self.dtype = m["options"].get("dtype", "float32")  # the engines': K/V and conv pools, hidden rows
        self.spec_k = config.spec_k or rt["spec_k"] or 0
        self.verify_widths = set(rt["verify_widths"])
        self.runtime_settings = read_runtime_settings(self.engine_dir, self.verify_widths)
        self.width_per_batch = self._widths(rt)
        if self.spec_k and self.spec_k + 1 > max(self.verify_widths, default=1):
            raise ValueError(f"spec_k {self.spec_k} needs verify width {self.spec_k + 1}, but the engines were "
                             f"built for widths {sorted(self.verify_widths)}; rebuild with --spec-k {self.spec_k}")
        kinds = [(GraphKind.parse(e["graph"]), e) for e in m["engines"]]  # read_manifest checked them
        self.mtp_layers = max([kind.head + 1 for kind, _ in kinds if kind.is_head], default=0)
        self.mtp_mode = config.mtp_mode or ("chained" if self.mtp_layers > 1 else "reused")
        self.tokenizer = _load_tokenizer(self.engine_dir / "tokenizer.json")
        # the detokenizers' table of token bytes, where the tokenizer is byte-level (special tokens
        # skipped; the table that writes them is made on the first request that keeps them)
        self.token_bytes = byte_pieces(self.tokenizer, self.desc.vocab_size)
        self._token_bytes_with_special: list[bytes] | None = None
        batch_sizes = rt["batch_sizes"]
        max_seqs = config.max_num_seqs or max(batch_sizes)
        # the most rows one step writes per sequence: a prefill chunk, a verify width or a multi-step decode
        rows = max(rt["prefill_chunk"], *self.verify_widths, rt.get("decode_steps", 1), config.decode_burst)
        sizes = plan_pools(self.desc, self.page_size, config.memory_budget_bytes, max_seqs, self.mtp_layers,
                           dtype_bytes=np.dtype(self.dtype).itemsize, rows=rows)
        files = {kind.engine_key(e["rows"]): e["file"] for kind, e in kinds}
        runner = backend.Runner(self.engine_dir, sorted(set(files.values())), threads=config.threads,
                                device=config.device)
        snapshots = int(config.prefix_snapshot_mb * 2**20 // sizes.slot_bytes) if config.prefix_cache and \
            sizes.slot_bytes else 0
        self.pools = Pools(self.desc, sizes, self.page_size, self.mtp_layers, self.dtype, memory=runner.memory,
                           snapshots=snapshots)
        max_pages = -(-self.max_seq_len // self.page_size)
        self.runner = ModelRunner(self.desc, runner, self.pools, files, batch_sizes, max_pages, self.mtp_layers,
                                  self.dtype)
        # the host's draws: native where the engine dir's kernel library has the sampler and loads here
        self.sampler = HostSampler(native_sampler.load(runner.host_kernels))
        self.native_burst = native_burst.load(runner.host_kernels)     # and a burst's steps between calls
        self.page_groups = PageGroups(sizes.pages())    # one free list per page group (window None: full)
        self.pages = next(iter(self.page_groups.lists.values()))   # full attention's, when the model has it
        self.slots = FreeList(sizes.num_slots, "state slot", lowest_first=True)
        self.prefix_cache = PrefixCache(self.page_size, self.page_groups.lists, snapshots,
                                        json.dumps([m["fingerprint"], m["model"]], sort_keys=True),
                                        stateful=bool(self.pools.states), prefill_chunk=rt["prefill_chunk"]
                                        ) if config.prefix_cache else None
        # heads' contexts may trail the target's by up to one row per head (previous-head anchoring)
        self.scheduler = Scheduler(self.page_groups, self.slots, self.pools, max(batch_sizes), rt["prefill_chunk"],
                                   head_lag=self.mtp_layers, prefix_cache=self.prefix_cache)
        self.scheduler.max_positions = max_pages * self.page_size
        self.round_loop = RoundLoop(self.runner, self.pools, self.scheduler, self.desc.eos_token_ids, self.mtp_layers,
                             chained=self.mtp_mode == "chained", synthetic_acceptance=config.synthetic_acceptance,
                             width_per_batch=self.width_per_batch, width_control=self._width_control(batch_sizes),
                             unified=self._unified_round([kind for kind, _ in kinds]),
                             decode=self._decode_graph([kind for kind, _ in kinds]), sampler=self.sampler)
        self.round_loop.prefix_cache = self.prefix_cache
        self.round_loop.relaxed = RelaxedRows(config.relaxed_acceptance, think_markers(self.tokenizer),
                                          str(self.engine_dir / "tokenizer.json"))
        self.grammars = Grammars(self.engine_dir / "tokenizer.json", self.desc.vocab_size, self.desc.eos_token_ids)
        self._verify_inputs: dict[tuple, bool] = {}   # (input, verify width, kinds) -> its engines take it
        self._ids = itertools.count()
        first = self._first_graphs()
        self.round_loop.waits_for = set(first)     # a round waits for these (already opening) rather than fall back
        self.runner.prefetch(first)

    def _first_graphs(self) -> list[tuple[GraphKind, int]]:
        """The engines greedy requests call first, opened in the background from here on: the target
        step and, with drafting, the heads that draft after a prefill and the round (or verify) engine
        of each batch size's starting width (batch 1's first). Others open when a round first wants
        them, in the background under the adaptive width (RoundLoop._open_width)."""
        decode = self.round_loop.decode     # a burst calls the target step; a multi-step graph, its own
        first = list(dict.fromkeys([(TARGET_STEP, 1), *([(decode.kind, 1)] if decode else [])]))
        if not (self.config.speculative and self.spec_k and self.mtp_layers):
            return first
        chained = self.mtp_mode == "chained"
        drafts = min(self.spec_k, self.mtp_layers) if chained else self.spec_k
        first += [(GraphKind.mtp_head(j), 1) for j in (range(drafts) if chained else [0])]
        widths = [self.width_per_batch.get(1, drafts + 1), *sorted(set(self.width_per_batch.values()))]
        # and the narrower ones, which a greedy request's last rounds take where its budget leaves fewer drafts
        widths += [w for w in sorted(self.verify_widths) if w <= max(widths)]
        first += [self.round_loop.round_engine(w, sampling=False) for w in dict.fromkeys(widths) if w > 1]
        return first

    def _unified_round(self, kinds: list[GraphKind]) -> UnifiedRound | None:
        """One-call rounds where the engine dir has round graphs of the head mode drafting uses."""
        rounds = [k for k in kinds if k.is_round and k.reused == (self.mtp_mode == "reused")]
        if self.config.round != "unified" or not rounds:
            return None
        return UnifiedRound(self.desc, self.runner, self.pools, list(dict.fromkeys(rounds)))

    def _decode_graph(self, kinds: list[GraphKind]) -> MultiStepDecode | DecodeBurst | None:
        """How plain decoding takes several tokens per engine step: the multi-step decode graph
        (`--decode-steps`; greedy rows) unless the config asks for one token per call, else a burst
        of target steps (`decode_burst`; greedy and sampled rows), else none."""
        decode = [k for k in kinds if k.is_decode]
        if decode and self.config.decode_steps != 1:
            return MultiStepDecode(self.runner, self.pools, max(decode, key=lambda k: k.steps))
        if self.config.decode_burst > 1:
            return DecodeBurst(self.runner, self.pools, self.config.decode_burst, self.desc.eos_token_ids,
                               self.config.decode_burst_ms, self.sampler, self.native_burst)
        return None

    def _width_control(self, batch_sizes: list[int]) -> WidthController | None:
        """The adaptive width controller over the widths a round can use (k + 1 at most, and chained
        heads' n + 1), starting from the tuned widths; None when nothing is adaptive."""
        if not (self.config.adaptive_width and self.mtp_layers and self.spec_k):
            return None
        top = self.spec_k + 1 if self.mtp_mode == "reused" else min(self.spec_k, self.mtp_layers) + 1
        return WidthController([w for w in self.verify_widths if w <= top], batch_sizes, self.width_per_batch,
                               costs=self.runtime_settings.round_seconds,
                               constrained_costs=self.runtime_settings.constrained_round_seconds)

    def _widths(self, runtime: dict) -> dict[int, int]:
        """Verify width per batch size: runtime_settings.json (written by `tandem profile`)
        wins over the manifest's defaults."""
        widths = {int(b): int(w) for b, w in runtime.get("verify_width_per_batch", {}).items()}
        widths = {b: w for b, w in widths.items() if w in self.verify_widths or w == 1}
        return widths | self.runtime_settings.widths

    # ---- requests ----------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (text or ids), checked: see pipeline/request_checks.py."""
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
            try:
                ids = self.tokenizer.encode(prompt).ids
            except Exception as e:  # the tokenizers library raises TypeError/Exception without saying why
                why = str(e) or "no reason given"
                raise RequestError("prompt", f"prompt: the tokenizer cannot encode this text ({why}); send plain "
                                   "UTF-8 text, or token ids") from e
            if not ids:
                raise RequestError("prompt", "prompt is empty: send some text or token ids")
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            ids = prompt
        else:
            raise RequestError("prompt", f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        # the embedding table and the logits both have desc.vocab_size rows: ids of tokens a
        # tokenizer added beyond them would be read out of bounds, so they are refused too
        return check_token_ids(ids, self.desc.vocab_size)

    def check_request(self, prompt: str | list[int], params: SamplingParams) -> CheckedRequest:
        """Everything add_request refuses, without touching the scheduler: the server runs it
        when a request arrives, so a bad one never reaches the serve-loop thread."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        check_sampling(params)
        self.round_loop.relaxed.check(params)
        ids = self.encode(prompt)
        if params.k is not None and params.speculative and not self.config.speculative:
            raise RequestError("spec_k", f"spec_k={params.k}: this server does not draft (speculation off: "
                                         "`--spec-policy off`); drop spec_k")
        k_fixed = params.k is not None or self.config.spec_k is not None
        k = params.k if params.k is not None else self.spec_k
        speculative = bool(self.config.speculative and params.speculative and self.mtp_layers and k)
        if speculative and k + 1 not in self.verify_widths:
            raise RequestError("spec_k", f"k={k} needs verify width {k + 1}; the engines have widths "
                               f"{sorted(self.verify_widths)}")
        for name in ("logit_bias", "allowed_token_ids"):   # ids index the logits: outside is a 400
            named = [t for t, _ in params.logit_bias] if name == "logit_bias" else params.allowed_token_ids or ()
            for t in named:
                if not 0 <= t < self.desc.vocab_size:
                    raise RequestError(name, f"{name}: token id {t} is outside the vocabulary [0, "
                                             f"{self.desc.vocab_size}); send ids the model's tokenizer produces")
        check_token_filters(params, self.bad_word_ids(params), params.ending_ids(self.desc.eos_token_ids))
        if params.grammar is not None:
            self.grammars.compile(params.grammar)
            if self.config.synthetic_acceptance is not None:
                raise RequestError(params.grammar.field, "structured outputs cannot run with synthetic_acceptance "
                                   "(it accepts drafts whatever the grammar says): serve without it")
        if self.config.synthetic_acceptance is not None and (params.processed or params.logprobs is not None):
            raise RequestError("logprobs" if params.logprobs is not None else "sampling", "logits processors and "
                               "logprobs cannot run with synthetic_acceptance (its tokens are not the model's)")
        if len(ids) + params.max_tokens > self.max_seq_len:
            raise RequestError("max_tokens", f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = "
                               f"{len(ids) + params.max_tokens} tokens, more than the context length of "
                               f"{self.max_seq_len} (the engines' --max-seq-len); shorten the prompt or lower "
                               "max_tokens, or rebuild the engines with a larger --max-seq-len")
        full = self.page_groups.lists.get(None)   # window groups hold what a window needs, whatever the length
        capacity = (full.size - 1) * self.page_size if full else self.max_seq_len
        needs = min(len(ids) + params.max_tokens + k, self.max_seq_len)   # a round's drafts may pass max_tokens
        if needs > capacity:
            raise RequestError("max_tokens", f"the request needs {needs} positions but the KV memory holds "
                               f"{capacity}; raise memory_budget_bytes (serve --memory-budget-mb)")
        return CheckedRequest(ids, speculative, k if speculative else 0, k_fixed)

    def bad_word_ids(self, params: SamplingParams) -> list[list[int]]:
        """Each bad word's token ids as the tokenizer writes it alone and after a space (as vLLM bans them)."""
        out = []
        for i, word in enumerate(params.bad_words):
            check_text(word, f"bad_words[{i}]")
            if not word.strip():
                raise RequestError(f"bad_words[{i}]", f"bad_words[{i}] is empty: send a word to ban, or leave it out")
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False).ids
                if ids and ids not in out:
                    out.append(ids)
        return out

    def _verify_takes(self, name: str, width: int, sampling: tuple[bool, ...] = (False, True)) -> bool:
        """Whether the verify engines up to `width` take input `name` (grammar masks, logit edits: engines
        built before them do not). Asks the engines' bindings: call from the engine's thread
        (add_request), not a request handler's."""
        for w in sorted(x for x in self.verify_widths if x <= width):
            if (name, w, sampling) not in self._verify_inputs:
                self._verify_inputs[(name, w, sampling)] = self.runner.verify_has(name, w, sampling)
        return all(self._verify_inputs[(name, w, sampling)] for w in self.verify_widths if w <= width)

    def _rules(self, seq: Sequence) -> TokenRules | None:
        """The sequence's grammar and logits processors, or None when it has neither."""
        p = seq.params
        if p.grammar is None and not p.processed:
            return None
        processors = Processors(p, seq.prompt, self.desc.vocab_size, seq.ending_ids(self.desc.eos_token_ids),
                                self.bad_word_ids(p)) if p.processed else None
        matcher = self.grammars.matcher(p.grammar) if p.grammar is not None else None
        return TokenRules(self.desc.vocab_size, matcher, processors)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> Sequence:
        """Queue a request (ValueError, naming the field, if check_request refuses it)."""
        params = params or SamplingParams()
        req = self.check_request(prompt, params)
        speculative, k = req.speculative, req.k
        if speculative and ((params.grammar is not None or params.processed)
                            and not self._verify_takes(contract.TOKEN_BITMASK, k + 1)
                            or params.processed and not self._verify_takes(contract.LOGIT_EDIT_IDS, k + 1)
                            or params.min_p and not params.greedy
                            and not self._verify_takes(contract.MIN_P_LOG, k + 1, (True,))
                            or params.logprobs is not None and not self._verify_takes(contract.WANT_LOGPROBS, k + 1)):
            speculative, k = False, 0   # verify engines built before masks or edits: decode without drafting
        seq = Sequence(request_id or f"req-{next(self._ids)}", req.ids, params, self._detokenizer(params),
                       self.page_size, speculative, k, req.k_fixed)
        seq.rules = self._rules(seq)
        self.scheduler.add(seq)
        return seq

    def _detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer:
        pieces = self.token_bytes
        if not params.skip_special_tokens and pieces is not None:
            if self._token_bytes_with_special is None:
                self._token_bytes_with_special = byte_pieces(self.tokenizer, self.desc.vocab_size,
                                                             skip_special_tokens=False)
            pieces = self._token_bytes_with_special
        return IncrementalDetokenizer(self.tokenizer, params.stop, pieces, params.skip_special_tokens,
                                      params.spaces_between_special_tokens)

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix (vLLM's reset_prefix_cache): their pages and snapshot rows go back."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def pages_held(self) -> dict[str, int]:
        """KV pages in use per page group, under the group's block-table name (`block_tables`,
        `block_tables.window8`), every running sequence together."""
        return {contract.block_tables(w): n for w, n in self.scheduler.pages_in_use().items()}

    def stats(self) -> LLMStats:
        """The moment's load and the counters so far (pipeline/outputs.py LLMStats). Safe to call off the
        serve-loop thread: list lengths and counters, accurate to within the step in progress."""
        lists = self.page_groups.lists.values()
        cache = self.prefix_cache
        return LLMStats(running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                        kv_pages_free=sum(fl.available for fl in lists),
                        kv_pages_total=sum(fl.size - 1 for fl in lists),     # (each list's scratch page)
                        pages_held=self.pages_held(),
                        acceptance_per_position=self.round_loop.stats.acceptance_per_position(),
                        prefix_caching=cache is not None, prefix_cache_queries=cache.stats.queries if cache else 0,
                        prefix_cache_hits=cache.stats.hits if cache else 0,
                        prefix_cache_entries=len(cache.entries) if cache else 0)

    def reset_stats(self, trace: bool = False) -> None:
        """The counters from zero (the round loop's and the engine time per graph), to time one run
        (`tandem profile`); `trace`: also record each phase as (name, start, end) until the next reset."""
        self.round_loop.stats = RoundStats()
        self.runner.seconds.clear()
        self.round_loop.trace = [] if trace else None

    def run_stats(self) -> tuple[RoundStats, dict[str, float], list[tuple[str, float, float]]]:
        """Since the last reset: the round loop's counters, engine seconds per graph kind, the trace."""
        return self.round_loop.stats, dict(self.runner.seconds), list(self.round_loop.trace or [])

    def abort(self, request_id: str) -> None:
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            self.round_loop.forget(seq)

    def step(self) -> list[StepOutput]:
        return self.round_loop.step()

    def latency_cases(self, batch: int, context: int) -> list[tuple[GraphKind, int, Callable[[], object]]]:
        """(graph, rows per sequence, call) for every engine call a round at `batch` makes, on
        scratch inputs at `context` (pipeline/scratch_calls.py): what `tandem profile` times."""
        return latency_cases(self, batch, context)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def abort_all(self) -> list[str]:
        """Abort every request, running or queued; their ids."""
        ids = [seq.request_id for seq in list(self.scheduler.running) + list(self.scheduler.waiting)]
        for request_id in ids:
            self.abort(request_id)
        return ids

    def isolate_failure(self) -> Isolation:
        """After `step()` raised: run each request that was running alone to find the one(s) that
        make rounds raise; those are aborted and returned with their errors, the others requeued
        in their places (pipeline/failure_isolation.py)."""
        return isolate_failure(self)

    def interrupt_bursts_when(self, check: Callable[[], bool] | None) -> None:
        """A decode burst ends after its current call once `check()` is true (the server: a request or
        an abort is queued), so new work waits about one target step, not a burst's budget. None: off."""
        if isinstance(self.round_loop.decode, DecodeBurst):
            self.round_loop.decode.interrupt = check

    # ---- offline API -------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[GenerationResult]:
        """Every prompt is checked before any is queued; if a step raises, this call's requests
        are aborted (pages and slots freed) before the error propagates, so the next call works."""
        single = isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], (int, np.integer)))
        prompts = [prompts] if single else list(prompts)
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} SamplingParams: pass one per prompt")
        for i, (p, sp) in enumerate(zip(prompts, params_list)):
            try:
                self.check_request(p, sp)
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}" if len(prompts) > 1 else str(e)) from None
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        texts = {s.request_id: [] for s in seqs}
        with self._aborting_on_error(seqs):
            while any(s.finish_reason is None for s in seqs):
                for out in self.step():
                    if out.request_id in texts:
                        texts[out.request_id].append(out.text)
        return [GenerationResult(s.request_id, s.prompt, s.output_ids(), "".join(texts[s.request_id]),
                                 s.finish_reason, s.metrics, s.logprobs, s.prompt_logprobs) for s in seqs]

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[StepOutput]:
        """Yields this request's outputs as they come (other requests keep running alongside).
        Closing the iterator early, or a step that raises, aborts the request."""
        seq = self.add_request(prompt, params)
        with self._aborting_on_error([seq]):
            while seq.finish_reason is None:
                for out in self.step():
                    if out.request_id == seq.request_id:
                        yield out

    @contextlib.contextmanager
    def _aborting_on_error(self, seqs: list[Sequence]):
        """If the body raises (or a stream is closed early), abort these requests' unfinished sequences."""
        try:
            yield
        except BaseException:
            for s in seqs:
                if s.finish_reason is None:
                    self.abort(s.request_id)
            raise

def _load_tokenizer(path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises plain Exception, without the path
        what = "is missing" if not path.exists() else f"cannot be loaded ({e})"
        raise ManifestError(f"{path} {what}; rebuild the engine directory with "
                            f"`tandem build-engines MODEL_DIR --out {path.parent}`") from e

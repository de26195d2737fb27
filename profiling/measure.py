"""What `tandem profile` measures: engine latency per bucket, generation runs with speculative
decoding off and on per batch size, free and under a JSON schema, and a Chrome trace of a few
rounds."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from tandem.pipeline.grammar import GrammarSpec
from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.sampling_params import SamplingParams

DEFAULT_PROMPTS = Path(__file__).with_name("prompts.jsonl")


def records_schema(max_tokens: int) -> dict:
    """The constrained runs' schema: an array of at least max_tokens records (each takes several
    tokens), which cannot close within the budget, so every sequence decodes all of it under the
    grammar, as the free runs do (a complete grammar with ignore_eos frees the tokens after it)."""
    return {"type": "array", "minItems": max_tokens, "items": {
        "type": "object", "additionalProperties": False, "required": ["id", "name", "tags"], "properties": {
            "id": {"type": "integer"}, "name": {"type": "string", "maxLength": 16},
            "tags": {"type": "array", "items": {"enum": ["new", "old", "core"]}, "maxItems": 2}}}}


def load_prompts(path: str | Path | None) -> list[dict]:
    """JSONL of {"category": ..., "prompt": ...} (category optional)."""
    out = []
    for n, line in enumerate(Path(path or DEFAULT_PROMPTS).read_text().splitlines(), 1):
        if line.strip():
            try:
                item = json.loads(line)
                out.append({"category": item.get("category", "default"), "prompt": item["prompt"]})
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: each line must be a JSON object with a 'prompt' ({e})") from e
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def device() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"kind": "cpu", "name": cpu, "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version()}


def time_calls(fn, warmup: int, runs: int) -> dict:
    """Median and p90 of fn() in ms after `warmup` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1e3)
    return {"median_ms": round(float(np.median(samples)), 4), "p90_ms": round(float(np.percentile(samples, 90)), 4)}


def bucket_latencies(llm: LLM, batch_sizes: list[int], context: int, warmup: int = 2, runs: int = 8,
                     progress=None) -> list[dict]:
    """Median / p90 per engine call at each (graph, batch, rows) the rounds use, on scratch inputs
    (LLM.latency_cases): the timing is real, the values are not used."""
    out = []
    for b in batch_sizes:
        cases = llm.latency_cases(b, context)
        for graph, w, fn in cases:
            out.append({"graph": graph.name, "batch": b, "rows": w, **time_calls(fn, warmup, runs)})
            if progress:
                progress.step(f"{graph} b{b} w{w}")
    return out


def generation_run(engine_dir: Path, prompts: list[dict], batch: int, spec: bool, max_tokens: int,
                   synthetic_acceptance: float | None, spec_k: int | None, trace: bool = False,
                   constrained: bool = False) -> dict:
    """Every prompt of the set, at most `batch` running at once; greedy, max_tokens each.
    Speculative runs draft spec_k tokens every round, so each draft position is measured.
    `constrained`: every request under records_schema (rounds under a grammar, plain steps with masks)."""
    config = RuntimeConfig(speculative=spec, synthetic_acceptance=synthetic_acceptance if spec else None,
                          spec_k=spec_k if spec else None, max_num_seqs=batch)
    llm = LLM(engine_dir, config)
    chosen = prompts
    grammar = GrammarSpec.json_schema(records_schema(max_tokens)) if constrained else None
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, grammar=grammar)
    llm.generate([chosen[0]["prompt"]], SamplingParams(max_tokens=4, ignore_eos=True, grammar=grammar))  # warm-up
    llm.reset_stats(trace=trace)
    start = time.perf_counter()
    seqs = [llm.add_request(p["prompt"], params) for p in chosen]
    while any(s.finish_reason is None for s in seqs):
        llm.step()
    end = time.perf_counter()
    st, engine_seconds, events = llm.run_stats()
    per_category: dict[str, dict] = {}
    for p, s in zip(chosen, seqs):
        c = per_category.setdefault(p["category"], {"drafted": 0, "accepted": 0, "predicted": 0})
        c["drafted"] += s.metrics.drafted
        c["accepted"] += s.metrics.accepted
        c["predicted"] += s.num_generated
    for c in per_category.values():
        c["rate"] = round(c["accepted"] / c["drafted"], 4) if c["drafted"] else None
    result = {
        "batch": batch, "mode": "on" if spec else "off", "constrained": constrained,
        "tokens_per_s": round(sum(s.num_generated for s in seqs) / (end - start), 3),   # whole requests
        # decode only: tokens after each request's first (which prefill makes) over decode-round time
        "decode_tokens_per_s": round((sum(s.num_generated for s in seqs) - len(seqs))
                                     / max(st.round_seconds - st.phase_seconds.get("prefill", 0.0), 1e-9), 3),
        # a decode round, prefill work excluded (new requests join mid-run and prefill in the same steps)
        "rounds": st.rounds, "round_ms": round((st.round_seconds - st.phase_seconds.get("prefill", 0.0))
                                               / st.rounds * 1e3, 4) if st.rounds else None,
        "host_share": round(st.host_share, 4), "accept_length": round(st.accept_length, 4),
        "acceptance_per_position": [round(x, 4) for x in st.acceptance_per_position()],
        "phases_ms_per_round": {k: round(v / st.rounds * 1e3, 4) for k, v in st.phase_seconds.items()}
        if st.rounds else {},
        "engine_ms_per_round": {k: round(v / st.rounds * 1e3, 4) for k, v in engine_seconds.items()}
        if st.rounds else {},
        "per_category": per_category,
        "aggregate": {"n_requests": len(seqs), "total_predicted": sum(s.num_generated for s in seqs),
                      "total_draft": st.drafted, "total_draft_accepted": st.accepted,
                      "aggregate_accept_rate": round(st.accepted / st.drafted, 4) if st.drafted else 0.0,
                      "wall_s_total": round(end - start, 3)},
        "mtp_mode": llm.mtp_mode, "synthetic_acceptance": synthetic_acceptance if spec else None,
    }
    if events:
        t0 = events[0][1]
        result["trace"] = [{"name": name, "ph": "X", "pid": 1, "tid": 1, "ts": round((a - t0) * 1e6, 1),
                            "dur": round((b - a) * 1e6, 1)} for name, a, b in events[:200]]
    return result

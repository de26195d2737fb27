"""Structured outputs under speculative decoding: tokens/s and accept length with and without a JSON
schema, speculation on and off, and the share of a run the host's grammar work takes.

    .venv/bin/python bench/structured_outputs.py ENGINE_DIR [--batch 1 8] [--tokens 64] [--passes 3] [--adaptive]

For each batch size, `batch` code prompts (the shipped model's kind of text) are generated with
max_tokens `--tokens`, greedy, in four setups: no schema / a nested JSON schema, speculation off /
on. The setups run round robin, `--passes` times each, in one process (a noisy machine moves all
of them alike); medians are printed, and each pass's on / off ratio (with `--adaptive` the first
requests of a process pay for measuring their rounds). Accept length is tokens committed per verify
round; "grammar" is the host's mask work (the engine's `grammar` phase: draft masks, forced drafts,
the heads' masks) as a share of the run's wall time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ helpers
from bench.common import accept_length, interleaved, machine, medians  # noqa: E402
from tandem.pipeline.grammar import GrammarSpec  # noqa: E402
from tandem.pipeline.llm import LLM, RuntimeConfig  # noqa: E402
from tandem.pipeline.sampling_params import SamplingParams  # noqa: E402

PROMPTS = ["def fibonacci(n):\n    ", "import os\n\n\ndef list_files(root):\n    ", "class Stack:\n    def ",
           "# parse the config\nimport json\n", "def add(a, b):\n    ", "for i in range(10):\n    ",
           "def main():\n    args = ", "with open(path) as f:\n    "]
NESTED = {"type": "object", "additionalProperties": False, "required": ["user", "kind", "score"], "properties": {
    "user": {"type": "object", "additionalProperties": False, "required": ["id", "tags"], "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}}},
    "kind": {"enum": ["add", "remove", "list"]},
    "score": {"type": "integer", "minimum": -5, "maximum": 5}}}


def run_once(llm: LLM, batch: int, tokens: int, schema: bool, speculative: bool) -> tuple[float, float, float]:
    """(tokens/s, accept length, grammar share of the wall time) of one batch."""
    grammar = GrammarSpec.json_schema(NESTED) if schema else None
    params = SamplingParams(max_tokens=tokens, speculative=speculative, grammar=grammar)
    before = llm.round_loop.stats.phase_seconds.get("grammar", 0.0)
    t = time.perf_counter()
    out = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(batch)], params)
    wall = time.perf_counter() - t
    generated, grammar = sum(len(o.token_ids) for o in out), llm.round_loop.stats.phase_seconds.get("grammar", 0.0)
    return generated / wall, accept_length(out), (grammar - before) / wall


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine_dir")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--adaptive", action="store_true",
                        help="the engine's default width policy (without it: every round drafts k, forced)")
    args = parser.parse_args(argv)
    llm = LLM(args.engine_dir, RuntimeConfig(adaptive_width=args.adaptive))
    print(f"{machine()}; {args.engine_dir}; {args.tokens} tokens, medians of {args.passes} round-robin passes")
    print("batch | schema | speculation | tokens/s | accept length | grammar share")
    rows = []
    for batch in args.batch:
        setups = [(schema, spec) for schema in (False, True) for spec in (False, True)]
        run_once(llm, batch, 8, True, True)   # warm: sessions open, grammar compiled
        got = interleaved({(schema, spec): lambda _, batch=batch, schema=schema, spec=spec: run_once(
            llm, batch, args.tokens, schema, spec) for schema, spec in setups}, args.passes)
        for (schema, spec), runs in got.items():
            tps, acc, share = medians(runs, 0, 1, 2)
            rows.append({"batch": batch, "schema": "nested" if schema else "none", "speculation": spec,
                         "tokens_per_s": tps, "accept_length": acc, "grammar_share": share})
            print(f"{batch} | {'nested' if schema else 'none'} | {'on' if spec else 'off'} | {tps:.1f} | "
                  f"{acc:.2f} | {share:.1%}")
        # the adaptive width measures a process's first requests' rounds before it judges them: per pass
        for schema in (False, True):
            name = "nested" if schema else "none"
            ratios = [on[0] / off[0] for on, off in zip(got[schema, True], got[schema, False])]
            next(r for r in rows if (r["batch"], r["schema"], r["speculation"]) == (batch, name, True)
                 )["on_off_per_pass"] = ratios
            print(f"  batch {batch}, {name}: on / off per pass " + " ".join(f"{r:.2f}" for r in ratios))
    return {"tokens": args.tokens, "passes": args.passes, "rows": rows}


if __name__ == "__main__":
    main()

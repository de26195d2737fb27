"""Multi-turn chat with and without the prefix cache: time to first token per turn, the share of
the resent history the cache restored, and decode speed, in one process on the same engine dir.

    .venv/bin/python bench/prefix_cache.py ENGINE_DIR [--turns 10] [--tokens 48] [--chats 3]

Each chat sends `--turns` user messages; every turn's prompt is the whole conversation so far (the
chat template over every message, the model's answers included), greedy, `--tokens` tokens an
answer. The same chats run on two LLMs over the engine dir, prefix cache on and off, alternating chat
by chat (a noisy machine moves both alike). Per turn: median time to first token of each, their
ratio, and the hit rate: tokens restored over the tokens of the previous turn's prompt and answer
(what a turn resends). Last: decode tokens/s after the first token, on against off.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ helpers
from bench.common import interleaved, machine, wait_for_engines  # noqa: E402
from bench.report import print_ratios  # noqa: E402
from tandem.pipeline.llm import LLM, RuntimeConfig  # noqa: E402
from tandem.pipeline.sampling_params import SamplingParams  # noqa: E402
from tandem.server.chat_template import ChatTemplate  # noqa: E402

QUESTIONS = ["Write a function that adds two numbers.", "Now make it handle lists of numbers.", "Add type hints.",
             "Write a unit test for it.", "Turn it into a class with a method.", "Add a docstring to the class.",
             "Handle None inputs.", "Log every call.", "Make the method async.", "Summarize what the code does.",
             "Rename the class to Adder.", "Add a subtract method."]


def chat(llm: LLM, template: ChatTemplate, turns: int, tokens: int, opening: str) -> list[dict]:
    """One chat: per turn its time to first token, prompt length, restored tokens, resent tokens,
    decode seconds and tokens after the first."""
    messages, out, resent = [{"role": "system", "content": opening}], [], 0
    for turn in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        start = time.perf_counter()
        seq = llm.add_request(template.render(messages), SamplingParams(max_tokens=tokens))
        while seq.num_generated == 0 and seq.finish_reason is None:
            llm.step()
        first = time.perf_counter()
        generated = seq.num_generated
        while seq.finish_reason is None:
            llm.step()
        out.append({"ttft": first - start, "prompt": len(seq.prompt), "cached": seq.cached_tokens, "resent": resent,
                    "decode_s": time.perf_counter() - first, "decoded": seq.num_generated - generated})
        resent = len(seq.prompt) + seq.num_generated
        messages.append({"role": "assistant", "content": llm.tokenizer.decode(seq.output_ids())})
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine_dir")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--chats", type=int, default=3)
    parser.add_argument("--plain", action="store_true", help="no drafting (both LLMs)")
    args = parser.parse_args(argv)
    llms = {on: LLM(args.engine_dir, RuntimeConfig(prefix_cache=on, speculative=not args.plain))
            for on in (True, False)}
    for llm in llms.values():
        wait_for_engines(llm)
    template = ChatTemplate.from_engine_dir(args.engine_dir)

    def one_chat(on: bool, c: int) -> list[dict]:
        if c < 0:           # the warm-up
            return chat(llms[on], template, 2, 4, "warm-up")
        return chat(llms[on], template, args.turns, args.tokens, f"You are assistant number {c}.")

    # chat by chat, on and off alternating which goes first
    runs = interleaved({True: partial(one_chat, True), False: partial(one_chat, False)}, args.chats, warmup=1,
                       alternate=True)
    print(f"{machine()}; {args.engine_dir}; {args.chats} chats x {args.turns} turns, {args.tokens} tokens an answer")
    print("turn | prompt tokens | TTFT on ms | TTFT off ms | on / off | restored / resent")
    turns = []
    for t in range(args.turns):
        on = [r[t] for r in runs[True]]
        off = [r[t] for r in runs[False]]
        ttft_on, ttft_off = (statistics.median(x["ttft"] for x in side) * 1000 for side in (on, off))
        rate = sum(x["cached"] for x in on) / max(1, sum(x["resent"] for x in on)) if t else None
        turns.append({"turn": t + 1, "prompt_tokens": on[0]["prompt"], "ttft_on_ms": ttft_on, "ttft_off_ms": ttft_off,
                      "on_over_off": ttft_on / ttft_off, "restored_over_resent": rate})
        print(f"{t + 1} | {on[0]['prompt']} | {ttft_on:.1f} | {ttft_off:.1f} | {ttft_on / ttft_off:.2f}x | "
              + (f"{rate:.2f}" if t else "-"))
    later = [x for r in runs[True] for x in r[1:]]
    restored, resent = sum(x["cached"] for x in later), sum(x["resent"] for x in later)
    print(f"turns 2-{args.turns}: restored {restored} of {resent} resent tokens ({restored / max(1, resent):.2f})")
    speed = {k: sum(x["decoded"] for r in v for x in r) / sum(x["decode_s"] for r in v for x in r)
             for k, v in runs.items()}
    print("decode tokens/s, prefix cache on and off:")
    print_ratios({"on": speed[True], "off": speed[False]}, "off")
    return {"chats": args.chats, "turns": turns, "restored": restored, "resent": resent,
            "decode_tokens_per_s": {"on": speed[True], "off": speed[False]}}


if __name__ == "__main__":
    main()

"""tandem's decoding against onnxruntime-genai's and llama.cpp's on one checkpoint, alternated.

    .venv/bin/python bench/versus.py CKPT --tandem DIR [DIR ...] --other-python PY --llama-cpp SRC
        [--work DIR] [--formats f32 q8_0 q4_0 genai-fp32 genai-int4] [--batch 1 8] [--tokens 128]
        [--prompt-len 32] [--text FILE ...] [--rounds 3] [--threads N] [--spec] [--json OUT.json]

What a CPU user would pick instead of tandem, on the same checkpoint and machine, in one run:
- onnxruntime-genai (its model builder's fp32 or int4 CPU model, `genai-fp32` / `genai-int4`),
- llama.cpp through llama-cpp-python (a GGUF from llama.cpp's own converter: `f32`, `f16`,
  `q8_0`; `q4_0` quantized from the f32 GGUF by llama.cpp).
`--other-python` is an interpreter with onnxruntime-genai, llama-cpp-python, torch and transformers
(not tandem's venv: the runtime path of tandem must not import torch); `--llama-cpp` a llama.cpp
source tree (llama-cpp-python's sdist has one in vendor/llama.cpp) for its converter. The models are
made once into `--work` and reused. Setting the other interpreter up (llama.cpp compiles, ~15 min on
2 cores):

    python3 -m venv /tmp/other && /tmp/other/bin/pip install torch==2.13.0 && /tmp/other/bin/pip install \
        onnxruntime-genai onnx-ir llama-cpp-python gguf transformers onnx    # (onnx-ir: genai's builder)
    /tmp/other/bin/pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/sdist  # its vendor/llama.cpp

On an Intel CPU whose AMX the VM does not enable (the sandbox's Xeon), llama.cpp's AMX path dies
of an illegal instruction on Q8_0 / Q4_0 weights: build it with CMAKE_ARGS="-DGGML_NATIVE=OFF
-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX2=ON -DGGML_FMA=ON
-DGGML_F16C=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF".

Each runtime runs in a worker process of its own (`--worker`), loaded once; per batch size every
worker decodes a warm-up, then the workers take turns, one generation each per round (`--batch`
prompts of `--prompt-len` tokens, random ids or windows of `--text` files, `--tokens` greedy tokens
each, end-of-sequence ignored).
The figure is decode tokens/s (prefill and the first token excluded: the tokens after the first
over the time from the last first token to the last finish), the median of the rounds, and its
ratio to the first tandem dir's plain decoding. Greedy tokens of the same weights should agree;
the table gives each runtime's mean agreement with tandem's (common prefix / tokens), so a runtime
that decodes another model shows. Random-weight checkpoints have near-tied logits, and int8 / int4
formats round differently in each runtime: there agreement is low by nature.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

_HERE = Path(__file__).resolve()
# llama.cpp's converter refuses a BPE pre-tokenizer it has no hash for (the test checkpoints' own
# tokenizers); decoding token ids needs none of it, so the converter runs with Qwen2's
_CONVERT = """import runpy, sys
src = sys.argv.pop(1)
sys.path[:0] = [src, src + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv[0] = src + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""
# The other runtimes' converters take Qwen3.5 as the Hub ships it (Qwen3_5ForConditionalGeneration) and
# one MTP layer at most (llama.cpp); their plain decoding needs none. Both convert a rewrap: the text
# weights under model.language_model, no MTP layers, a one-block vision tower the decode never runs.
_REWRAP = """import sys, torch, transformers as T
src, out = sys.argv[1:3]
config = T.AutoConfig.from_pretrained(src)
if config.architectures[0] == "Qwen3_5ForConditionalGeneration":
    config.text_config.mtp_num_hidden_layers = 0
    model = T.Qwen3_5ForConditionalGeneration.from_pretrained(src, config=config, dtype=torch.float32)
else:
    lm = T.Qwen3_5ForCausalLM.from_pretrained(src, dtype=torch.float32)
    text = dict(lm.config.to_dict(), mtp_num_hidden_layers=0)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"])
    model = T.Qwen3_5ForConditionalGeneration(T.Qwen3_5Config(
        text_config=text, vision_config=vision, tie_word_embeddings=lm.config.tie_word_embeddings))
    state = {"model.language_model." + k[6:] if k.startswith("model.") else k: v for k, v in lm.state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any(not k.startswith("model.visual") for k in missing):
        sys.exit(f"rewrap: unexpected {unexpected}, missing {missing}")
# the sections of multimodal RoPE must cover the rotated pairs (onnxruntime-genai checks it; llama.cpp takes
# [11, 11, 10] where a config has none, more than a small head rotates); a text token's three positions
# are equal, so any split of the pairs is plain RoPE
rope = model.config.text_config.rope_parameters
pairs = int(model.config.text_config.head_dim * rope.get("partial_rotary_factor", 1.0)) // 2
if sum(rope.get("mrope_section", [])) != pairs:
    rope["mrope_section"] = [pairs - 2 * (pairs // 3), pairs // 3, pairs // 3]
model.save_pretrained(out)
T.AutoTokenizer.from_pretrained(src).save_pretrained(out)
"""
_QUANTIZE = """import sys, llama_cpp as L
p = L.llama_model_quantize_default_params()
p.ftype = getattr(L, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3].upper())
if L.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p) != 0:
    sys.exit("llama_model_quantize failed")
"""


def _run(cmd: list[str], what: str, log: Path) -> None:
    with log.open("w") as out:
        if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
            raise SystemExit(f"{what} failed; its output is in {log}")


def rewrapped(ckpt: Path, work: Path, python: str) -> Path:
    """The checkpoint as the other runtimes' converters take it (_REWRAP), made once."""
    out = work / "checkpoint-plain"
    if not (out / "config.json").exists():
        _run([python, "-c", _REWRAP, str(ckpt), str(out)], "the rewrap for the other runtimes", work / "rewrap.log")
    return out


def prepare(fmt: str, ckpt: Path, work: Path, python: str, llama_src: Path) -> tuple[str, Path]:
    """(worker kind, model path) of one format, made into `work` unless it is there; `ckpt` rewrapped."""
    if fmt.startswith("genai-"):
        out = work / fmt
        if not (out / "genai_config.json").exists():
            _run([python, "-m", "onnxruntime_genai.models.builder", "-i", str(ckpt), "-o", str(out),
                  "-p", fmt.removeprefix("genai-"), "-e", "cpu", "-c", str(work / "genai-cache"),
                  "--extra_options", "exclude_mtp=true"],     # plain decoding (its MTP generator: batch 1 only)
                 f"onnxruntime-genai's builder ({fmt})", work / f"{fmt}.log")
        return "genai", out
    gguf = work / f"model-{fmt}.gguf"
    if not gguf.exists():
        if fmt == "q4_0":       # the converter writes no q4_0: llama.cpp quantizes its f32 file
            source = prepare("f32", ckpt, work, python, llama_src)[1]
            _run([python, "-c", _QUANTIZE, str(source), str(gguf), fmt], "llama.cpp's quantize", work / f"{fmt}.log")
        else:
            _run([python, "-c", _CONVERT, str(llama_src), str(ckpt), "--outtype", fmt, "--outfile", str(gguf),
                  "--no-mtp"],
                 f"llama.cpp's converter ({fmt})", work / f"{fmt}.log")
    return "llama.cpp", gguf


# ---- workers: one runtime each, a generation per request line --------------------------------------
def _tandem(path: str, threads: int | None, batch: int, spec: bool):
    from tandem.pipeline.llm import LLM, RuntimeConfig
    from tandem.pipeline.sampling_params import SamplingParams

    llm = LLM(path, RuntimeConfig(speculative=spec, threads=threads, max_num_seqs=max(batch, 8)))

    def generate(prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
        results = llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
        first = max(r.metrics.first_token for r in results)
        last = max(r.metrics.finished for r in results)
        return last - first, [list(r.token_ids) for r in results]
    return generate


def _genai(path: str, threads: int | None, batch: int, spec: bool):
    import onnxruntime_genai as og

    config = og.Config(path)
    config.clear_providers()            # the CPU provider
    if threads:
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    model = og.Model(config)

    def generate(prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
        params = og.GeneratorParams(model)
        length = len(prompts[0]) + tokens
        # min_length: no end at an end-of-sequence token (the others ignore it; here its logit is masked
        # until then, so after one the tokens differ from the others')
        params.set_search_options(do_sample=False, max_length=length, min_length=length, batch_size=len(prompts))
        gen = og.Generator(model, params)
        gen.append_tokens(np.array(prompts, np.int32))      # the prompts' forward pass
        gen.generate_next_token()                           # the first token: from the prompts' logits
        start = time.perf_counter()
        while not gen.is_done():
            gen.generate_next_token()
        elapsed = time.perf_counter() - start
        return elapsed, [gen.get_sequence(b)[len(p):].tolist() for b, p in enumerate(prompts)]
    return generate


def _llama(path: str, threads: int | None, batch: int, spec: bool):
    import os

    import llama_cpp as L

    L.llama_backend_init()
    model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_seq_max = 4096, 4096, batch
    cp.n_threads = cp.n_threads_batch = threads or os.cpu_count()
    ctx = L.llama_init_from_model(model, cp)
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    feed = L.llama_batch_init(4096, 0, batch)

    def decode(rows: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode over (sequence, position, token, wants logits) rows."""
        feed.n_tokens = len(rows)
        for i, (s, pos, token, logits) in enumerate(rows):
            feed.token[i], feed.pos[i], feed.n_seq_id[i], feed.logits[i] = token, pos, 1, logits
            feed.seq_id[i][0] = s
        if L.llama_decode(ctx, feed) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(i: int) -> int:
        return int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), (vocab,)).argmax())

    def generate(prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        decode([(s, pos, t, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, t in enumerate(p)])
        out = [[argmax(s * len(p) + len(p) - 1)] for s, p in enumerate(prompts)]
        start = time.perf_counter()
        for step in range(1, tokens):
            decode([(s, len(p) + step - 1, out[s][-1], True) for s, p in enumerate(prompts)])
            for s in range(len(prompts)):
                out[s].append(argmax(s))
        return time.perf_counter() - start, out
    return generate


WORKERS = {"tandem": _tandem, "genai": _genai, "llama.cpp": _llama}


def worker(kind: str, path: str, threads: int | None, batch: int, spec: bool) -> None:
    """Load the runtime, say "ready", then one generation per request line ({"prompts", "tokens"}):
    a line {"seconds", "tokens"} back."""
    import os

    answers = os.fdopen(os.dup(1), "w")     # the replies' own descriptor: native code's prints go to stderr
    os.dup2(2, 1)
    generate = WORKERS[kind](path, threads, batch, spec)
    print(json.dumps("ready"), file=answers, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        seconds, tokens = generate(request["prompts"], request["tokens"])
        print(json.dumps({"seconds": seconds, "tokens": tokens}), file=answers, flush=True)


# ---- the parent: workers in turn --------------------------------------------------------------------
class Worker:
    def __init__(self, label: str, python: str, kind: str, path: Path, threads: int | None, batch: int, spec: bool,
                 log: Path):
        self.label, self.log = label, log
        cmd = [python, str(_HERE), "--worker", kind, str(path), "--batch", str(batch)]
        cmd += ["--threads", str(threads)] if threads else []
        cmd += ["--spec"] if spec else []
        with log.open("w") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        self._read()                                    # "ready": loaded

    def _read(self):
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"{self.label}: the worker ended; its output is in {self.log}")
        return json.loads(line)

    def generate(self, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
        """(decode tokens/s, tokens) of one generation."""
        self.proc.stdin.write(json.dumps({"prompts": prompts, "tokens": tokens}) + "\n")
        self.proc.stdin.flush()
        got = self._read()
        return sum(len(row) - 1 for row in got["tokens"]) / got["seconds"], got["tokens"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """Mean over rows of the common prefix's share of the tokens."""
    shares = []
    for a, b in zip(ours, theirs):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        shares.append(same / max(1, len(a)))
    return sum(shares) / len(shares)


def draw_prompts(args, batch: int, vocab: int) -> list[list[int]]:
    """`batch` prompts of `--prompt-len` tokens: random ids, or windows of the `--text` files at random
    offsets, tokenized with the checkpoint's tokenizer (drafts of a trained model's heads are accepted
    on text like what it was trained on, not on random ids)."""
    rng = np.random.default_rng(batch)
    if not args.text:
        return [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(batch)]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(args.checkpoint / "tokenizer.json"))
    ids = [i for f in args.text for i in tok.encode(f.read_text()).ids]
    if len(ids) <= args.prompt_len:
        raise SystemExit(f"--text has {len(ids)} tokens, fewer than a {args.prompt_len}-token prompt")
    return [ids[s : s + args.prompt_len] for s in rng.integers(0, len(ids) - args.prompt_len, batch).tolist()]


def compare(runtimes: list[tuple[str, str, str, Path, bool]], batch: int, args, vocab: int) -> list[dict]:
    from bench.common import interleaved  # (here, not above: a worker runs in an interpreter without tandem)

    prompts = draw_prompts(args, batch, vocab)
    workers = [Worker(label, python, kind, path, args.threads, batch, spec,
                      args.work / f"worker-{i}-batch{batch}.log")
               for i, (label, python, kind, path, spec) in enumerate(runtimes)]
    try:                                                # a warm-up generation each, then the workers in turn
        got = interleaved({w.label: lambda _, w=w: w.generate(prompts, args.tokens) for w in workers}, args.rounds,
                          warmup=1)
    finally:
        for w in workers:
            w.close()
    speeds = {label: [speed for speed, _ in runs] for label, runs in got.items()}
    tokens = {label: runs[-1][1] for label, runs in got.items()}     # the last round's
    base = workers[0].label
    rows = []
    for w in workers:
        median = statistics.median(speeds[w.label])
        rows.append({"batch": batch, "runtime": w.label, "tokens_per_s": median,
                     "vs_tandem": median / statistics.median(speeds[base]),
                     "agreement": agreement(tokens[base], tokens[w.label]), "runs": speeds[w.label]})
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, nargs="?")
    parser.add_argument("--tandem", type=Path, nargs="+", default=[], help="tandem engine dirs of the checkpoint")
    parser.add_argument("--other-python", default=None,
                        help="an interpreter with onnxruntime-genai, llama-cpp-python, torch, transformers")
    parser.add_argument("--llama-cpp", type=Path, default=None, help="a llama.cpp source tree (its converter)")
    parser.add_argument("--work", type=Path, default=Path("versus-work"), help="where the other models are made")
    parser.add_argument("--formats", nargs="*", default=["f32", "genai-fp32"],
                        help="f32 f16 q8_0 q4_0 (llama.cpp), genai-fp32 genai-int4 (onnxruntime-genai)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--text", type=Path, nargs="*", default=[],
                        help="prompts drawn from these files (default: random token ids)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="every runtime's threads (default: its own)")
    parser.add_argument("--spec", action="store_true", help="tandem's dirs speculative too (as served)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker[0], args.worker[1], args.threads, args.batch[0], args.spec)
        return {}
    if args.checkpoint is None or not args.tandem:
        parser.error("give the checkpoint and --tandem DIR (an engine dir built from it)")
    if args.formats and (args.other_python is None or (args.llama_cpp is None and any(
            not f.startswith("genai-") for f in args.formats))):
        parser.error("the other runtimes need --other-python (and --llama-cpp for GGUF formats); "
                     "or pass --formats with nothing to run tandem alone")
    args.work.mkdir(parents=True, exist_ok=True)
    runtimes = []
    for d in args.tandem:
        runtimes.append((f"tandem {d.name}", sys.executable, "tandem", d, False))
        if args.spec:
            runtimes.append((f"tandem {d.name} (speculative)", sys.executable, "tandem", d, True))
    for fmt in args.formats:
        kind, path = prepare(fmt, rewrapped(args.checkpoint, args.work, args.other_python), args.work,
                             args.other_python, args.llama_cpp)
        runtimes.append((f"{kind} {fmt}", args.other_python, kind, path, False))
    config = json.loads((args.checkpoint / "config.json").read_text())
    vocab = config.get("text_config", config)["vocab_size"]
    from bench.common import machine
    from bench.report import print_ratios, write_json
    source = f"prompts from {', '.join(f.name for f in args.text)}" if args.text else "random prompts"
    print(f"{machine()}; {args.checkpoint}, {args.tokens} greedy tokens after a {args.prompt_len}-token prompt "
          f"({source}), "
          f"{args.rounds} rounds alternated")
    report = []
    for batch in args.batch:
        rows = compare(runtimes, batch, args, vocab)
        report += rows
        print_ratios({row["runtime"]: row["tokens_per_s"] for row in rows}, rows[0]["runtime"], against="tandem",
                     width=36, indent=f"  batch {batch}  ",
                     extra={row["runtime"]: f"tokens agree {row['agreement']:4.0%}  "
                            f"(runs {', '.join(f'{r:.0f}' for r in row['runs'])})" for row in rows})
    if args.json:
        write_json(args.json, report)
    return {"rows": report}


if __name__ == "__main__":
    sys.path.insert(0, str(_HERE.parents[1]))      # bench.common
    main()

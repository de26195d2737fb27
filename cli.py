"""The `tandem` command line. Each subcommand is one function taking parsed args and
returning an exit code; later stages add build-engines, generate, serve and profile."""

from __future__ import annotations

import argparse
import json
import sys

from tandem.checkpoint.validation import MAX_SPEC_K, MIN_SPEC_K


def cmd_inspect(args: argparse.Namespace) -> int:
    from tandem.checkpoint import CheckpointError, open_checkpoint
    from tandem.checkpoint.summary import format_summary, summarize

    speculative = not args.no_mtp
    try:
        ckpt = open_checkpoint(args.model_dir, speculative=speculative, spec_k=args.spec_k, draft=args.draft)
    except CheckpointError as e:
        if args.json:
            print(json.dumps({"path": args.model_dir, "verdict": "refused", "problems": e.problems}, indent=2))
        else:
            print(f"{args.model_dir}: REFUSED", file=sys.stderr)
            for p in e.problems:
                print(f"  - {p}", file=sys.stderr)
        return 1
    summary = summarize(ckpt, args.spec_k if speculative else None)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from tandem.checkpoint import CheckpointError, open_checkpoint
    from tandem.engines.options import BuildOptions
    from tandem.export.exporter import EXPORT_DTYPES, export_checkpoint

    if args.dtype not in EXPORT_DTYPES:
        print(f"error: --dtype {args.dtype}: use one of {', '.join(EXPORT_DTYPES)}", file=sys.stderr)
        return 2
    try:
        ckpt = open_checkpoint(args.model_dir, speculative=not args.no_mtp, draft=args.draft)
    except CheckpointError as e:
        return _refused(args.model_dir, e.problems)
    build = BuildOptions(dtype=args.dtype, draft_weights=args.draft_weights)
    result = export_checkpoint(ckpt, args.out, build.export_options(ckpt.draft_parameter_count()))
    print(f"exported {', '.join(result.graphs.values())} + weights.bin ({result.weights_bytes:,} bytes) "
          f"to {result.folder} in {result.seconds:.2f} s")
    return 0


def cmd_build_engines(args: argparse.Namespace) -> int:
    from tandem.checkpoint import CheckpointError
    from tandem.engines.atomic import OutputError
    from tandem.engines.backends.common import BackendUnavailable
    from tandem.engines.builder import BuildError, build_engines
    from tandem.engines.options import BuildOptions, OptionsError, parse_int_list

    try:
        options = BuildOptions(
            backend=args.backend, batch_sizes=parse_int_list(args.batch_sizes, "--batch-sizes"), spec_k=args.spec_k,
            verify_widths=parse_int_list(args.verify_widths, "--verify-widths") if args.verify_widths else None,
            max_seq_len=args.max_seq_len, page_size=args.page_size, prefill_chunk=args.prefill_chunk,
            dtype=args.dtype, weights=args.weights, quant_block=args.quant_block, draft=args.draft,
            no_mtp=args.no_mtp, unified_round=not args.no_unified_round, index_share=args.index_share,
            decode_steps=args.decode_steps,
            draft_weights=args.draft_weights)
        result = build_engines(args.model_dir, args.out, options, show_progress=not args.quiet)
    except CheckpointError as e:
        return _refused(args.model_dir, e.problems)
    except (OptionsError, OutputError, BuildError, BackendUnavailable) as e:
        return _refused("build-engines", [str(e)])
    for line in result.swept:
        print(line)
    if result.status == "up-to-date":
        print(f"{result.engine_dir} is up to date (same input files by content, options and versions): "
              "nothing to rebuild")
    else:
        print(f"built {result.engine_dir}: {len(result.rebuilt)} engine(s) built and verified, "
              f"{len(result.reused)} reused, {result.size_bytes / 2**20:.1f} MiB, {result.seconds:.1f} s")
        print(f"  because: {'; '.join(result.reasons)}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from tandem.engines.manifest import ManifestError
    from tandem.pipeline.llm import LLM, RuntimeConfig
    from tandem.pipeline.sampling_params import SamplingParams

    try:
        llm = LLM(args.engine_dir, RuntimeConfig(mtp_mode=args.mtp_mode, speculative=not args.no_spec))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos, k=args.spec_k)
        # untimed warm-up: the engines' first calls (session set-up, buffer allocation) are not the model's speed
        llm.generate(args.prompt, replace(params, max_tokens=min(params.max_tokens, _WARMUP_TOKENS)))
        seq = None
        for out in llm.stream(args.prompt, params):
            seq = out.sequence
            print(out.text, end="", flush=True)
    except (ManifestError, ValueError) as e:
        return _refused("generate", [str(e)])
    print()
    for line in generation_figures(seq):
        print(line)
    return 0


_WARMUP_TOKENS = 8


def generation_figures(seq) -> list[str]:
    """Prefill (prompt tokens, time to first token), decode (tokens after the first, tokens/s) and,
    when anything was drafted, the accept length; from the engine's own timestamps."""
    m = seq.metrics
    ttft = m.first_token - m.arrival
    lines = [f"[prefill: {len(seq.prompt)} prompt tokens, first token after {ttft * 1000:.1f} ms]"]
    after = seq.num_generated - 1
    if after > 0:
        seconds = m.finished - m.first_token
        lines.append(f"[decode: {after} tokens after the first in {seconds:.3f} s, {after / seconds:.1f} tokens/s]")
    else:
        lines.append("[decode: no tokens after the first]")
    if m.drafted:
        lines.append(f"[speculative: accept length {m.accept_length:.2f} tokens per verify step over {m.rounds} "
                     f"steps, {m.accepted} of {m.drafted} drafts accepted]")
    else:
        lines.append("[speculative: nothing drafted (plain decoding)]")
    lines.append(f"[finish reason: {seq.finish_reason}]")
    return lines


def _untuned_hint(engine_dir) -> str | None:
    """A line for an engine dir with MTP heads that `tandem profile` has not tuned on this machine: its
    widths are the build's defaults, and the adaptive width measures its rounds in the first requests
    (a bucket whose rounds cannot pay learns it there instead of decoding plain from the start)."""
    from tandem.engines.manifest import ManifestError, read_manifest
    from tandem.pipeline.runtime_settings import RUNTIME_SETTINGS

    if (engine_dir / RUNTIME_SETTINGS).exists():
        return None
    try:
        heads = bool(read_manifest(engine_dir).get("runtime", {}).get("verify_width_per_batch"))
    except (ManifestError, OSError):
        return None         # (serve refuses the dir with its own message)
    return (f"{engine_dir} has no {RUNTIME_SETTINGS}: verify widths are the build's defaults and the first requests "
            f"measure the rounds' costs; `tandem profile {engine_dir} --out REPORT` tunes both for this machine "
            "(once per build)") if heads else None


def cmd_serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tandem.engines.manifest import ManifestError
    from tandem.pipeline.llm import RuntimeConfig
    from tandem.server.app import ServerSettings
    from tandem.server.serve import serve

    try:
        settings = ServerSettings(model_name=args.model_name or Path(args.engine_dir).resolve().name,
                                  api_key=args.api_key, max_queued=args.max_queued,
                                  max_body_bytes=args.max_body_bytes, default_max_tokens=args.default_max_tokens,
                                  openapi=args.openapi, stream_interval=args.stream_interval,
                                  allow_extra_fields=args.allow_extra_fields, max_header_bytes=args.max_header_bytes,
                                  header_timeout_s=args.header_timeout)
        config = RuntimeConfig(memory_budget_bytes=int(args.memory_budget_mb * 2**20), mtp_mode=args.mtp_mode,
                              threads=args.threads, prefix_cache=not args.no_prefix_cache, spec_policy=args.spec_policy,
                              verify=not args.no_verify,
                              prefix_snapshot_mb=args.prefix_snapshot_mb)
        if hint := _untuned_hint(Path(args.engine_dir)):
            print(hint, flush=True)
        if args.ray:
            status = _serve_ray(args, settings, config)
        else:
            if ray_only := [f for f in _RAY_FLAGS if getattr(args, f.strip("-").replace("-", "_")) is not None]:
                raise ValueError(f"{', '.join(ray_only)} only apply with --ray")
            print(f"serving {settings.model_name} on http://{args.host}:{args.port}/v1 (OpenAI API)", flush=True)
            status = serve(args.engine_dir, args.host, args.port, settings, config)
    except (ManifestError, ValueError) as e:
        return _refused("serve", [str(e)])
    if status == 1:
        print("serve: the serve-loop thread stopped and could not recover (see the log above); exiting with status 1 "
              "so that a supervisor restarts the server", file=sys.stderr)
    return status


_RAY_FLAGS = ("--replicas", "--min-replicas", "--max-replicas", "--ray-address", "--cpus-per-replica",
              "--target-ongoing-requests")


def _serve_ray(args: argparse.Namespace, settings, config) -> int:
    from tandem.server.serve import serve_ray

    try:
        from tandem.server.ray_app import Scaling
    except ImportError:
        raise ValueError("--ray needs Ray Serve: pip install 'tandem[ray]'") from None
    if args.replicas is not None and args.min_replicas is not None:
        raise ValueError("give --replicas N (fixed) or --min-replicas A --max-replicas B (autoscaling), not both")
    scaling = Scaling(**{k: v for k, v in (("replicas", args.replicas), ("min_replicas", args.min_replicas),
                                           ("max_replicas", args.max_replicas),
                                           ("cpus_per_replica", args.cpus_per_replica),
                                           ("target_ongoing_requests", args.target_ongoing_requests))
                         if v is not None})
    where = args.ray_address or "a local Ray instance"
    count = f"{scaling.min_replicas}..{scaling.max_replicas}" if scaling.autoscaling else str(scaling.replicas)
    print(f"serving {settings.model_name} on http://{args.host}:{args.port}/v1 (OpenAI API) from {count} "
          f"replica(s) on {where}", flush=True)
    return serve_ray(args.engine_dir, args.host, args.port, settings, config, scaling, args.ray_address)


def cmd_profile(args: argparse.Namespace) -> int:
    from tandem.engines.manifest import ManifestError
    from tandem.engines.options import OptionsError, parse_int_list
    from tandem.profiling.report import profile, render

    if args.render:
        render(args.render, f"{args.out}/report.html")
        print(f"rendered {args.out}/report.html from {args.render}")
        return 0
    if not args.engine_dir:
        return _refused("profile", ["give an ENGINE_DIR (or --render report.json)"])
    try:
        batch_sizes = parse_int_list(args.batch_sizes, "--batch-sizes") if args.batch_sizes else None
        report = profile(args.engine_dir, args.out, args.prompts, batch_sizes, args.max_tokens,
                         args.synthetic_acceptance, tune=not args.no_tune, show_progress=not args.quiet)
    except (ManifestError, OptionsError, ValueError) as e:
        return _refused("profile", [str(e)])
    print(f"wrote {args.out}/report.json, report.html, trace.json")
    for row in report["speedup"]:
        print(f"  batch {row['batch']}: speedup {row['measured']:.2f} (bound {row['bound']})")
    for b, t in report.get("tuning", {}).items():
        print(f"  batch {b}: verify width {t['width']} (expected gain {t['gain_over_plain']}x)")
    if "tuning_written_to" in report:
        print(f"tuned widths written to {report['tuning_written_to']}")
    return 0


def _refused(what: str, problems: list[str]) -> int:
    print(f"{what}: REFUSED", file=sys.stderr)
    for p in problems:
        print(f"  - {p}", file=sys.stderr)
    return 1


def _draft_weights_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-weights", default="auto", choices=["auto", "same", "int8"],
                   help="the linear layers the MTP heads draft with (theirs and the lm_head): int8 reads a quarter "
                        "of float32 per draft pass (drafts only propose; the target's own weights decide, so the "
                        "output is the same); auto: int8 for float engines whose draft passes read >= 1M weights, "
                        "else as --weights")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Serve LLMs that carry MTP heads.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="describe and validate a checkpoint folder (reads no weight data)")
    p.add_argument("model_dir", help="local Hugging Face checkpoint folder")
    p.add_argument("--draft", help="folder with the MTP (mtp.*) weights, when they are not in the checkpoint")
    p.add_argument("--spec-k", type=int, default=3,
                   help=f"draft tokens per round, {MIN_SPEC_K}..{MAX_SPEC_K} (default 3)")
    p.add_argument("--no-mtp", action="store_true", help="plain decoding: ignore mtp.* tensors")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("export", help="lower the target, verify step and MTP heads to ONNX graphs")
    p.add_argument("model_dir", help="local Hugging Face checkpoint folder")
    p.add_argument("--out", required=True, help="folder for the .onnx graphs and weights.bin")
    _draft_weights_flag(p)
    p.add_argument("--draft", help="folder with the MTP (mtp.*) weights, when they are not in the checkpoint")
    p.add_argument("--no-mtp", action="store_true", help="export the target graphs only")
    p.add_argument("--dtype", default="float32", help="graph precision: float32 or float16 (as build-engines)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("build-engines", help="build engines per (batch size, verify width) with a manifest")
    p.add_argument("model_dir", help="local Hugging Face checkpoint folder")
    p.add_argument("--out", required=True, help="engine directory to write (replaced atomically)")
    p.add_argument("--backend", default="onnxruntime", choices=["onnxruntime", "tensorrt"])
    p.add_argument("--batch-sizes", default="1,2,4,8", help="comma-separated batch sizes (default 1,2,4,8)")
    p.add_argument("--spec-k", type=int, default=3, help="draft tokens per round; verify width = k+1 (default 3)")
    p.add_argument("--verify-widths", default=None, help="explicit verify widths, e.g. 2,4 (overrides the defaults)")
    p.add_argument("--max-seq-len", type=int, default=4096, help="longest sequence the engines serve")
    p.add_argument("--page-size", type=int, default=16, help="KV page size in tokens (power of two)")
    p.add_argument("--prefill-chunk", type=int, default=64, help="rows per prefill chunk")
    p.add_argument("--dtype", default="float32",
                   help="engine precision: float32 or float16 (weights, activations, K/V and conv pools; "
                        "recurrent states, attention scores and logits stay float32)")
    p.add_argument("--weights", default="float", choices=["float", "bf16", "int8", "int4"],
                   help="linear-layer weights: float (= --dtype); bf16 (rounded to bfloat16, computed in float32: "
                        "half the bytes per token on tandem's CPU kernels, lossless for a bfloat16 checkpoint); or "
                        "weight-only int8 / int4 with one scale per --quant-block input rows")
    p.add_argument("--quant-block", type=int, default=32, help="input rows per quantization scale (default 32)")
    _draft_weights_flag(p)
    p.add_argument("--draft", help="folder with the MTP (mtp.*) weights, when they are not in the checkpoint")
    p.add_argument("--no-mtp", action="store_true", help="plain decoding only: no heads, no verify engines")
    p.add_argument("--no-unified-round", action="store_true",
                   help="leave out the one-call round graphs (rounds then run verify, re-anchor and draft calls)")
    p.add_argument("--index-share", action="store_true",
                   help="sparse-MLA heads (DeepSeek-V3.2 / GLM-5): run the draft's lightning indexer at the first "
                        "draft step of a round only; later steps reuse its top-k (faster rounds, 2-3%% lower accept "
                        "length measured)")
    p.add_argument("--decode-steps", type=int, default=1,
                   help="also build a plain greedy decode graph that makes this many tokens per call (one host "
                        "step per N tokens; pays where the host loop is a large share of a step: small models). "
                        "Default 1: not built")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_build_engines)

    p = sub.add_parser("generate", help="generate text from an engine directory (streams to stdout)",
                       description="Streams a completion, then prints prefill (prompt tokens, time to the first "
                                   "token) and decode (tokens after the first, tokens/s) separately, and the accept "
                                   "length when anything was drafted. The figures leave out the engines' cold first "
                                   f"calls: an untimed warm-up generation (up to {_WARMUP_TOKENS} tokens of the same "
                                   "prompt) runs first.")
    p.add_argument("engine_dir")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--spec-k", type=int, default=None, help="draft tokens per round (default: the engines')")
    p.add_argument("--mtp-mode", choices=["chained", "reused"], default=None,
                   help="chained heads (default with several heads) or one head reused k times")
    p.add_argument("--no-spec", action="store_true", help="plain decoding")
    p.add_argument("--ignore-eos", action="store_true")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server over an engine directory")
    p.add_argument("engine_dir")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--max-queued", type=int, default=64, help="requests in flight before 429 (default 64)")
    p.add_argument("--model-name", default=None, help="the model id clients send (default: the folder name)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--max-header-bytes", type=int, default=64 << 10,
                   help="a request's line and headers at most (default 65536; past it: 431)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds for a request's headers to arrive (default 10; past it: 408)")
    p.add_argument("--default-max-tokens", type=int, default=256)
    p.add_argument("--memory-budget-mb", type=float, default=512, help="KV pages + state slots (MiB)")
    p.add_argument("--mtp-mode", choices=["chained", "reused"], default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-verify", action="store_true",
                   help="check the engine files' sizes only, not their sha256 (default: hashed on first load and "
                        "after a file changed)")
    p.add_argument("--spec-policy", choices=["adaptive", "fixed", "off"], default="adaptive",
                   help="drafting: adaptive (the width per batch size from what rounds gain, default), fixed (the "
                        "engine dir's tuned width every round), off (a request's spec_k is then a 400); a "
                        "request's own spec_k or speculative: false wins over adaptive and fixed")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="recompute every prompt (default: resume from cached prefixes of earlier requests)")
    p.add_argument("--prefix-snapshot-mb", type=float, default=64.0,
                   help="MiB for the prefix cache's recurrent-state snapshots, beside the budget (default 64)")
    p.add_argument("--openapi", action="store_true", help="serve /docs, /redoc and /openapi.json (off by default)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="tokens per streamed event after the first (default 1); more cost less host work per token")
    p.add_argument("--allow-extra-fields", action="store_true",
                   help="accept request fields tandem does not know and ignore them (default: 400 naming the field)")
    ray = p.add_argument_group("Ray Serve (pip install 'tandem[ray]'; docs/ray.md)")
    ray.add_argument("--ray", action="store_true", help="serve from replicas on Ray Serve, each with its own pipeline")
    ray.add_argument("--replicas", type=int, default=None, help="a fixed number of replicas (default 1)")
    ray.add_argument("--min-replicas", type=int, default=None, help="autoscale on requests in flight between min ...")
    ray.add_argument("--max-replicas", type=int, default=None, help="... and max replicas")
    ray.add_argument("--target-ongoing-requests", type=float, default=None,
                     help="requests in flight per replica the autoscaler aims at (default 4)")
    ray.add_argument("--cpus-per-replica", type=float, default=None,
                     help="CPUs Ray reserves per replica; also its ONNX Runtime threads unless --threads (default 1)")
    ray.add_argument("--ray-address", default=None,
                     help="join this cluster (auto, or ray://HOST:10001) instead of starting a local Ray instance")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("profile", help="measure an engine directory on this device; report + tuned widths")
    p.add_argument("engine_dir", nargs="?")
    p.add_argument("--out", required=True, help="folder for report.json, report.html, trace.json")
    p.add_argument("--prompts", default=None, help="JSONL of {\"category\", \"prompt\"} (default: the built-in set)")
    p.add_argument("--batch-sizes", default=None, help="subset of the built batch sizes (default: all)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--synthetic-acceptance", type=float, default=None,
                   help="benchmark aid for random weights: accept drafts with this probability")
    p.add_argument("--no-tune", action="store_true", help="do not write runtime_settings.json")
    p.add_argument("--render", default=None, help="re-render report.html from this report.json and stop")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_profile)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

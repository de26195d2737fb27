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
    from tandem.export.exporter import export_checkpoint

    try:
        ckpt = open_checkpoint(args.model_dir, speculative=not args.no_mtp, draft=args.draft)
    except CheckpointError as e:
        print(f"{args.model_dir}: REFUSED", file=sys.stderr)
        for p in e.problems:
            print(f"  - {p}", file=sys.stderr)
        return 1
    result = export_checkpoint(ckpt, args.out)
    print(f"exported {', '.join(result.graphs.values())} + weights.bin ({result.weights_bytes:,} bytes) "
          f"to {result.folder} in {result.seconds:.2f} s")
    return 0


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
    p.add_argument("--draft", help="folder with the MTP (mtp.*) weights, when they are not in the checkpoint")
    p.add_argument("--no-mtp", action="store_true", help="export the target graphs only")
    p.set_defaults(func=cmd_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

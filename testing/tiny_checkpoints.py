"""Random checkpoints in the exact Hugging Face layouts real models use, small enough for tests.

    write_tiny_checkpoint(tmp / "m", "qwen3_5_mtp1")   # -> folder transformers and tandem load

The kinds are declared by the families, each in its `tiny` module (checkpoint/families/<family>/
tiny.py: `TINY_KINDS`, a `base.TinyKind` each): the config.json as the family's releases write it,
and what they store beyond the tensors the family reads. Stored names and shapes come from the
family's own `sources()`, so the writer and the reader cannot drift apart silently: tests load the
kinds with transformers' classes. This module writes any of them: random tensors with a trained
model's statistics, a byte-level BPE tokenizer with a ChatML chat template, generation_config.json.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import ml_dtypes
import numpy as np

from tandem.checkpoint.families import FAMILIES, FAMILY_MODULES
from tandem.checkpoint.families.base import TinyKind
from tandem.testing.tokenizer_files import SPECIAL_TOKENS, save_tokenizer, train_byte_level_bpe


def _declared_kinds() -> dict[str, TinyKind]:
    kinds: dict[str, TinyKind] = {}
    for module in FAMILY_MODULES.values():
        try:
            tiny = importlib.import_module(module.__name__ + ".tiny")
        except ModuleNotFoundError:
            continue
        kinds.update(tiny.TINY_KINDS)
    return kinds


ALL_KINDS = _declared_kinds()
# the kinds the tests' session fixtures write (tests/conftest.py) and most parity tests run over
TINY_KINDS = ("qwen3_5_mtp1", "qwen3_5_mtp3", "qwen3_5_moe", "qwen3_next")
_TOKENIZER_TEXT = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens and verifies them.",
    "for i in range(10):\n    print(i * i)\n",
    "Multi-token prediction heads propose several tokens; the target model checks them in one pass.",
    "class Cache:\n    def __init__(self):\n        self.pages = []\n",
]


def tiny_config(kind: str, dtype: str = "float32") -> dict:
    """config.json of the tiny (or benchmark) checkpoint `kind`."""
    return ALL_KINDS[kind].config(dtype)


def _init(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random values with the statistics of a trained model, so tests see real signal
    (no near-ties from all-equal logits)."""
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("linear_attn.norm.weight"):  # plain-weight RMSNormGated
        return 1.0 + 0.1 * rng.standard_normal(shape)
    if "norm" in name and leaf in ("weight", "bias"):  # zero-centred RMSNorm, vision LayerNorm
        return 0.1 * rng.standard_normal(shape)
    if leaf == "A_log":
        return np.log(rng.uniform(1.0, 16.0, shape))
    if leaf == "dt_bias":
        return rng.uniform(0.5, 1.5, shape)
    if leaf in ("bias", "router_bias"):
        return 0.02 * rng.standard_normal(shape)
    if "embed_tokens" in name:
        return rng.standard_normal(shape)
    fan_in = int(np.prod(shape[1:])) if len(shape) == 2 or "conv1d" in name else shape[-1]
    return rng.standard_normal(shape) / np.sqrt(fan_in)


def _family_sources(config: dict, per_expert: bool = False) -> dict:
    """The family's canonical -> stored map for this config.json, with every declared MTP layer."""
    arch = config["architectures"][0]
    family = FAMILIES[arch]
    text = family.text_config(config, arch)
    desc = family.describe(config, arch, mtp_layers=text.get(family.mtp_layout(text).count_key, 0),
                           mtp_source="checkpoint")
    return family.sources(desc, per_expert=per_expert)


def stored_shapes(config: dict, per_expert: bool = False) -> dict[str, tuple[int, ...]]:
    """Every stored tensor name -> shape the family reads from a checkpoint with this config.json."""
    shapes: dict[str, tuple[int, ...]] = {}
    for src in _family_sources(config, per_expert).values():
        shapes.update(zip(src.names, src.shapes, strict=True))
    return shapes


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Minimal safetensors writer (any numpy dtype incl. ml_dtypes.bfloat16), names sorted."""
    tags = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16",
            np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.uint8): "U8",
            np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3"}
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        data = np.ascontiguousarray(tensors[name]).tobytes()
        header[name] = {"dtype": tags[tensors[name].dtype], "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for blob in blobs:
            f.write(blob)


def write_weights(folder: Path, tensors: dict[str, np.ndarray], shards: int = 1) -> None:
    """model.safetensors, or `shards` files plus model.safetensors.index.json."""
    if shards == 1:
        write_safetensors(folder / "model.safetensors", tensors)
        return
    names = sorted(tensors)
    weight_map, total = {}, 0
    for s in range(shards):
        part = names[s::shards]
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(folder / file, {n: tensors[n] for n in part})
        weight_map.update({n: file for n in part})
        total += sum(tensors[n].nbytes for n in part)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_tiny_tokenizer(folder: Path, vocab_size: int = 300) -> dict[str, int]:
    return save_tokenizer(train_byte_level_bpe(_TOKENIZER_TEXT, vocab_size), folder)


def write_tiny_checkpoint(folder: str | Path, kind: str, *, seed: int = 0, dtype: str = "float32",
                          overrides: dict | None = None) -> Path:
    """Write a complete tiny checkpoint folder of `kind` (ALL_KINDS) and return its path.
    `overrides`: text-config values on top of the kind's (the tensors follow them)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    spec = ALL_KINDS[kind]
    config = spec.config(dtype)
    if overrides:
        config.get("text_config", config).update(overrides)
    shapes = stored_shapes(config, spec.per_expert)
    if spec.extra_shapes is not None:
        shapes.update(spec.extra_shapes(config))
    np_dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    rng = np.random.default_rng(seed)
    tensors = {name: _init(name, shape, rng).astype(np.float32).astype(np_dtype)
               for name, shape in sorted(shapes.items())}
    if spec.finish is not None:
        tensors = spec.finish(config, tensors, rng)
    write_weights(folder, tensors, spec.shards)
    ids = write_tiny_tokenizer(folder)
    eos = ids["<|im_end|>"]
    text = config.get("text_config", config)
    text.update(eos_token_id=eos, pad_token_id=ids["<|endoftext|>"])
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"eos_token_id": [eos, ids[SPECIAL_TOKENS[0]]], "pad_token_id": ids["<|endoftext|>"], "do_sample": False}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return folder


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Write a tiny random checkpoint (no download).")
    parser.add_argument("out", help="folder to write")
    parser.add_argument("--kind", choices=sorted(ALL_KINDS), default="qwen3_5_mtp3")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = write_tiny_checkpoint(args.out, args.kind, seed=args.seed, dtype=args.dtype)
    print(f"wrote tiny {args.kind} checkpoint to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Opens a local Hugging Face checkpoint folder: validates it at config time, then gives a
frozen ModelDescription and a lazy weight accessor in canonical (Qwen3.5 text) names.

    ckpt = open_checkpoint("path/to/model", spec_k=3)       # raises CheckpointError
    ckpt.description.kv_bytes_per_token()
    ckpt.weight("layers.0.linear_attn.in_proj_qkv.weight")  # reads only that tensor

Order: paths and config.json, family, safetensors headers, quantization, config values,
tensor names and shapes, MTP source and count, k, tokenizer. No weight data is read by any
check; all problems found after the family is known are reported together.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from tandem.checkpoint import validation as v
from tandem.checkpoint.config_values import check_config_values
from tandem.checkpoint.description import ModelDescription
from tandem.checkpoint.errors import CheckpointError
from tandem.checkpoint.families import FAMILIES, MODEL_TYPES
from tandem.checkpoint.families.base import ConfigError, Source
from tandem.checkpoint.families.layer_tensors import uses_per_expert
from tandem.checkpoint.safetensors_files import TensorIndex

# small files the reader and its checks read from the checkpoint folder (besides the weights)
READ_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "chat_template.jinja")

def read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{path} is missing; {what}") from e
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}). Re-download or fix the file.") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object.")
    return data


def resolve_architecture(config: dict, path: Path) -> str:
    archs = config.get("architectures") or []
    arch = archs[0] if archs else MODEL_TYPES.get(config.get("model_type", ""))
    if arch in FAMILIES:
        return arch
    named = f"architecture {arch!r}" if archs else f"model_type {config.get('model_type')!r}"
    raise CheckpointError(f"{path}: {named} is not supported. Supported architectures: "
                          f"{', '.join(sorted(FAMILIES))}.")


class Checkpoint:
    """A validated checkpoint: description + lazy weights. Build with open_checkpoint()."""

    def __init__(self, path: Path, config: dict, description: ModelDescription, sources: dict[str, Source],
                 index: TensorIndex, mtp_index: TensorIndex | None, draft: Path | None = None):
        self.path = path
        self.config = config
        self.description = description
        self.sources = sources
        self.draft = draft  # the folder the mtp.* tensors come from, when not the checkpoint
        self._index = index
        self._mtp_index = mtp_index

    def input_files(self) -> dict[str, Path]:
        """Every file this checkpoint was read from, by name relative to its folder ("draft/..."
        for the draft folder's): configs, tokenizer files, safetensors files and index."""
        files = {name: self.path / name for name in READ_FILES if (self.path / name).is_file()}
        sources = [(self._index, self.path, "")]
        if self.draft is not None:
            sources.append((self._mtp_index, self.draft, "draft/"))
            if (self.draft / "config.json").is_file():
                files["draft/config.json"] = self.draft / "config.json"
        for index, folder, prefix in sources:
            for f in index.files + ([index.index_file] if index.index_file else []):
                files[prefix + f.relative_to(folder).as_posix()] = f
        return files

    @property
    def fp8_block(self) -> tuple[int, int] | None:
        """The fp8 block size when the trunk's weights are stored block-quantized (read dequantized)."""
        return self._index.block

    def canonical_names(self) -> list[str]:
        return list(self.sources)

    def weight(self, canonical: str) -> np.ndarray:
        """One canonical tensor in its stored dtype; reads only the stored tensors it comes from."""
        src = self.sources[canonical]
        index = self._mtp_index if canonical.startswith("mtp.") else self._index
        parts = [index.read(n) for n in src.names]
        return src.combine(parts) if src.combine else parts[0]

    def release(self) -> None:
        """Unmap the weight files read so far (build-engines: after the export, which read them all)."""
        for index in {id(i): i for i in (self._index, self._mtp_index) if i is not None}.values():
            index.release()

    def parameter_count(self, mtp: bool = False) -> int:
        """Stored parameters of the trunk (or of the MTP head), from the headers."""
        index = self._mtp_index if mtp else self._index
        names = v.expected_tensors(self.sources, mtp=mtp)  # by stored name: tied lm_head counts once
        return sum(index.entries[n].numel for n in names) if index else 0

    def draft_parameter_count(self) -> int:
        """Weights the MTP heads draft with: their own and the lm_head they project with (0 without heads)."""
        desc = self.description
        return self.parameter_count(mtp=True) + desc.vocab_size * desc.hidden_size if desc.mtp else 0


def open_checkpoint(model_dir: str | Path, *, speculative: bool = True, spec_k: int = 3,
                    draft: str | Path | None = None) -> Checkpoint:
    """Validate `model_dir` (and the draft folder) without reading weight data; raise a
    CheckpointError listing every problem, or return the Checkpoint.

    speculative: MTP drafting will be used, so an MTP source must exist and k must be valid.
    With speculative=False the mtp.* tensors are ignored.
    """
    path = Path(model_dir)
    if not path.is_dir():
        raise CheckpointError(v.missing_path_message(str(model_dir), "model folder"))
    config = read_json(path / "config.json", "every checkpoint folder needs its config.json.")
    value_problems = check_config_values(config, str(path / "config.json"))
    if value_problems:
        raise CheckpointError(value_problems)
    arch = resolve_architecture(config, path / "config.json")
    family = FAMILIES[arch]
    text_cfg = family.text_config(config, arch)
    try:
        layout = family.mtp_layout(text_cfg)
    except (ConfigError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}. Fix config.json.") from e
    block_fp8 = getattr(family, "BLOCK_FP8", False)
    index = _dequantized(TensorIndex.open(path), config, text_cfg, block_fp8)

    problems = []

    mtp_index, mtp_cfg = None, text_cfg
    if speculative:
        problems += v.check_spec_k(spec_k)
        mtp_index, mtp_cfg, mtp_problems = _mtp_source(path, index, text_cfg, draft, layout, block_fp8)
        problems += mtp_problems
    declared = mtp_cfg.get(layout.count_key)
    present = v.mtp_layers_present(mtp_index, layout) if mtp_index else set()
    count_problems = v.check_mtp_layer_count(declared, present, mtp_index.files[0].parent, layout) if mtp_index else []
    problems += count_problems
    # heads missing from the weights: describe all declared ones, so the tensor check names what is missing
    heads = declared if count_problems and isinstance(declared, int) and present < set(range(declared)) \
        else len(present)

    try:
        desc = family.describe(config, arch, mtp_layers=heads, mtp_source=str(draft) if draft else "checkpoint")
    except (ConfigError, ValueError) as e:
        raise CheckpointError(problems + [f"{path / 'config.json'}: {e}. Fix config.json."]) from e
    desc = _with_generation_config(desc, path)
    if mtp_index is not None and hasattr(family, "fit_mtp_to_tensors"):  # what only the stored names tell
        desc = family.fit_mtp_to_tensors(desc, frozenset(mtp_index.names()))
    sources = family.sources(desc, per_expert=uses_per_expert(index.names() + (mtp_index.names() if mtp_index else [])))
    if speculative and desc.mtp is not None:
        problems += v.check_spec_k_heads(spec_k, desc.mtp)

    unused = family.unused_tensors(desc) if hasattr(family, "unused_tensors") else frozenset()  # never read
    problems += v.check_tensors(v.expected_tensors(sources, mtp=False), index,
                                owned=lambda n: not n.startswith(family.IGNORED_PREFIXES) and not layout.owns(n))
    if mtp_index is not None and (not count_problems or heads == declared):
        problems += v.check_tensors(v.expected_tensors(sources, mtp=True), mtp_index,
                                    owned=lambda n: layout.owns(n) and n not in unused)
    problems += v.check_tokenizer(path)
    if problems:
        raise CheckpointError(problems)
    draft_used = Path(draft) if draft is not None and mtp_index is not None else None
    return Checkpoint(path, config, desc, sources, index, mtp_index, draft_used)


def _dequantized(index: TensorIndex, config: dict, text_cfg: dict, block_fp8: bool) -> TensorIndex:
    """`index`, reading fp8 block-quantized weights dequantized; raises when quantized otherwise."""
    problems = v.check_quantization(config, text_cfg, index, block_fp8)
    if problems:
        raise CheckpointError(problems)
    scales, _ = v.block_fp8_scales(config.get("quantization_config") or text_cfg.get("quantization_config"), index)
    return index.dequantizing(scales, v.FP8_BLOCK) if scales else index


def _mtp_source(path: Path, index: TensorIndex, text_cfg: dict, draft, layout, block_fp8: bool = False) -> tuple:
    """(index holding the MTP tensors, the config declaring them, problems) for speculative decoding."""
    if draft is None:
        if v.has_mtp(index, layout):
            return index, text_cfg, []
        declared = text_cfg.get(layout.count_key)
        why = (f" config.json declares {layout.count_key}={declared}, so the tensors were dropped "
               f"(some conversions drop {layout.pattern})." if declared else "")
        return None, text_cfg, [
            f"{path}: speculative decoding needs MTP weights, but the checkpoint has no {layout.pattern} tensors.{why} "
            f"Pass --draft FOLDER with the model's {layout.pattern} tensors, or --no-mtp for plain decoding."]
    draft_path = Path(draft)
    if not draft_path.is_dir():
        return None, text_cfg, [v.missing_path_message(str(draft), "draft")]
    try:
        draft_index = TensorIndex.open(draft_path)
    except CheckpointError as e:
        return None, text_cfg, [f"draft: {p}" for p in e.problems]
    if not v.has_mtp(draft_index, layout):
        return None, text_cfg, [f"draft {draft_path}: no {layout.pattern} tensors in its safetensors files, so it "
                                f"cannot serve as the MTP head. Pass a folder that holds the model's {layout.pattern} "
                                "tensors."]
    draft_cfg = {}
    if (draft_path / "config.json").exists():
        draft_cfg = read_json(draft_path / "config.json", "")
        value_problems = check_config_values(draft_cfg, f"draft {draft_path / 'config.json'}")
        if value_problems:
            return None, text_cfg, value_problems
        draft_cfg = draft_cfg.get("text_config") or draft_cfg
        for key in ("hidden_size", "vocab_size"):
            if key in draft_cfg and draft_cfg[key] != text_cfg.get(key):
                return None, text_cfg, [f"draft {draft_path}/config.json: {key}={draft_cfg[key]} but the target has "
                                        f"{text_cfg.get(key)}. The draft must come from the same model."]
    try:
        draft_index = _dequantized(draft_index, draft_cfg, draft_cfg, block_fp8)
    except CheckpointError as e:
        return None, text_cfg, e.problems
    return draft_index, {**text_cfg, **draft_cfg}, []


def _with_generation_config(desc: ModelDescription, path: Path) -> ModelDescription:
    """generation_config.json's eos ids win over config.json's, as in transformers' generate()."""
    gen_path = path / "generation_config.json"
    if not gen_path.exists():
        return desc
    eos = read_json(gen_path, "").get("eos_token_id")
    if eos is None:
        return desc
    return replace(desc, eos_token_ids=tuple(eos) if isinstance(eos, list) else (int(eos),))

"""Config-time checks: everything tandem can refuse before reading any weight data.

Each check returns a list of problems (self-contained messages naming the file or tensor and
saying what to do); the reader raises them together. Inputs are config.json, the safetensors
headers and the tokenizer files (loaded as the runtime loads them, so a broken tokenizer or chat
template is refused here, not when the server starts).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from tandem.checkpoint.description import MTPSpec
from tandem.checkpoint.families.base import MTPLayout, Source
from tandem.checkpoint.safetensors_files import FLOAT_DTYPES, TensorIndex, fp8_scale_shape

MIN_SPEC_K, MAX_SPEC_K = 1, 8
# Tensor-name suffixes that only quantized checkpoints carry (fp8 block, NVFP4, compressed-tensors...).
_QUANT_SUFFIXES = ("weight_scale", "weight_scale_inv", "weight_scale_2", "input_scale", "weight_packed",
                   "weight_zero_point", "qweight", "scales", "qzeros", "g_idx")
FP8_BLOCK = (128, 128)  # the one quantized format tandem reads: DeepSeek's fp8 block quantization
FP8_FORMAT = ("quant_method 'fp8', weight_block_size [128, 128], 2-D float8_e4m3fn weights each with a float32 "
              "`<name>_scale_inv` of [ceil(rows/128), ceil(cols/128)]")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def _listing(names, limit: int = 6) -> str:
    names = sorted(names)
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def missing_path_message(path: str, role: str) -> str:
    """A path that does not exist; a Hugging Face repo id gets 'download it and pass the folder'."""
    if _HUB_ID.match(path) and not path.startswith("."):
        return (f"{role} '{path}' is not a local folder. It looks like a Hugging Face repo id, but tandem "
                f"never downloads: run `huggingface-cli download {path} --local-dir DIR` and pass DIR.")
    return f"{role} '{path}' does not exist. Pass the folder that holds config.json and the safetensors files."


def block_fp8_scales(quant: dict | None, index: TensorIndex) -> tuple[dict[str, str], list[str]]:
    """(fp8 weight -> its weight_scale_inv, []) when `index` is in DeepSeek's fp8 block format as
    `quant` (config.json's quantization_config) declares it, else ({}, what differs from it)."""
    quant = quant or {}
    declared = (quant.get("quant_method") == "fp8" and list(quant.get("weight_block_size") or ()) == list(FP8_BLOCK)
                and quant.get("fmt", "e4m3") == "e4m3" and quant.get("activation_scheme", "dynamic") == "dynamic")
    if not declared:
        return {}, [f"config.json's quantization_config {quant or None} does not declare it"]
    problems, scales = [], {}
    for name, e in index.entries.items():
        if e.dtype in FLOAT_DTYPES or name.endswith(".weight_scale_inv"):
            continue
        scale = index.entries.get(name + "_scale_inv")
        if e.dtype != "F8_E4M3" or len(e.shape) != 2 or not name.endswith(".weight"):
            problems.append(f"tensor {name} is {e.dtype} {list(e.shape)}, not a 2-D F8_E4M3 .weight")
        elif scale is None:
            problems.append(f"fp8 tensor {name} has no {name}_scale_inv")
        elif scale.dtype not in FLOAT_DTYPES or scale.shape != fp8_scale_shape(e.shape, FP8_BLOCK):
            problems.append(f"{name}_scale_inv is {scale.dtype} {list(scale.shape)} but {name} {list(e.shape)} needs "
                            f"a float scale of {list(fp8_scale_shape(e.shape, FP8_BLOCK))}")
        else:
            scales[name] = name + "_scale_inv"
    used = set(scales.values())
    for name in index.entries:
        if name.rsplit(".", 1)[-1] in _QUANT_SUFFIXES and name not in used:
            weight = index.entries.get(name.removesuffix("_scale_inv"))
            if not name.endswith("_scale_inv") or weight is None or weight.dtype in FLOAT_DTYPES:
                problems.append(f"tensor {name} is the scale of no fp8 weight")
    return ({}, problems) if problems else (scales, [])


def check_quantization(config: dict, text_cfg: dict, index: TensorIndex, block_fp8: bool = False) -> list[str]:
    """Quantized formats are not supported, except DeepSeek's fp8 block format in a family that
    declares it (`block_fp8`): name the tensors that make it so, and what differs from that format."""
    quant = config.get("quantization_config") or text_cfg.get("quantization_config")
    odd = {n for n, e in index.entries.items() if e.dtype not in FLOAT_DTYPES}
    scales = {n for n in index.entries if n.rsplit(".", 1)[-1] in _QUANT_SUFFIXES}
    if not quant and not odd and not scales:
        return []
    if block_fp8:
        found, why = block_fp8_scales(quant, index)
        if found or not why:
            return []
        listed = "; ".join(why[:4]) + (f" (and {len(why) - 4} more)" if len(why) > 4 else "")
        return [f"{index.files[0].parent}: this quantized checkpoint is not in the one quantized format tandem reads "
                f"({FP8_FORMAT}): {listed}. Use a checkpoint in that format or the bf16 release."]
    method = (quant or {}).get("quant_method") or (quant or {}).get("quant_algo")
    fmt = (quant or {}).get("fmt") or (quant or {}).get("weight_block_size")
    what = f"quant_method={method!r}" + (f", {fmt}" if fmt else "") if quant else "no quantization_config"
    tensors = odd | scales
    named = f" Quantized tensors: {_listing(tensors)}." if tensors else ""
    return [f"{index.files[0].parent}: quantized checkpoints are not supported yet (config.json: {what}).{named} "
            "Use the bf16/fp16 release of this model."]


def expected_tensors(sources: dict[str, Source], *, mtp: bool) -> dict[str, tuple[int, ...]]:
    """Stored name -> shape for the trunk's sources (mtp=False) or the MTP head's (mtp=True)."""
    out: dict[str, tuple[int, ...]] = {}
    for canonical, src in sources.items():
        if canonical.startswith("mtp.") == mtp:
            out.update(zip(src.names, src.shapes, strict=True))
    return out


def check_tensors(expected: dict[str, tuple[int, ...]], index: TensorIndex,
                  owned: Callable[[str], bool]) -> list[str]:
    """Every stored tensor the config implies exists with the implied shape, and no other tensor
    this check `owned` is there (others belong elsewhere: a vision tower, the MTP head)."""
    folder = index.files[0].parent
    problems = []
    missing = [n for n in expected if n not in index]
    if missing:
        problems.append(f"{folder}: tensors that config.json implies are missing: {_listing(missing)}. "
                        "The checkpoint is incomplete or config.json belongs to another model.")
    for name, shape in expected.items():
        if name in index and index.entries[name].shape != shape:
            problems.append(f"{index.entries[name].file.name}: tensor {name} has shape "
                            f"{list(index.entries[name].shape)} but config.json implies {list(shape)}. "
                            "Check that config.json matches the weights.")
    extra = [n for n in index.names() if n not in expected and owned(n)]
    if extra:
        problems.append(f"{folder}: tensors that are not part of the layout config.json describes: "
                        f"{_listing(extra)}. Check that config.json matches the weights.")
    return problems


def mtp_layers_present(index: TensorIndex, layout: MTPLayout) -> set[int]:
    return {j for n in index.names() if (j := layout.layer_of(n)) is not None}


def has_mtp(index: TensorIndex, layout: MTPLayout) -> bool:
    return any(layout.owns(n) for n in index.names())


def check_mtp_layer_count(declared: int | None, present: set[int], where: Path, layout: MTPLayout) -> list[str]:
    if not present or declared is None or present == set(range(declared)):
        return []
    missing = sorted(set(range(declared)) - present) if isinstance(declared, int) else []
    named = (f": MTP layer(s) {missing} ({', '.join(layout.layer_prefix(j) + '*' for j in missing)}) are missing"
             if missing else "")
    return [f"{where}: config.json says {layout.count_key}={declared} but the weights hold MTP layers "
            f"{sorted(present)}{named}. Fix {layout.count_key} or the MTP tensors ({layout.pattern})."]


def check_spec_k(k: int) -> list[str]:
    if isinstance(k, int) and MIN_SPEC_K <= k <= MAX_SPEC_K:
        return []
    return [f"spec-k {k!r} is out of range: draft tokens per round must be in {MIN_SPEC_K}..{MAX_SPEC_K} "
            "(2-4 is usually best). Pass --spec-k in that range."]


def check_spec_k_heads(k: int, mtp: MTPSpec) -> list[str]:
    """Heads anchored on the previous head chain: head j drafts token j+1 from head j-1's hidden, so
    a round drafts at most one token per head (transformers' NextN drafting, Step-3.5)."""
    if mtp.anchor != "previous_head" or not isinstance(k, int) or k <= mtp.num_layers:
        return []
    return [f"spec-k {k} is more than this model's {mtp.num_layers} chained {mtp.form} MTP heads can draft: each "
            f"head drafts one token from the previous head's hidden, so a round drafts at most {mtp.num_layers}. "
            f"Pass --spec-k {mtp.num_layers} (or less)."]


def check_tokenizer(folder: Path) -> list[str]:
    """tokenizer.json loads with `tokenizers`, tokenizer_config.json and special_tokens_map.json
    (when present) are JSON objects, and the chat template (tokenizer_config.json's, or
    chat_template.jinja) compiles."""
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    if not path.exists():
        return [f"{folder}: tokenizer.json is missing; the engine directory needs it to encode prompts. "
                "Copy the model's tokenizer.json (and tokenizer_config.json) into the folder."]
    problems = []
    try:
        Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for every parse error
        problems.append(f"{path} does not load as a tokenizer ({e}). Re-download the model's tokenizer.json.")
    configs = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (folder / name).exists():
            try:
                configs[name] = json.loads((folder / name).read_text())
                if not isinstance(configs[name], dict):
                    raise ValueError("it holds no JSON object")
            except (OSError, ValueError) as e:
                problems.append(f"{folder / name} is not a valid JSON object ({e}). Re-download or fix the file.")
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        problems += _check_template(jinja.read_text(errors="replace"), str(jinja))
    elif isinstance(configs.get("tokenizer_config.json"), dict):
        template = configs["tokenizer_config.json"].get("chat_template")
        named = template if isinstance(template, list) else [{"name": "chat_template", "template": template}]
        where = f"{folder / 'tokenizer_config.json'}"
        for t in named:
            if not isinstance(t, dict) or not isinstance(t.get("template", ""), str | None):
                problems.append(f"{where}: chat_template must be a string or a list of {{name, template}} objects. "
                                "Re-download or fix the file.")
            elif t.get("template"):
                problems += _check_template(t["template"], f"{where} ({t.get('name')})")
    return problems


_SAMPLE_CHATS = ([{"role": "user", "content": "Hello"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name a prime."}])


def _check_template(template: str, where: str) -> list[str]:
    """The chat template compiles in the environment the server renders it with, and renders plain
    conversations within the server's time and size limits (chat_render.py). What the template
    refuses on purpose (raise_exception) or fails on here is left to each request."""
    from jinja2 import TemplateSyntaxError

    from tandem.chat_render import BoundedTemplate, RenderLimit

    try:
        bounded = BoundedTemplate(template)
    except TemplateSyntaxError as e:
        return [f"{where}: the chat template does not compile (line {e.lineno}: {e.message}). "
                "Fix the template or re-download the file."]
    for messages in _SAMPLE_CHATS:
        try:
            bounded.render({"messages": messages, "add_generation_prompt": True, "tools": None})
        except RenderLimit as e:
            return [f"{where}: rendering a {len(messages)}-message conversation, {e}. The server would refuse "
                    "every chat; fix the template or re-download the file."]
        except Exception:  # noqa: S112 (the template's own refusals and failures answer each request)
            continue
    return []

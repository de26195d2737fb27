"""Renders the checkpoint's chat template (tokenizer_config.json) the way transformers does:
a sandboxed jinja2 environment with trim_blocks / lstrip_blocks, `raise_exception`, and a
`tojson` that keeps non-ASCII text."""

from __future__ import annotations

import json
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    pass


def _raise(message: str):
    raise TemplateError(message)


class ChatTemplate:
    def __init__(self, template: str, special: dict[str, str | None]):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        self.template = env.from_string(template)
        self.special = special

    @classmethod
    def from_engine_dir(cls, engine_dir: Path) -> ChatTemplate | None:
        path = Path(engine_dir) / "tokenizer_config.json"
        jinja = Path(engine_dir) / "chat_template.jinja"
        config = _read(path, json.loads) if path.exists() else {}
        if not isinstance(config, dict):
            raise ChatTemplateError(f"{path}: expected a JSON object; rebuild the engine directory from a checkpoint "
                                    "with a valid tokenizer_config.json")
        template = _read(jinja, str) if jinja.exists() else config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                            None)
        if not template:
            return None
        if not isinstance(template, str):
            raise ChatTemplateError(f"{path}: chat_template is {type(template).__name__}, not a string; fix it in the "
                                    "checkpoint and rebuild the engine directory")
        special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        try:
            return cls(template, special)
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template in {jinja if jinja.exists() else path} does not parse ({e}); "
                                    "fix it in the checkpoint and rebuild the engine directory") from e

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
               kwargs: dict | None = None) -> str:
        """kwargs: the request's chat_template_kwargs (enable_thinking, ...), below the fixed names."""
        try:
            return self.template.render({**(kwargs or {}), "messages": messages, "tools": tools,
                                         "add_generation_prompt": add_generation_prompt, **self.special})
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template refused these messages: {e}") from e


def _token_text(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _read(path: Path, parse):
    try:
        return parse(path.read_text())
    except (OSError, ValueError) as e:
        raise ChatTemplateError(f"{path} cannot be read ({e}); rebuild the engine directory from a checkpoint "
                                f"whose {path.name} is valid") from e

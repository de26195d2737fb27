"""The checkpoint's chat template (tokenizer_config.json or chat_template.jinja) as the server
renders it: transformers' environment, within time and size limits (chat_render.py); whatever
goes wrong in a render is a ChatTemplateError (a 400 that says what and what to do)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from jinja2.exceptions import TemplateError

from tandem.chat_render import BoundedTemplate, RenderLimit


class ChatTemplateError(ValueError):
    pass


class ChatTemplate:
    def __init__(self, template: str, special: dict[str, str | None]):
        self.template = BoundedTemplate(template)
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
        with _as_refusal():
            return self.template.render(self._context(messages, add_generation_prompt, tools, kwargs))

    async def render_async(self, messages: list[dict], add_generation_prompt: bool = True,
                           tools: list[dict] | None = None, kwargs: dict | None = None) -> str:
        """render() off the event loop: other requests keep streaming while this one renders."""
        with _as_refusal():
            return await self.template.render_async(self._context(messages, add_generation_prompt, tools, kwargs))

    def _context(self, messages, add_generation_prompt, tools, kwargs) -> dict:
        return {**(kwargs or {}), "messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt,
                **self.special}


@contextlib.contextmanager
def _as_refusal():
    try:
        yield
    except RenderLimit as e:
        raise ChatTemplateError(str(e)) from e
    except TemplateError as e:
        raise ChatTemplateError(f"the chat template refused these messages: {e}") from e
    except Exception as e:  # the template's own code failed on them (a type error, a missing key...)
        raise ChatTemplateError(f"the chat template failed on these messages ({e}); check the messages' fields, "
                                "or fix the template") from e


def _token_text(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _read(path: Path, parse):
    try:
        return parse(path.read_text())
    except (OSError, ValueError) as e:
        raise ChatTemplateError(f"{path} cannot be read ({e}); rebuild the engine directory from a checkpoint "
                                f"whose {path.name} is valid") from e

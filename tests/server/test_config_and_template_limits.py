"""config.json values are checked (finite, typed, in range, naming the field) and chat templates
render within time and size limits: refused at inspect/build when a plain conversation breaks
them, a 400 in words per request at serve time while the server keeps serving."""

from __future__ import annotations

import shutil
import threading
import time

import httpx
import pytest

from tandem import chat_render
from tandem.chat_render import BoundedTemplate, RenderLimit
from tandem.checkpoint import open_checkpoint
from tandem.cli import main
from tandem.engines.manifest import MANIFEST, file_sha256, read_manifest, write_manifest

from ..checkpoint_fixtures import refusal
from ..conftest import edit_json
from .test_server import Live

HANG = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"


@pytest.mark.parametrize("field, value, says", [
    ("rms_norm_eps", float("nan"), "rms_norm_eps is nan; it must be a finite number"),
    ("rms_norm_eps", 2.0, "rms_norm_eps is 2, outside (0, 0.1]"),
    ("max_position_embeddings", 1e12,
     "max_position_embeddings is 1000000000000.0; it must be an integer in 1..16,777,216"),
    ("max_position_embeddings", 10**12, "max_position_embeddings is 1,000,000,000,000, outside 1..16,777,216"),
    ("num_attention_heads", -4, "num_attention_heads is -4, outside 1..1,024"),
    ("hidden_size", "256", "hidden_size is '256'; it must be an integer"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": float("inf")},
     "rope_parameters.rope_theta is inf; it must be a finite number"),
])
def test_config_values_are_checked_naming_the_field(tiny_copy, capsys, field, value, says):
    path = tiny_copy("qwen3_5_mtp3")
    edit_json(path / "config.json", **{field: value})
    msg = refusal(path)
    assert f"{path / 'config.json'}: {says}" in msg and "Fix config.json" in msg
    assert main(["inspect", str(path)]) == 1 and says in capsys.readouterr().err


def test_a_real_config_passes(tiny_root):
    assert open_checkpoint(tiny_root / "qwen3_5_mtp3").description.rms_norm_eps > 0


@pytest.mark.parametrize("template, says", [
    ("{% for i in range(10**9) %}x{% endfor %}", "asked for an argument of 1,000,000,000"),
    ("{{ 'x' * 10**10 }}", "asked for a repetition of 10,000,000,000"),
    ("{% for i in range(99999) %}{{ 'y' * 9999 }}{% endfor %}", "passed the render limit of 16,777,216 characters"),
    (HANG, "took longer than 0.3 s"),
])
def test_inspect_refuses_a_template_that_breaks_the_render_limits(tiny_copy, monkeypatch, template, says):
    monkeypatch.setattr(chat_render, "RENDER_SECONDS", 0.3)
    path = tiny_copy("qwen3_5_mtp1")
    edit_json(path / "tokenizer_config.json", chat_template=template)
    msg = refusal(path)
    assert f"{path / 'tokenizer_config.json'} (chat_template): rendering a 1-message conversation" in msg
    assert says in msg and "The server would refuse every chat" in msg


def test_a_template_that_refuses_plain_chats_on_purpose_is_not_a_checkpoint_problem(tiny_copy):
    path = tiny_copy("qwen3_5_mtp1")
    edit_json(path / "tokenizer_config.json", chat_template="{{ raise_exception('tools only') }}")
    assert open_checkpoint(path).description is not None


def test_render_limits_leave_ordinary_templates_alone():
    t = BoundedTemplate("{% for m in messages %}{{ '%-6s|' % m.role }}{{ m.content|center(9) }}"
                        "{{ '{:>4}'.format(loop.index) }}{% endfor %}{{ messages|map(attribute='role')|join(',') }}"
                        "{{ 2 ** 64 }}{{ messages|tojson }}")
    out = t.render({"messages": [{"role": "user", "content": "héllo"}]})
    assert out == 'user  |  héllo     1user18446744073709551616[{"role": "user", "content": "héllo"}]'
    with pytest.raises(RenderLimit, match="beyond the render limit of 1,048,576 bits"):
        t.template.environment.from_string("{{ 3 ** 20000000 }}").render()


def test_a_render_past_its_time_is_stopped_and_the_next_one_runs():
    slow = BoundedTemplate(HANG, seconds=0.2)
    start = time.perf_counter()
    with pytest.raises(RenderLimit, match="took longer than 0.2 s"):
        slow.render({})
    assert time.perf_counter() - start < 1.0
    assert BoundedTemplate("{{ 1 + 1 }}").render({}) == "2"
    time.sleep(0.2)
    workers = [t for t in threading.enumerate() if t.name == "chat-template"]
    assert len(workers) == 1    # the stopped worker exited; one serves what comes next


def _with_template(src, dst, template: str):
    """A copy of engine dir `src` whose chat template is `template` (recorded in its manifest)."""
    shutil.copytree(src, dst)
    (dst / "chat_template.jinja").write_text(template)
    manifest = read_manifest(dst)
    manifest["files"]["chat_template.jinja"] = file_sha256(dst / "chat_template.jinja")
    write_manifest(dst, {k: v for k, v in manifest.items() if k != "file_sizes"})
    assert (dst / MANIFEST).exists()
    return dst


def test_the_server_refuses_a_render_past_its_limits_in_words_and_keeps_serving(engine_dirs, tmp_path,
                                                                                 monkeypatch):
    monkeypatch.setattr(chat_render, "RENDER_SECONDS", 0.5)
    template = ("{% for m in messages %}{% if m.content == 'hang' %}" + HANG + "{% endif %}"
                "{% if m.content == 'add' %}{{ m.content + 1 }}{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    folder = _with_template(engine_dirs["qwen3_5_mtp3"], tmp_path / "engines", template)
    with Live(folder) as server:
        def chat(content):
            body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
            return httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json=body)

        result = {}
        hanging = threading.Thread(target=lambda: result.setdefault("r", chat("hang")))
        hanging.start()
        time.sleep(0.1)
        start = time.perf_counter()
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert time.perf_counter() - start < 0.3      # the render runs off the event loop
        hanging.join()
        r = result["r"]
        assert r.status_code == 400 and "took longer than 0.5 s to render these messages" in r.text
        r = chat("add")
        assert r.status_code == 400 and "the chat template failed on these messages" in r.text
        assert "TypeError" not in r.text and "can only concatenate str" in r.text
        assert chat("hello").status_code == 200

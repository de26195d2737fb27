"""`tandem generate` figures: prefill and decode reported separately, after an untimed warm-up,
and no acceptance figure when nothing was drafted."""

from __future__ import annotations

import re
from types import SimpleNamespace

from tokenizers import Tokenizer

from tandem.cli import generation_figures, main
from tandem.pipeline.llm import LLM
from tandem.pipeline.sequence import RequestMetrics
from tandem.pipeline.width_control import WidthController

PROMPT = "def add(a, b):"
PREFILL = re.compile(r"^\[prefill: (\d+) prompt tokens, first token after [\d.]+ ms\]$", re.M)
DECODE = re.compile(r"^\[decode: (\d+) tokens after the first in [\d.]+ s, [\d.]+ tokens/s\]$", re.M)
ACCEPT = re.compile(r"^\[speculative: accept length ([\d.]+) tokens per verify step over (\d+) steps, "
                    r"(\d+) of (\d+) drafts accepted\]$", re.M)


def run_generate(monkeypatch, capsys, engine_dir, *extra) -> tuple[str, list[str]]:
    calls = []

    def spy(name):
        real = getattr(LLM, name)

        def wrapper(self, *args, **kwargs):
            calls.append(name)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(LLM, name, wrapper)

    spy("generate")
    spy("stream")
    assert main(["generate", str(engine_dir), "--prompt", PROMPT, "--max-tokens", "12", "--ignore-eos",
                 *extra]) == 0
    return capsys.readouterr().out, calls


def test_generate_reports_prefill_decode_and_acceptance(engine_dirs, monkeypatch, capsys):
    # drafting every round (--spec-k; never judged hopeless): on random tiny weights no round pays
    # against plain bursts, and the adaptive width would stop drafting before the timed generation
    monkeypatch.setattr(WidthController, "hopeless", lambda self, batch, constrained=False: False)
    out, calls = run_generate(monkeypatch, capsys, engine_dirs["qwen3_5_mtp3"], "--spec-k", "3")
    assert calls == ["generate", "stream"]  # the warm-up generation runs first, untimed
    prompt_tokens = len(Tokenizer.from_file(str(engine_dirs["qwen3_5_mtp3"] / "tokenizer.json")).encode(PROMPT).ids)
    assert int(PREFILL.search(out).group(1)) == prompt_tokens
    assert int(DECODE.search(out).group(1)) == 11
    accept = ACCEPT.search(out)
    assert accept and float(accept.group(1)) >= 1.0 and int(accept.group(4)) > 0
    assert out.rstrip().endswith("[finish reason: length]")


def test_generate_without_drafting_prints_no_acceptance_figure(engine_dirs, monkeypatch, capsys):
    out, _ = run_generate(monkeypatch, capsys, engine_dirs["qwen3_5_mtp3"], "--no-spec")
    assert PREFILL.search(out) and int(DECODE.search(out).group(1)) == 11
    assert "accept length" not in out and "[speculative: nothing drafted (plain decoding)]" in out


def test_the_figures_come_from_the_engine_timestamps():
    """Decode counts the tokens after the first over the time after it; prefill is the time to it."""
    m = RequestMetrics(arrival=10.0, first_token=10.025, finished=12.025, rounds=4, drafted=12, accepted=6)
    seq = SimpleNamespace(prompt=[1] * 7, num_generated=21, metrics=m, finish_reason="stop")
    assert generation_figures(seq) == [
        "[prefill: 7 prompt tokens, first token after 25.0 ms]",
        "[decode: 20 tokens after the first in 2.000 s, 10.0 tokens/s]",
        "[speculative: accept length 2.50 tokens per verify step over 4 steps, 6 of 12 drafts accepted]",
        "[finish reason: stop]"]
    plain = SimpleNamespace(prompt=[1], num_generated=1, metrics=RequestMetrics(arrival=0.0, first_token=0.5,
                                                                                 finished=0.5), finish_reason="length")
    assert generation_figures(plain)[1:3] == ["[decode: no tokens after the first]",
                                              "[speculative: nothing drafted (plain decoding)]"]

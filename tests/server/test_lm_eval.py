"""lm-eval's `local-completions` model (loglikelihood tasks over /v1/completions with echo and
logprobs, prompts sent as lists of token-id lists) against a live tandem server, on a small
multiple-choice task written here: it runs to its accuracy table, and every loglikelihood it read
is the offline pipeline's sum of the continuation's prompt logprobs (to 1e-4)."""

from __future__ import annotations

import json

import pytest

from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.sampling_params import SamplingParams

from .test_server import Live

lm_eval = pytest.importorskip("lm_eval")

QUESTIONS = [("Which keyword defines a function?", ["def", "func", "lambda"], 0),
             ("What does len([1, 2, 3]) return?", ["1", "2", "3"], 2),
             ("Which type is immutable?", ["list", "dict", "tuple"], 2),
             ("Which operator divides integers?", ["/", "//", "%"], 1)]
TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def test_lm_eval_local_completions_reads_the_pipelines_logprobs(engine_dirs, tiny_root, tmp_path, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    data = tmp_path / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (tmp_path / "tiny_mc.yaml").write_text(TASK.format(data=data))
    tokenizer = tiny_root / "qwen3_5_mtp3"
    with Live(engine_dirs["qwen3_5_mtp3"]) as live:
        out = simple_evaluate(model="local-completions", tasks=["tiny_mc"], log_samples=True,
                              task_manager=TaskManager(include_path=str(tmp_path)),
                              model_args=f"base_url={live.url}/v1/completions,model=tiny,tokenizer={tokenizer},"
                                         "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1")
    assert 0.0 <= out["results"]["tiny_mc"]["acc,none"] <= 1.0
    samples = out["samples"]["tiny_mc"]
    assert len(samples) == len(QUESTIONS)

    plain = LLM(engine_dirs["qwen3_5_mtp3"], RuntimeConfig(speculative=False))
    for sample in samples:
        doc = sample["doc"]
        context = f"Question: {doc['question']}\nAnswer:"
        for choice, resp in zip(doc["choices"], sample["resps"]):
            whole = plain.tokenizer.encode(context + " " + choice).ids
            cont = len(whole) - len(plain.tokenizer.encode(context).ids)
            scored = plain.generate([whole], SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
            assert resp[0][0] == pytest.approx(sum(e.logprob for e in scored[-cont:]), abs=1e-4)

"""EleutherAI's lm-evaluation-harness, unchanged, as a client: `lm_eval --model
local-completions` runs a small multiple-choice task (tests/server/data/lm_eval_mc.jsonl)
against the server. Its loglikelihood requests are echo + logprobs on /v1/completions; the
accuracy it prints must equal the one computed here from tokenmill's offline prompt logprobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest import MODEL_NAME
from tokenmill import LLM, SamplingParams
from tokenmill.executor.loader import resolve_model_path

DATA = Path(__file__).parent / "data" / "lm_eval_mc.jsonl"
TASK = """\
task: tokenmill_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""


def offline_scores(model_path: Path) -> tuple[list[list[float]], float]:
    """The task scored by hand: each choice's summed prompt logprobs over its tokens, split
    from the context as lm-eval splits a pair: the context's own tokens, then the whole's
    tokens past the context's length (where a token spans the boundary these are not the
    whole's tokens)."""
    llm = LLM(str(model_path), dtype="float32")
    tok = llm.tokenizer
    docs = [json.loads(line) for line in DATA.read_text().splitlines()]
    pairs = []
    for doc in docs:
        for choice in doc["choices"]:
            context = doc["question"].rstrip()  # lm-eval moves a context's trailing spaces to the choice
            choice = doc["question"][len(context):] + choice
            context_ids = tok.encode(context, add_special_tokens=False)
            whole = tok.encode(context + choice, add_special_tokens=False)
            pairs.append((context_ids + whole[len(context_ids):], len(context_ids)))
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in pairs], params, use_tqdm=False)
    scores = [sum(out.prompt_logprobs[p][ids[p]] for p in range(ctxlen, len(ids)))
              for (ids, ctxlen), out in zip(pairs, outs)]
    per_doc, i = [], 0
    for doc in docs:
        per_doc.append(scores[i:i + len(doc["choices"])])
        i += len(doc["choices"])
    correct = sum(max(range(len(s)), key=s.__getitem__) == doc["answer"] for s, doc in zip(per_doc, docs))
    return per_doc, correct / len(docs)


def test_lm_eval_accuracy_equals_offline_prompt_logprobs(server, tmp_path):
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is in the test extras")
    model_path = resolve_model_path(None)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tokenmill_mc.yaml").write_text(TASK.format(data=DATA))
    model_args = (f"model={MODEL_NAME},base_url={server.url}/v1/completions,tokenizer={model_path},"
                  "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=4,max_retries=1")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
         "--tasks", "tokenmill_mc", "--include_path", str(tmp_path / "tasks"),
         "--output_path", str(tmp_path / "results"), "--log_samples"],
        env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [results_file] = (tmp_path / "results").rglob("results_*.json")
    acc = json.loads(results_file.read_text())["results"]["tokenmill_mc"]["acc,none"]
    assert "tokenmill_mc" in run.stdout  # the table it prints
    scores, offline_acc = offline_scores(model_path)
    assert acc == pytest.approx(offline_acc)
    # and every choice's loglikelihood, not only the argmax
    [samples_file] = (tmp_path / "results").rglob("samples_*.jsonl")
    samples = sorted((json.loads(line) for line in samples_file.read_text().splitlines()), key=lambda d: d["doc_id"])
    assert len(samples) == len(scores)
    for sample, expected in zip(samples, scores):
        assert [float(ll) for ll, _ in sample["filtered_resps"]] == pytest.approx(expected, abs=1e-3)

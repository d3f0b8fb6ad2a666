"""`vllm bench serve` command lines run unchanged as `tokenmill bench serve` (bench/vllm_args.py):
against the server of known timing and against tokenmill serve; their bad values."""

from __future__ import annotations

import json
import re
import shlex
from urllib.parse import urlsplit

import pytest
from transformers import AutoTokenizer

from tests.server.conftest import MODEL_NAME, start_server
from tokenmill.bench.metrics import METRICS
from tokenmill.bench.vllm_args import resolve
from tokenmill.cli import build_parser, main
from tokenmill.config import DEFAULT_MODEL_DIR

TOKENIZER = str(DEFAULT_MODEL_DIR)


def vllm(command: str) -> dict:
    """Runs a `vllm bench serve ...` line with tokenmill (the leading `vllm` left out, the rest
    as it is) and returns the result it saved (--result-dir and --result-filename)."""
    argv = shlex.split(command)
    assert argv[:3] == ["vllm", "bench", "serve"]
    assert main(argv[1:]) == 0
    path = argv[argv.index("--result-dir") + 1] + "/" + argv[argv.index("--result-filename") + 1]
    with open(path) as f:
        return json.load(f)


def test_vllm_docs_command(known_server, tmp_path):
    port = urlsplit(known_server).port
    r = vllm(f"vllm bench serve --backend openai --host 127.0.0.1 --port {port} --model known --tokenizer {TOKENIZER} "
             f"--dataset-name random --random-input-len 128 --random-output-len 16 --num-prompts 8 --ignore-eos "
             f"--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 --goodput ttft:5000 tpot:500 "
             f"--save-result --result-dir {tmp_path} --result-filename r.json --disable-tqdm")
    assert r["completed"] == 8 and r["failed"] == 0
    assert r["total_input_tokens"] == 128 * 8 and r["total_output_tokens"] == 16 * 8
    assert (r["backend"], r["model_id"], r["num_prompts"], r["request_rate"], r["max_concurrency"]) == \
        ("openai", "known", 8, "inf", None)
    assert re.fullmatch(r"\d{8}-\d{6}", r["date"])
    for metric in METRICS:
        for stat in ("mean", "median", "std", "p50", "p99"):
            assert f"{stat}_{metric}_ms" in r
        assert f"p90_{metric}_ms" not in r  # only the percentiles asked for
    assert r["p50_ttft_ms"] == pytest.approx(50, abs=10) and r["p50_tpot_ms"] == pytest.approx(10, abs=2)
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # all within 5 s and 500 ms
    assert r["config"]["ignore_eos"] is True


def test_chosen_statistics_default_file_name_and_model_from_the_server(known_server, tmp_path):
    assert main(shlex.split(f"bench serve --base-url {known_server} --tokenizer {TOKENIZER} --num-prompts 4 "
                            f"--input-len 8 --output-len 4 --max-concurrency 2 --percentile-metrics ttft,e2el "
                            f"--metric-percentiles 25,99.9 --goodput ttft:1 --save-result --result-dir {tmp_path} "
                            f"--disable-tqdm")) == 0
    [path] = tmp_path.iterdir()  # vLLM's name; no --model: the first model of /v1/models
    assert re.fullmatch(r"openai-infqps-concurrency2-known-\d{8}-\d{6}\.json", path.name)
    r = json.loads(path.read_text())
    assert r["model_id"] == "known" and r["completed"] == 4
    assert {"p25_ttft_ms", "p99.9_ttft_ms", "mean_e2el_ms", "std_e2el_ms", "p99.9_e2el_ms"} <= r.keys()
    assert not [k for k in r if "tpot" in k or "itl" in k]
    assert r["request_goodput"] == 0.0  # no first token within 1 ms


def test_sharegpt_and_ignore_eos(known_server, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    replies = ["def add(a, b):\n    return a + b" + " # ok" * i for i in range(4)]
    conversations = [[{"from": "human", "value": f"write a function number {i} that adds two numbers"},
                      {"from": "gpt", "value": reply}] for i, reply in enumerate(replies)]
    conversations += [
        [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there, how are you today?"}],
        [{"from": "human", "value": "what is six times seven, please?"}, {"from": "gpt", "value": "42"}],
        [{"from": "human", "value": "only one turn here, and nobody answers"}],
    ]
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps([{"conversations": c} for c in conversations]))
    command = (f"vllm bench serve --backend openai-chat --endpoint /v1/chat/completions --base-url {known_server} "
               f"--model eos --tokenizer {TOKENIZER} --dataset-name sharegpt --dataset-path {data} "
               f"--save-result --result-dir {tmp_path} --disable-tqdm")
    # "eos" stops after 3 tokens unless told ignore_eos, which sharegpt sends only with --ignore-eos
    r = vllm(f"{command} --num-prompts 4 --result-filename a.json")
    assert r["completed"] == 4 and r["total_output_tokens"] == 3 * 4 and r["backend"] == "openai-chat"
    assert r["workload"].startswith("4 prompts from ShareGPT")  # too short a prompt, a reply or a talk: left out
    r = vllm(f"{command} --num-prompts 4 --ignore-eos --result-filename b.json")
    assert r["total_output_tokens"] == sum(len(tokenizer.encode(x, add_special_tokens=False)) for x in replies)
    r = vllm(f"{command} --num-prompts 5 --ignore-eos --sharegpt-output-len 6 --result-filename c.json")
    assert r["workload"].startswith("5 prompts from ShareGPT")  # a fixed output length keeps the short reply
    assert r["completed"] == 5 and r["total_output_tokens"] == 6 * 5
    # random turns ignore_eos on by itself, as vLLM does
    r = vllm(f"vllm bench serve --base-url {known_server} --model eos --tokenizer {TOKENIZER} --dataset-name random "
             f"--random-input-len 8 --random-output-len 6 --num-prompts 4 --save-result --result-dir {tmp_path} "
             f"--result-filename d.json --disable-tqdm")
    assert r["total_output_tokens"] == 6 * 4


def test_prefix_repetition_against_tokenmill_serve(tmp_path):
    srv = start_server()
    try:
        before = srv.wait_idle()
        n = 8
        r = vllm(f"vllm bench serve --backend openai --base-url {srv.url} --model {MODEL_NAME} --tokenizer {TOKENIZER} "
                 f"--dataset-name prefix_repetition --prefix-repetition-prefix-len 32 --prefix-repetition-suffix-len 8 "
                 f"--prefix-repetition-num-prefixes 2 --prefix-repetition-output-len 4 --num-prompts {n} --ignore-eos "
                 f"--max-concurrency 2 --save-result --result-dir {tmp_path} --result-filename p.json --disable-tqdm")
        assert r["completed"] == n and r["total_input_tokens"] == (32 + 8) * n and r["total_output_tokens"] == 4 * n
        m = srv.wait_idle()
        finished = "tokenmill:request_finished_total{finished_reason=length}"
        assert m[finished] - before.get(finished, 0) == n  # ignore_eos taken: every request ran to its length
        hits = m["tokenmill:prefix_cache_hits_total"] - before["tokenmill:prefix_cache_hits_total"]
        assert hits >= 32 * (n - 2) // 2  # most requests find their 32-token prefix (2 full blocks) cached
    finally:
        srv.stop()


def test_vllm_flags_map_onto_tokenmill_flags():
    args = build_parser().parse_args(["bench", "serve", "--random-input-len", "100", "--random-output-len", "10",
                                      "--random-range-ratio", "0.25", "--random-prefix-len", "16"])
    resolve(args)
    assert (args.base_url, args.endpoint, args.endpoint_path) == ("http://127.0.0.1:8000", "completions",
                                                                   "/v1/completions")
    assert (args.workload, args.num_prefixes, args.prefix_len) == ("shared-prefix", 1, 16)
    assert (args.input_len, args.output_len, args.ignore_eos) == ("75:125", "7:13", True)  # floor, ceil
    args = build_parser().parse_args(["bench", "serve", "--backend", "openai-chat", "--host", "::1", "--port", "9000"])
    resolve(args)
    assert (args.base_url, args.endpoint, args.endpoint_path) == ("http://[::1]:9000", "chat", "/v1/chat/completions")
    assert (args.workload, args.input_len, args.output_len) == ("random", "32:256", "32:256")  # tokenmill's defaults
    args = build_parser().parse_args(["bench", "serve", "--endpoint", "/proxy/v1/chat/completions", "--dataset-name",
                                      "prefix_repetition", "--output-len", "7", "--num-prompts", "10"])
    resolve(args)
    assert (args.endpoint, args.endpoint_path) == ("chat", "/proxy/v1/chat/completions")
    assert (args.workload, args.num_prefixes, args.prefix_len, args.input_len, args.output_len, args.ignore_eos) == \
        ("shared-prefix", 10, 256, "256", "7", False)  # vLLM's defaults; --output-len is vLLM's general one


@pytest.mark.parametrize("args, message", [
    (["--backend", "openai-chat", "--endpoint", "/v1/completions"],
     "--backend openai-chat and --endpoint /v1/completions disagree"),
    (["--endpoint", "/v1/embeddings"], "--endpoint must be completions, chat or a path"),
    (["--workload", "random", "--dataset-name", "random"], "--workload (tokenmill's workload) and --dataset-name"),
    (["--prefix-len", "8", "--prefix-repetition-prefix-len", "8"],
     "--prefix-len (tokenmill's workload) and --prefix-repetition-prefix-len"),
    (["--dataset-name", "sharegpt"], "--dataset-name sharegpt needs --dataset-path"),
    (["--dataset-path", "sg.json"], "--dataset-path does not apply to --dataset-name random"),
    (["--dataset-name", "sharegpt", "--dataset-path", "sg.json", "--random-input-len", "8"],
     "--random-input-len does not apply to --dataset-name sharegpt"),
    (["--dataset-name", "prefix_repetition", "--input-len", "8"],
     "--input-len does not apply to --dataset-name prefix_repetition"),
    (["--dataset-name", "sharegpt", "--dataset-path", "/does/not/exist.json"],
     "--dataset-path /does/not/exist.json: cannot read"),
    (["--random-range-ratio", "1"], "--random-range-ratio must be in [0, 1)"),
    (["--random-input-len", "0"], "--random-input-len must be >= 1"),
    (["--random-prefix-len", "-1"], "--random-prefix-len must be >= 0"),
    (["--dataset-name", "random", "--input-len", "8:16"], "--input-len: with a vLLM --dataset-name, expected one"),
    (["--dataset-name", "prefix_repetition", "--prefix-repetition-num-prefixes", "20", "--num-prompts", "8"],
     "--prefix-repetition-num-prefixes (20) must be at most --num-prompts (8)"),
    (["--percentile-metrics", "ttft,p99"], "--percentile-metrics: expected a comma-separated list"),
    (["--metric-percentiles", "50,101"], "--metric-percentiles: every percentile must be in [0, 100]"),
    (["--metric-percentiles", "50,x"], "--metric-percentiles: expected comma-separated numbers"),
    (["--goodput", "ttft=5"], "--goodput: expected KEY:MILLISECONDS"),
    (["--goodput", "itl:5"], "--goodput: expected KEY:MILLISECONDS with KEY in ttft, tpot, e2el"),
    (["--goodput", "ttft:5", "tpot:-1"], "--goodput: tpot must be > 0"),
    (["--goodput", "ttft:5", "--slo", "ttft_ms=5"], "--goodput and --slo"),
    (["--save-result", "--output-json", "r.json"], "--save-result and --output-json"),
])
def test_bad_vllm_arguments(args, message, capsys):
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--tokenizer", TOKENIZER,
                 "--no-progress", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("args, message", [
    (["--port", "70000", "--model", "m"], "--port must be in [1, 65535]"),
    (["--port", "9"], "--model not given, and http://127.0.0.1:9/v1/models names no model"),
])
def test_bad_server_arguments(args, message, capsys):
    assert main(["bench", "serve", "--tokenizer", "none", "--no-progress", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err

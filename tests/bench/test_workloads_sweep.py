"""Workloads (random, shared-prefix, file) end to end against tokenmill serve in each load
mode; the prompt makers; `bench sweep` files; `bench sla` search; their bad arguments."""

from __future__ import annotations

import csv
import json

import pytest
from transformers import AutoTokenizer

from tests.bench.conftest import run_bench
from tests.server.conftest import MODEL_NAME, start_server
from tokenmill.bench.workloads import (PromptMaker, file_requests, random_requests, shared_prefix_requests,
                                       text_requests)
from tokenmill.cli import main
from tokenmill.config import DEFAULT_MODEL_DIR


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def server():
    srv = start_server()
    yield srv
    srv.stop()


def test_prompts_have_exact_lengths(tokenizer):
    maker = PromptMaker(tokenizer, seed=3)
    assert maker.exact
    for n in (1, 2, 17, 100, 513):
        text, count = maker.make(n)
        assert count == n == len(tokenizer.encode(text, add_special_tokens=False))
    for r in shared_prefix_requests(6, 2, 40, (5, 9), (3, 3), tokenizer, seed=1):
        assert len(tokenizer.encode(r.prompt, add_special_tokens=False)) == r.prompt_len
    a, b = text_requests(4, (8, 8), (2, 5), tokenizer, seed=7), text_requests(4, (8, 8), (2, 5), tokenizer, seed=7)
    assert a == b and len({r.prompt for r in a}) == 4  # reproducible from the seed, distinct prompts


def test_shared_prefix_requests_share_prefixes(tokenizer):
    requests = shared_prefix_requests(8, 2, 30, (4, 4), (1, 1), tokenizer)
    ids = [tokenizer.encode(r.prompt, add_special_tokens=False) for r in requests]
    assert all(x[:30] == ids[0][:30] for x in ids[::2]) and all(x[:30] == ids[1][:30] for x in ids[1::2])
    assert ids[0][:30] != ids[1][:30] and len({tuple(x[30:]) for x in ids}) == 8


def test_file_workloads(tmp_path, tokenizer):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "def add(a, b):", "output_len": 7}\n\n{"prompt": "import os"}\n')
    requests, note = file_requests(jsonl, 5, (3, 3), tokenizer)
    assert "2 prompts from JSONL" in note and "repeated" in note
    assert sorted({(r.prompt, r.output_len) for r in requests}) == [("def add(a, b):", 7), ("import os", 3)]
    sharegpt = tmp_path / "sg.json"
    reply = "the answer is " + "forty two " * 5
    sharegpt.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "what is six times seven, please?"},
                           {"from": "gpt", "value": reply}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there, friend"}]},
        {"conversations": [{"from": "human", "value": "only one turn here"}]},
    ]))
    requests, note = file_requests(sharegpt, 1, (3, 3), tokenizer)
    assert "1 prompts from ShareGPT" in note  # the short one and the one-turn one are left out
    assert requests[0].output_len == len(tokenizer.encode(reply, add_special_tokens=False))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match="line 2 has no \"prompt\""):
        file_requests(bad, 1, (3, 3), tokenizer)


@pytest.mark.parametrize("workload, load", [
    ("random", ["--max-concurrency", "8"]),
    ("shared-prefix", ["--request-rate", "40"]),
    ("jsonl", ["--request-rate", "inf", "--endpoint", "chat"]),
    ("sharegpt", ["--request-rate", "100", "--burstiness", "0.5", "--max-concurrency", "4", "--endpoint", "chat"]),
])
def test_workloads_against_tokenmill_serve(server, tmp_path, workload, load):
    before = server.wait_idle()
    n = 12
    if workload == "jsonl":
        path = tmp_path / "p.jsonl"
        path.write_text("".join(json.dumps({"prompt": f"def f{i}(x):", "output_len": 5 + i}) + "\n" for i in range(n)))
        spec = ["--workload", f"file:{path}"]
    elif workload == "sharegpt":
        path = tmp_path / "sg.json"
        path.write_text(json.dumps([{"conversations": [
            {"from": "human", "value": f"write a function number {i} that adds two numbers"},
            {"from": "gpt", "value": "def add(a, b):\n    return a + b" + " # ok" * i}]} for i in range(n)]))
        spec = ["--workload", f"file:{path}"]
    else:
        spec = ["--workload", workload, "--input-len", "24", "--output-len", "4:12", "--prefix-len", "32",
                "--num-prefixes", "2"]
    r = run_bench(tmp_path, "--base-url", server.url, "--model", MODEL_NAME, "--num-prompts", str(n), *spec, *load)
    assert r["completed"] == n and r["failed"] == 0 and r["token_counts"] == f"the server's usage: {n} requests"
    m = server.wait_idle()
    assert m["tokenmill:generation_tokens_total"] - before["tokenmill:generation_tokens_total"] == \
        r["total_output_tokens"]
    assert m["tokenmill:prompt_tokens_total"] - before["tokenmill:prompt_tokens_total"] == r["total_input_tokens"]
    if workload == "random":
        assert r["total_input_tokens"] == 24 * n  # exact prompt lengths for the server's tokenizer
    if workload == "shared-prefix":
        assert r["total_input_tokens"] == (32 + 24) * n
        hits = m["tokenmill:prefix_cache_hits_total"] - before["tokenmill:prefix_cache_hits_total"]
        assert hits >= 32 * (n - 2) // 2  # most requests find their 32-token prefix (2 full blocks) cached
    if workload == "jsonl":
        assert r["total_output_tokens"] == sum(5 + i for i in range(n))  # the file's output lengths


def test_sweep_writes_png_csv_json(known_server, tmp_path):
    out = tmp_path / "sweep"
    assert main(["bench", "sweep", "--base-url", known_server, "--model", "shared", "--tokenizer",
                 str(DEFAULT_MODEL_DIR), "--num-prompts", "8", "--input-len", "10", "--output-len", "6",
                 "--concurrency", "1,8", "--no-progress", "--output-dir", str(out)]) == 0
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(out / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    data = json.loads((out / "sweep.json").read_text())
    assert [row["concurrency"] for row in rows] == ["1", "8"] and [p["concurrency"] for p in data["points"]] == [1, 8]
    one, eight = data["points"]
    assert one["completed"] == eight["completed"] == 8
    assert eight["median_tpot_ms"] > 1.5 * one["median_tpot_ms"]  # 8 streams on capacity 4: twice the gap
    assert float(rows[1]["output_throughput"]) == pytest.approx(eight["output_throughput"])
    assert main(["bench", "sweep", "--base-url", known_server, "--model", "known", "--tokenizer",
                 str(DEFAULT_MODEL_DIR), "--num-prompts", "4", "--input-len", "4", "--output-len", "2",
                 "--request-rates", "20,inf", "--no-progress", "--output-dir", str(out)]) == 0
    assert [p["request_rate"] for p in json.loads((out / "sweep.json").read_text())["points"]] == [20, "inf"]


def test_sla_finds_the_highest_concurrency_that_meets_the_slo(known_server, tmp_path):
    # "shared" serves 4 streams at 10 ms a token, c streams at 10 x c/4 ms: TPOT <= 27 ms up to c = 10
    out = tmp_path / "sla.json"
    assert main(["bench", "sla", "--base-url", known_server, "--model", "shared", "--tokenizer",
                 str(DEFAULT_MODEL_DIR), "--num-prompts", "4", "--input-len", "8", "--output-len", "6",
                 "--slo", "p99_tpot_ms=27", "--upper", "32", "--no-progress", "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    levels = {p["concurrency"]: p["meets_slo"] for p in r["probes"]}
    assert levels[1] and levels[2] and levels[4] and levels[8] and not levels[16]
    assert 8 <= r["best"]["concurrency"] <= 11 and r["best"]["p99_tpot_ms"] <= 27
    assert r["best"]["output_throughput"] == max(p["output_throughput"] for p in r["probes"] if p["meets_slo"])
    assert all(p["completed"] >= 4 * p["concurrency"] for p in r["probes"])  # each level held


def test_sla_reports_when_nothing_meets_the_slo(known_server, capsys):
    assert main(["bench", "sla", "--base-url", known_server, "--model", "known", "--tokenizer", str(DEFAULT_MODEL_DIR),
                 "--num-prompts", "2", "--input-len", "4", "--output-len", "2", "--slo", "mean_ttft_ms=1",
                 "--no-progress"]) == 1
    assert "no load level meets the SLO" in capsys.readouterr().out


@pytest.mark.parametrize("command, args, message", [
    ("sweep", [], "exactly one of --concurrency"),
    ("sweep", ["--concurrency", "1,2", "--request-rates", "1"], "exactly one of --concurrency"),
    ("sweep", ["--concurrency", "1,x"], "--concurrency: expected comma-separated integers"),
    ("sweep", ["--request-rates", "2,-1"], "--request-rates: every level must be > 0"),
    ("sla", ["--slo", "ttft_ms=5"], "--slo: expected KEY=MILLISECONDS with KEY in mean_ttft_ms"),
    ("sla", ["--slo", "p99_ttft_ms=5", "--lower", "8", "--upper", "4"], "--lower and --upper"),
    ("sla", ["--slo", "p99_ttft_ms=5", "--rate-tolerance", "2", "--search", "rate"], "--rate-tolerance"),
])
def test_bad_sweep_and_sla_arguments(command, args, message, capsys):
    base = ["bench", command, "--base-url", "http://127.0.0.1:9", "--model", "m", "--tokenizer", "none",
            "--no-progress"]
    assert main(base + args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_random_requests_output_distributions():
    uniform = random_requests(2000, (4, 8), (16, 512), 1000, seed=0)
    logu = random_requests(2000, (4, 8), (16, 512), 1000, seed=0, output_dist="loguniform")
    for reqs in (uniform, logu):
        assert all(16 <= r.output_len <= 512 and 4 <= len(r.prompt) <= 8 for r in reqs)
    # log-uniform: each octave about as likely (16..31 and 256..511 each ~1/5); uniform: ~3% vs ~51%
    low = [sum(16 <= r.output_len < 32 for r in reqs) / 2000 for reqs in (uniform, logu)]
    high = [sum(256 <= r.output_len < 512 for r in reqs) / 2000 for reqs in (uniform, logu)]
    assert low[0] < 0.05 and 0.15 < low[1] < 0.25
    assert 0.45 < high[0] < 0.57 and 0.15 < high[1] < 0.25
    with pytest.raises(ValueError, match="output_dist"):
        random_requests(1, (4, 8), (16, 512), 1000, output_dist="zipf")

"""`tokenmill bench serve` against a server of known timing, against tokenmill serve, and
with bad arguments; the cost arithmetic. (Workloads, sweep and sla: test_workloads_sweep.py.)"""

from __future__ import annotations

import json
import math

import pytest

from tests.bench.conftest import run_bench
from tests.server.conftest import MODEL_NAME, start_server
from tokenmill.bench.metrics import cost_figures, parse_slo
from tokenmill.cli import main
from tokenmill.config import DEFAULT_MODEL_DIR


@pytest.mark.parametrize("concurrency, endpoint", [(1, "completions"), (64, "completions"), (1, "chat")])
def test_known_timing(known_server, tmp_path, concurrency, endpoint):
    n = 64 if concurrency == 64 else 8
    r = run_bench(tmp_path, "--base-url", known_server, "--model", "known", "--num-prompts", str(n),
                  "--input-len", "20", "--output-len", "21", "--max-concurrency", str(concurrency),
                  "--slo", "ttft_ms=1000,tpot_ms=100", "--save-detailed", "--warmup", str(concurrency),
                  "--endpoint", endpoint)
    assert r["completed"] == n and r["failed"] == 0
    assert r["total_output_tokens"] == 21 * n and r["total_input_tokens"] == 20 * n
    # at 64 the known server itself (one Python process) takes its time to accept the burst of
    # 64 requests: on 2 cores the mean TTFT comes out 56-66 ms (measured 2026-11-23; 66 with other
    # work on the machine). So the client may measure more than the server's delays there, never
    # less. One stream measured up to 53.5 ms (chat, in CI); on a slow day (2026-11-29, the same
    # code passing an hour before) the median at one stream came out 56-61 ms in every run.
    late = 12 if concurrency == 1 else 30
    # every request but the slowest within the bounds: one stall of the busy machine may fall on
    # any one (the suite's first request in a fresh-clone CI run took 80 ms at concurrency 1)
    ttfts = sorted(1e3 * (x["chunk_times"][0] - x["start"]) for x in r["requests"])
    assert r["mean_ttft_ms"] == pytest.approx(sum(ttfts) / n, abs=0.01)
    assert 50 - 3 <= r["median_ttft_ms"] <= 50 + late and 50 - 3 <= r["p99_ttft_ms"]
    assert ttfts[0] >= 50 - 3 and ttfts[-2] <= 50 + 2.5 * late
    assert r["mean_tpot_ms"] == pytest.approx(10, abs=1) and r["median_itl_ms"] == pytest.approx(10, abs=2)
    assert 250 - 5 <= r["mean_e2el_ms"] <= 250 + late + 5  # 50 + 20 x 10
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration"])
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # every request meets the SLO
    expected_duration = 0.25 * (n if concurrency == 1 else 1)
    # a busy machine may let the client send late (64 streams of 0.25 s once took 0.54 s, every
    # request on time once sent): the duration counts that, and the records say how late
    sent_late = max(x["start"] - x["scheduled"] for x in r["requests"]) if concurrency > 1 else 0.0
    if concurrency == 1:  # one after another: the client's own time between them counts too (a busy
        # machine once put 28 ms between each, 2.29 s for 8 requests of 0.25 s)
        ordered = sorted(r["requests"], key=lambda x: x["start"])
        gaps = [max(0.0, b["start"] - a["end"]) for a, b in zip(ordered, ordered[1:])]
        # the next request goes as soon as one ends, not after a pause: every gap but the
        # largest (a fresh-clone CI run once stalled 0.29 s between two of them, once)
        assert sorted(gaps)[-2] < 0.1, gaps
        sent_late = sum(gaps)
    assert expected_duration - 0.01 <= r["duration"] <= expected_duration * 1.1 + 0.03 + late / 1000 + sent_late
    assert len(r["requests"]) == n and all(len(x["chunk_times"]) == 21 for x in r["requests"])
    assert r["token_counts"] == f"the server's usage: {n} requests"


@pytest.mark.parametrize("tokenizer, source", [(str(DEFAULT_MODEL_DIR), "the tokenizer"), ("none", "text chunks")])
def test_token_counts_without_usage(known_server, tmp_path, tokenizer, source):
    out = tmp_path / "r.json"
    assert main(["bench", "serve", "--base-url", known_server, "--model", "no-usage", "--tokenizer", tokenizer,
                 "--num-prompts", "4", "--input-len", "12", "--output-len", "9", "--no-progress",
                 "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["completed"] == 4 and r["total_output_tokens"] == 36 and r["total_input_tokens"] == 48
    assert r["token_counts"].startswith(source)
    assert ("approximate" in r["workload"]) == (tokenizer == "none")


def test_request_rate_and_goodput(known_server, tmp_path):
    r = run_bench(tmp_path, "--base-url", known_server, "--model", "known", "--num-prompts", "20",
                  "--input-len", "5", "--output-len", "3", "--request-rate", "40", "--burstiness", "0.5",
                  "--slo", "ttft_ms=1", "--cost-per-hour", "10", "--num-gpus", "2")
    assert r["completed"] == 20 and r["request_goodput"] == 0.0  # nobody gets a token within 1 ms
    assert r["mean_send_lateness_ms"] < 20
    assert r["dollars_per_million_output_tokens"] == pytest.approx(20 / (r["output_throughput"] * 3600) * 1e6)


def test_cost_is_exact():
    c = cost_figures(10_000, cost_per_hour=10.0)
    assert c["dollars_per_million_output_tokens"] == pytest.approx(10 / 36, rel=1e-12)  # $0.2778, not $1
    assert round(c["dollars_per_million_output_tokens"], 2) == 0.28
    assert c["output_tokens_per_dollar"] == pytest.approx(3_600_000)
    assert cost_figures(10_000, 10.0, num_gpus=4)["output_throughput_per_gpu"] == 2_500
    assert math.isclose(cost_figures(10_000, 10.0, num_gpus=4)["dollars_per_million_output_tokens"], 40 / 36)


def test_against_tokenmill_serve(tmp_path):
    srv = start_server()
    try:
        r = run_bench(tmp_path, "--base-url", srv.url, "--model", MODEL_NAME, "--num-prompts", "16",
                      "--input-len", "8:32", "--output-len", "4:16", "--max-concurrency", "8", "--warmup", "2")
        assert r["completed"] == 16 and r["failed"] == 0
        m = srv.wait_idle()
        assert m["tokenmill:request_finished_total{finished_reason=length}"] == 18  # warm-up included
        assert m["tokenmill:generation_tokens_total"] >= r["total_output_tokens"] >= 16 * 4
    finally:
        srv.stop()


@pytest.mark.parametrize("args, message", [
    (["--request-rate", "-1"], "--request-rate"),
    (["--slo", "ttft=5"], "--slo"),
    (["--slo", "ttft_ms=abc"], "--slo: ttft_ms"),
    (["--max-concurrency", "0"], "--max-concurrency"),
    (["--input-len", "5:2"], "--input-len"),
    (["--base-url", "ftp://x"], "--base-url"),
    (["--base-url", "http://127.0.0.1:9"], "cannot reach"),
    (["--workload", "sharegpt"], "--workload must be one of"),
    (["--workload", "file:/does/not/exist.jsonl"], "cannot read"),
    (["--workload", "shared-prefix", "--prefix-len", "0"], "--prefix-len"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--cost-per-hour", "-2"], "--cost-per-hour"),
    (["--tokenizer", "/does/not/exist"], "--tokenizer: cannot load"),
])
def test_bad_arguments(args, message, capsys):
    base = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--tokenizer", str(DEFAULT_MODEL_DIR),
            "--no-progress"]
    assert main(base + args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_server_errors_are_counted(known_server, tmp_path, capsys):
    out = tmp_path / "r.json"
    code = main(["bench", "serve", "--base-url", known_server, "--model", "broken", "--tokenizer",
                 str(DEFAULT_MODEL_DIR), "--num-prompts", "3", "--no-progress", "--output-json", str(out)])
    assert code == 1
    r = json.loads(out.read_text())
    assert r["completed"] == 0 and r["failed"] == 3
    assert "broken on purpose" in capsys.readouterr().out


def test_parse_slo():
    assert parse_slo("ttft_ms=200, tpot_ms=50") == {"ttft_ms": 200.0, "tpot_ms": 50.0}
    with pytest.raises(ValueError, match="ttft_ms must be > 0"):
        parse_slo("ttft_ms=0")

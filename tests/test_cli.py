"""The command line: generate streams text, bench throughput writes its JSON, bad flags exit 2."""

from __future__ import annotations

import json
import re
import sys

import pytest

from tokenmill.cli import ENGINE_FLAGS, main
from tokenmill.config import EngineConfig


def test_every_engine_argument_has_a_flag():
    assert {dest for dest, _ in ENGINE_FLAGS.values()} == set(EngineConfig.field_names())


def test_generate_streams_text(checkpoints, capsys):
    rc = main(["generate", "def foo():", "--model", str(checkpoints("llama")), "--max-tokens", "5",
               "--kv-cache-memory", "8MiB", "--async-scheduling"])  # each step's tokens in the next call
    assert rc == 0
    assert capsys.readouterr().out.startswith("def foo():")


def test_generate_takes_penalties_bias_and_bad_words(capsys):
    """The built-in model, greedy, repeats itself ("the list of the list of ..."): banning the
    word it repeats takes it out of the text."""
    argv = ["generate", "def add(a, b):", "--max-tokens", "12"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert main(argv + ["--frequency-penalty", "1.5", "--presence-penalty", "0.5", "--repetition-penalty", "1.3",
                        "--logit-bias", '{"5": -100}', "--bad-words", "list"]) == 0
    penalised = capsys.readouterr().out
    assert plain.count("list") >= 2 and "list" not in penalised


def test_generate_takes_structured_outputs(capsys):
    assert main(["generate", "The answer is", "--structured-outputs", '{"regex": "[0-9]{3}"}',
                 "--temperature", "1", "--sample-seed", "3"]) == 0
    out = capsys.readouterr().out
    assert re.fullmatch(r"The answer is[0-9]{3}\n", out), out
    assert main(["generate", "x", "--structured-outputs", "[1]"]) == 2
    assert "--structured-outputs: expected a JSON object" in capsys.readouterr().err


def test_bench_throughput_writes_json(checkpoints, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["bench", "throughput", "--model", str(checkpoints("llama")), "--num-prompts", "6",
               "--input-len", "4:20", "--output-len", "3:9", "--seed", "1", "--kv-cache-memory", "8MiB",
               "--no-progress", "--output-json", str(out), "--scheduler", "static"])
    assert rc == 0
    result = json.loads(out.read_text())
    for key in ("num_requests", "elapsed_s", "input_tokens", "output_tokens", "request_throughput",
                "output_throughput", "total_token_throughput"):
        assert key in result
    assert result["num_requests"] == 6 and 18 <= result["output_tokens"] <= 54
    assert result["output_throughput"] == pytest.approx(result["output_tokens"] / result["elapsed_s"])
    assert "output_throughput" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["bench", "throughput", "--input-len", "9:3"], "--input-len: expected N or MIN:MAX"),
    (["bench", "throughput", "--output-len", "x"], "--output-len"),
    (["bench", "throughput", "--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["generate", "hi", "--max-tokens", "0"], "max_tokens must be an integer >= 1"),
    (["generate", "hi", "--model", "/nonexistent/dir"], "not a checkpoint directory"),
    (["generate", "hi", "--frequency-penalty", "3"], "frequency_penalty must be in [-2, 2]"),
    (["generate", "hi", "--logit-bias", "[1]"], "--logit-bias: expected a JSON object"),
    (["generate", "hi", "--async-scheduling", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
     "async_scheduling does not run with speculative_config"),
])
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("tenants, message", [
    ('{"tenants": [{"name": "a", "api_keys": ["k"], "tokens_per_minute": -5}]}', "tenant 'a': tokens_per_minute"),
    ('{"tenants": [{"name": "a", "api_keys": ["k"]}, {"name": "b", "api_keys": ["k"]}]}', "tenant 'b': api_keys"),
    ('{"tenants": [{"name": "a", "api_keys": ["k"], "burst": 5}]}', "tenant 'a': burst: unknown field"),
    ('{"tenants": [', "is not valid JSON"),
])
def test_serve_refuses_a_bad_tenants_file_before_loading_the_model(tmp_path, tenants, message, capsys):
    path = tmp_path / "tenants.json"
    path.write_text(tenants)
    assert main(["serve", "--tenants", str(path), "--model", "/nonexistent/dir"]) == 2
    err = capsys.readouterr().err
    assert f"{path}: " in err and message in err


@pytest.mark.parametrize("argv, message", [
    (["--api-key", "k", "--tenants", "t.json"], "--api-key and --tenants: give one"),
    (["--admin-key", "k"], "need --tenants FILE"),
    (["--tenants", "t.json", "--admin-key", " "], "--admin-key: must not be empty"),
    (["--tenants", "t.json", "--admin-key", "k"], "--admin-key: is also a tenant's API key"),
    (["--api-key", "k", "--limits-store", "http://x"], "--limits-store: expected redis://HOST:PORT"),
])
def test_serve_refuses_tenant_flags_that_do_not_go_together(argv, message, capsys, tmp_path):
    (tmp_path / "t.json").write_text('{"tenants": [{"name": "a", "api_keys": ["k"]}]}')
    argv = [a.replace("t.json", str(tmp_path / "t.json")) for a in argv]
    assert main(["serve", *argv, "--model", "/nonexistent/dir"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--ray-address", "auto"], "--ray-address is for --distributed-executor-backend ray"),
    (["--distributed-executor-backend", "ray", "--engine-in-thread"], "drop --engine-in-thread"),
    (["--distributed-executor-backend", "ray"], "needs Ray: pip install 'tokenmill[ray]'"),
])
def test_serve_refuses_ray_flags_that_cannot_run(argv, message, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed: `import ray` fails
    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err

"""The benchmarks' step timeline (tokenmill/bench/steps.py) and linear-time split
(bench/offline.py) on a real tiny engine."""

from __future__ import annotations

import pytest

from tokenmill import LLM
from tokenmill.bench.offline import run_throughput
from tokenmill.bench.steps import StepTimeline
from tokenmill.bench.workloads import random_requests
from tokenmill.executor.model_runner import ModelRunner


def test_timeline_counts_every_step_and_its_parts_add_up(checkpoints):
    llm = LLM(str(checkpoints("llama")), device="cpu", dtype="float32", max_num_seqs=4)
    runner = llm.engine.runner
    requests = random_requests(6, (5, 20), (3, 9), 200, seed=1)
    steps0 = llm.engine.total_steps
    with StepTimeline(llm) as timeline:
        result = run_throughput(llm, requests, use_tqdm=False)
    summary = timeline.summary(result.elapsed_s)
    assert summary["steps"] == llm.engine.total_steps - steps0 == result.num_steps > 1
    assert summary["device_ms"] == 0.0  # no CUDA device: only the host side counts
    parts = summary["launch_ms"] + summary["finish_ms"] + summary["other_host_ms"]
    assert abs(parts - summary["step_ms"]) < 1e-6 and summary["launch_ms"] > 0 and summary["other_host_ms"] > 0
    # the runner's own methods again once the timeline is left
    assert runner.launch.__func__ is ModelRunner.launch and runner.finish.__func__ is ModelRunner.finish
    assert runner._forward.__func__ is ModelRunner._forward


def test_linear_time_split_times_each_part_and_lets_go(checkpoints):
    """The int8 benchmark's Amdahl split (bench/offline.py): every part gets time, the parts
    add up to the run, and the layers run their class's forward again afterwards."""
    from tokenmill.bench.offline import linear_time_split
    from tokenmill.executor.layers.linear import Linear

    llm = LLM(str(checkpoints("llama")), device="cpu", dtype="float32", max_num_seqs=4)
    split = linear_time_split(llm, random_requests(4, (5, 20), (3, 9), 200, seed=2))
    assert split["layers"] > 0 and split["lm_head"] > 0 and split["rest"] > 0
    assert abs(split["layers"] + split["lm_head"] + split["rest"] - split["total"]) < 1e-9
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    assert linears and all("forward" not in vars(m) for m in linears)


@pytest.mark.parametrize("name", ["llama", "llama_tied_llama3rope"])
def test_bytes_per_step_counts_stored_weights_and_decoded_contexts(checkpoints, name):
    """The FP8 rows' bound (gpu_quant.py): weights in the bytes they are stored in, and the
    K/V of every decoded token's context in the cache's dtype, spread over the steps."""
    from tokenmill.bench.steps import bytes_per_step
    from tokenmill.bench.workloads import BenchRequest
    from tokenmill.executor.layers.linear import Linear

    # the first request decodes its outputs 2..4 over contexts of 11, 12 and 13 tokens; a
    # one-token output decodes nothing
    requests = [BenchRequest([20] * 10, 4, 10), BenchRequest([20] * 3, 1, 3)]
    runs, models = {}, {}
    for key, kwargs in {"float32": {}, "int8": {"quantization": "int8", "kv_cache_dtype": "int8"}}.items():
        llm = LLM(str(checkpoints(name)), device="cpu", dtype="float32", **kwargs)
        runs[key], models[key] = bytes_per_step(llm, requests, steps=3), llm.engine.runner.model
        per_token = llm.engine.model_config.kv_bytes_per_token(llm.engine.runner.kv_cache_dtype)
        assert runs[key]["kv"] == (11 + 12 + 13) * per_token / 3
        assert runs[key]["total"] == runs[key]["weights"] + runs[key]["kv"]
    model = models["float32"]
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    # float32: every linear weight (the LM head included, tied or not) and norm 4 bytes; the
    # embedding table is only looked up
    expected = 4 * (sum(m.in_features * m.out_features for m in linears) + sum(p.numel() for p in norms))
    assert runs["float32"]["weights"] == expected
    # int8: the layers' weights a byte each, the head and the rest still float32
    quantized = [m for m in models["int8"].modules() if isinstance(m, Linear) and m.quant_method is not None]
    assert quantized and runs["int8"]["weights"] == expected - 3 * sum(m.in_features * m.out_features
                                                                       for m in quantized)
    assert runs["int8"]["kv"] < 0.4 * runs["float32"]["kv"]  # a byte an element and a scale a row

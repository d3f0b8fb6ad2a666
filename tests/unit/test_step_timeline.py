"""The benchmarks' step timeline (tokenmill/bench/steps.py) and linear-time split
(bench/offline.py) on a real tiny engine."""

from __future__ import annotations

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

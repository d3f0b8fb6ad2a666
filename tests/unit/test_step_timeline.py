"""The benchmark's step timeline (tokenmill/bench/steps.py) on a real tiny engine."""

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

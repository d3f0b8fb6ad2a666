"""Offline throughput: one in-process engine, all requests at once, ignore_eos."""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tokenmill.bench.workloads import BenchRequest
from tokenmill.config import DEFAULT_MODEL_DIR
from tokenmill.llm import LLM
from tokenmill.sampling_params import SamplingParams


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def copy_tokenizer(path: Path) -> None:
    """The built-in model's tokenizer files into a checkpoint directory a benchmark made."""
    for f in TOKENIZER_FILES:
        shutil.copy(DEFAULT_MODEL_DIR / f, path / f)


@dataclass(slots=True)
class ThroughputResult:
    num_requests: int
    elapsed_s: float
    input_tokens: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    num_steps: int
    num_preemptions: int

    def to_dict(self) -> dict:
        return asdict(self)


def run_throughput(llm: LLM, requests: list[BenchRequest], use_tqdm: bool = True,
                   temperature: float = 0.0, **sampling) -> ThroughputResult:
    """sampling: more SamplingParams for every request (penalties, logit_bias, ...)."""
    prompts = [{"prompt_token_ids": r.prompt} for r in requests]
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=temperature, detokenize=True,
                             **sampling) for r in requests]
    engine = llm.engine
    steps0, preempt0 = engine.total_steps, engine.scheduler.num_preemptions
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    input_tokens = sum(r.prompt_len for r in requests)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return ThroughputResult(
        num_requests=len(requests),
        elapsed_s=elapsed,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        request_throughput=len(requests) / elapsed,
        output_throughput=output_tokens / elapsed,
        total_token_throughput=(input_tokens + output_tokens) / elapsed,
        num_steps=engine.total_steps - steps0,
        num_preemptions=engine.scheduler.num_preemptions - preempt0,
    )


def linear_time_split(llm: LLM, requests: list[BenchRequest]) -> dict[str, float]:
    """One run of the requests with a timer around every linear layer: seconds in the decoder
    layers' linears, in the LM head, and in everything else (attention, norms, sampling, the
    step's Python), for an Amdahl bound on what faster linears can give. The CPU runs ops
    as they are called, so the timers see each layer's whole cost. The one-call forward
    (executor/fused_decoder.py), whose layers are not the modules, is off for the run."""
    from tokenmill.executor.layers.linear import Linear

    runner = llm.engine.runner
    fused, runner.fused = runner.fused, None
    seconds = {"layers": 0.0, "lm_head": 0.0}
    timed = []
    for name, module in llm.engine.runner.model.named_modules():
        if isinstance(module, Linear):
            part = "lm_head" if name.endswith("lm_head") else "layers"

            def forward(x, call=module.forward, part=part):
                t = time.perf_counter()
                y = call(x)
                seconds[part] += time.perf_counter() - t
                return y

            module.forward = forward
            timed.append(module)
    try:
        elapsed = run_throughput(llm, requests, use_tqdm=False).elapsed_s
    finally:
        for module in timed:
            del module.forward  # back to the class's forward
        runner.fused = fused
    return {**seconds, "rest": elapsed - seconds["layers"] - seconds["lm_head"], "total": elapsed}

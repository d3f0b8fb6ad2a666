"""Timing the engine's decode steps: a batch of requests past their prompts, then steps
that compute one token each. Used by benchmarks/gpu_throughput.py (step times against the
memory roofline, the torch profiler's and cProfile's view of a step) and
benchmarks/host_overhead.py (the host's share of a step on the CPU)."""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from tokenmill.executor import model_runner
from tokenmill.llm import LLM
from tokenmill.sampling_params import SamplingParams


def _cuda() -> bool:
    return torch.cuda.is_available()


def _sync() -> None:
    if _cuda():
        torch.cuda.synchronize()


def stored_weight_bytes(model: torch.nn.Module) -> int:
    """The bytes a forward reads of the weights, as the engine keeps them: a linear layer's
    weight in its stored dtype (8 bits for int8/FP8 W8A8; on the CPU its packed layout), and
    the other parameters (norms) except the embedding table, of which a step reads only its
    tokens' rows (a tied LM head reads all of it, as a linear layer)."""
    from tokenmill.executor.distributed.parallel import VocabParallelEmbedding
    from tokenmill.executor.layers.linear import Linear

    seen, total = set(), 0

    def count(t: torch.Tensor | None) -> None:
        nonlocal total
        key = None if t is None or t.is_mkldnn else t.data_ptr()  # oneDNN's tensors have no data pointer
        if t is not None and t.numel() and (key is None or key not in seen):
            seen.add(key)
            total += t.numel() * t.element_size()

    for m in model.modules():
        if isinstance(m, Linear):
            # the CPU's int8 packings (fbgemm's, amx_int8_linear's): a step reads one, a byte a weight
            if getattr(m, "packed_int8", None) is not None or getattr(m, "amx_int8", None) is not None:
                total += m.in_features * m.out_features
            count(m.packed)  # oneDNN's layout on the CPU (a step reads it or the plain copy, not both)
            if m.packed is None:  # (small_linear's copy, where it is the only one: layers/linear.py's SMALL_ONLY)
                count(m.small if m.small is not None else m.weight)
    looked_up = {p.data_ptr() for m in model.modules() if isinstance(m, (torch.nn.Embedding, VocabParallelEmbedding))
                 for p in m.parameters()}
    for t in model.parameters():
        if t.data_ptr() not in looked_up:
            count(t)
    return total


def bytes_per_step(llm: LLM, requests, steps: int) -> dict[str, float]:
    """What a run's average step reads from memory: every weight once (stored_weight_bytes),
    and the K/V of each decoded token's context, in the cache's dtype (scales included).
    Two runs of one workload give the most a change of bytes can gain: the ratio of their
    sums. Prompt chunks' K/V reads are left out (a prompt is read about once; a decode step
    reads every context again)."""
    runner = llm.engine.runner
    kv_per_token = llm.engine.model_config.kv_bytes_per_token(runner.kv_cache_dtype)
    # a request decodes its outputs after the first (that one comes with the prompt's
    # forward) over contexts of prompt + 1 .. prompt + output - 1 tokens
    contexts = sum((r.output_len - 1) * r.prompt_len + r.output_len * (r.output_len - 1) // 2 for r in requests)
    weights = stored_weight_bytes(runner.model)
    kv = contexts * kv_per_token / max(1, steps)
    return {"weights": weights, "kv": kv, "total": weights + kv}


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy, bytes read plus written per second (best of 10)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * nbytes / best


def decode_step_time(llm: LLM, batch: int, context: int, steps: int = 30) -> tuple[float, float, float]:
    """Median wall time of a decode-only step of `batch` requests at ~`context` tokens, each
    call synced on its own; the GPU's idle time per step (wall time minus the time the GPU
    spent in the step); and the median time between the returns of `steps` calls in a row,
    not synced (with async scheduling the host's work of one overlaps the GPU's of the next:
    this is the step time a throughput run sees). A median, as the synced time is: on an H100
    the mean of 30 steps in a row at batch 1 came out above the synced median (2.78 against
    2.02 ms), as one pause among them (a collection, a stall) would make it."""
    engine = llm.engine
    fill_decode_batch(engine, batch, context, 2 * steps + 8)  # prompts first: what is timed are decode-only steps
    engine.step()  # with async scheduling the fill's last step is still in flight: not timed
    _sync()
    returns = [time.perf_counter()]
    for _ in range(steps):
        engine.step()
        returns.append(time.perf_counter())
    _sync()
    pipelined = float(np.median(np.diff(returns)))
    walls, gpu = [], []
    for _ in range(steps):
        ev0, ev1 = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if _cuda() \
            else (None, None)
        _sync()
        t0 = time.perf_counter()
        if ev0 is not None:
            ev0.record()
        engine.step()
        if ev1 is not None:
            ev1.record()
        _sync()
        walls.append(time.perf_counter() - t0)
        gpu.append(ev0.elapsed_time(ev1) / 1e3 if ev0 is not None else walls[-1])
    drain(engine)
    walls.sort()
    idle = sorted(w - g for w, g in zip(walls, gpu))
    return walls[len(walls) // 2], idle[len(idle) // 2], pipelined


def fill_decode_batch(engine, batch: int, context: int, max_tokens: int, final_only: bool = False,
                      detokenize: bool = False) -> None:
    """`batch` greedy requests of `context` prompt tokens, prefilled: the next steps are decode-only."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, detokenize=detokenize)
    for i in range(batch):
        request, _ = engine.make_request([(7 * i + j) % 8000 + 10 for j in range(context)], params,
                                         request_id=f"step-{i}")
        engine.add_request(request, final_only=final_only)
    scheduler = engine.scheduler
    while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        engine.step()


def drain(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def profile_decode_steps(llm: LLM, batch: int, context: int, steps: int = 10) -> tuple[float, float, list]:
    """Wall time per decode step, GPU kernel time per step, and the top kernels (name, ms per step).
    The profiler under-counts kernels inside CUDA graph replays (on an H200 its decode-attention
    time meant 5.8 TB/s, above the memory's rate): StepTimeline's device events are the check."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    fill_decode_batch(engine, batch, context, steps + 8)
    for _ in range(3):
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if _cuda() else [])
    with profile(activities=activities) as prof:
        _sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync()
        wall = (time.perf_counter() - t0) / steps
    drain(engine)
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in kernels) / 1e6 / steps
    top = sorted(((e.key, e.self_device_time_total / 1e3 / steps) for e in kernels), key=lambda x: -x[1])[:12]
    return wall, total, top


def profile_host(llm: LLM, batch: int, context: int, steps: int = 10) -> str:
    """cProfile of `steps` decode steps: where the host's time goes while the GPU waits."""
    import cProfile
    import io
    import pstats

    engine = llm.engine
    fill_decode_batch(engine, batch, context, steps + 8)
    for _ in range(3):
        engine.step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    _sync()
    prof.disable()
    drain(engine)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    return text.getvalue()


class StepTimeline:
    """Where a run's time goes, step by step: while it is entered, each step's device work is
    bracketed by device events, one recorded as its forward is queued (after the host built
    its inputs) and one after its sampling is queued, so the time between is the device's for
    the step (with any wait for the host's launches inside it); every `runner.launch` and
    `runner.finish` is timed on the host (finish: mostly the wait for the step's ids). Whether
    the host and the device overlap shows as: device-bound, the device's time is the run's;
    host-bound, the wait is near zero; serialized, the two add up. On the CPU only the host
    side counts."""

    def __init__(self, llm: LLM) -> None:
        self.runner = llm.engine.runner
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.launch_s = self.finish_s = 0.0
        self.steps = 0

    def __enter__(self) -> StepTimeline:
        runner, launch, finish, forward = self.runner, self.runner.launch, self.runner.finish, self.runner._forward
        started: list[torch.cuda.Event] = []

        def marked_forward(*args, **kwargs):
            if _cuda():
                started.append(torch.cuda.Event(enable_timing=True))
                started[-1].record()
            return forward(*args, **kwargs)

        def timed_launch(*args, **kwargs):
            t0 = time.perf_counter()
            started.clear()
            launched = launch(*args, **kwargs)
            if started:
                done = torch.cuda.Event(enable_timing=True)
                done.record()
                self.events.append((started[0], done))
            self.launch_s += time.perf_counter() - t0
            self.steps += 1
            return launched

        def timed_finish(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return finish(*args, **kwargs)
            finally:
                self.finish_s += time.perf_counter() - t0

        runner.launch, runner.finish, runner._forward = timed_launch, timed_finish, marked_forward
        return self

    def __exit__(self, *exc) -> None:
        del self.runner.launch, self.runner.finish, self.runner._forward  # the class's methods again

    def summary(self, elapsed: float) -> dict[str, float]:
        """Milliseconds per step: the run's, the device's, the host's launches and waits."""
        _sync()
        device = sum(a.elapsed_time(b) for a, b in self.events) / 1e3
        n = max(1, self.steps)
        return {"steps": self.steps, "step_ms": elapsed / n * 1e3, "device_ms": device / n * 1e3,
                "launch_ms": self.launch_s / n * 1e3, "finish_ms": self.finish_s / n * 1e3,
                "other_host_ms": (elapsed - self.launch_s - self.finish_s) / n * 1e3}


@contextlib.contextmanager
def torch_layer_ops(on: bool):
    """Engines built inside run their layers' norms, rotary and activation in torch ops
    instead of the Triton layer kernels (the CPU kernels stay on the CPU)."""
    original = model_runner.select_layer_kernels
    if on:
        model_runner.select_layer_kernels = lambda attention_backend, cpu_kernels: cpu_kernels
    try:
        yield
    finally:
        model_runner.select_layer_kernels = original

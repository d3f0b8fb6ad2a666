"""Hugging Face transformers as the baseline the benchmarks measure against: `generate` in
static batches, and its continuous batching (`generate_batch`)."""

from __future__ import annotations

import time

import torch

from tokenmill.bench.workloads import BenchRequest


def hf_static_throughput(model, requests: list[BenchRequest], batch_size: int) -> dict:
    """HF generate over static batches in arrival order: left-padded prompts, every batch runs
    to its longest output; only the requested tokens count (as vLLM's HF baseline does)."""
    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width = max(len(r.prompt) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(batch):
            ids[j, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[j, width - len(r.prompt):] = 1
        max_new = max(r.output_len for r in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new,
                           min_new_tokens=max_new, do_sample=False, pad_token_id=0)
    sync()
    elapsed = time.perf_counter() - start
    output_tokens = sum(r.output_len for r in requests)
    return {"batch_size": batch_size, "elapsed_s": elapsed, "output_tokens": output_tokens,
            "output_throughput": output_tokens / elapsed}


def hf_model(shape: dict, dtype: str):
    import transformers

    config = transformers.AutoConfig.for_model(**{k: v for k, v in shape.items() if k != "architectures"})
    torch_dtype = getattr(torch, dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    return model.eval()


def hf_continuous(model, requests, output_len: int) -> dict:
    """transformers' continuous batching (`generate_batch`: paged attention, its own CUDA graphs).
    The first call sizes its manager for this workload, warms up and is kept
    (persistent_manager); the second, on the warm manager, is the one that counts."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    runs = []
    try:
        for _ in range(2):
            sync()
            start = time.perf_counter()
            with torch.no_grad():  # not inference_mode: its worker thread updates tensors made here
                outputs = model.generate_batch(inputs=[r.prompt for r in requests], generation_config=config,
                                               persistent_manager=True)
            sync()
            elapsed = time.perf_counter() - start
            tokens = sum(len(o.generated_tokens) for o in outputs.values())
            runs.append({"elapsed_s": elapsed, "output_tokens": tokens, "output_throughput": tokens / elapsed})
            print(f"  HF continuous batching: {elapsed:.1f}s, {tokens / elapsed:,.0f} tok/s", flush=True)
    finally:
        model.destroy_cached_continuous_batching_manager()
    return {**runs[-1], "cold_run": runs[0]}

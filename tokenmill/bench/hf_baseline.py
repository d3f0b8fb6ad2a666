"""Hugging Face transformers as the baseline the benchmarks measure against."""

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

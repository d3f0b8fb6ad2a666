"""The attention backend registry: what `auto` picks, and the errors at start-up for what a
backend cannot serve (naming the backend, the value and what is supported)."""

from __future__ import annotations

import sys

import pytest
import torch

from tokenmill import LLM
from tokenmill.config import EngineConfig
from tokenmill.executor.attention import select_attention_backend
from tokenmill.executor.cpu_kernels import load_cpu_kernels
from tokenmill.executor.cuda_graphs import graph_buckets, graph_rows

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_picks_cpu_kernels_on_the_cpu_and_triton_on_cuda():
    expected = "cpu" if load_cpu_kernels() is not None else "torch"
    assert select_attention_backend("auto", CPU, torch.float32, 64, 16).name == expected
    pytest.importorskip("triton")
    assert select_attention_backend("auto", CUDA, torch.bfloat16, 128, 16).name == "triton"


def test_unknown_backend_is_refused_by_the_config():
    with pytest.raises(ValueError, match="attention_backend must be one of auto, cpu, torch, triton"):
        EngineConfig(attention_backend="flash")


def test_cpu_backend_refuses_cuda():
    with pytest.raises(ValueError, match="attention_backend='cpu' runs on the CPU only"):
        select_attention_backend("cpu", CUDA, torch.bfloat16, 128, 16)


@pytest.mark.parametrize("head_dim, block_size, message", [
    (320, 16, "supports head dims 1..256 .* not 320"),
    (128, 8, "supports block_size 16, 32, 64, 128 or 256, not 8"),
])
def test_triton_refuses_unsupported_shapes(head_dim, block_size, message):
    pytest.importorskip("triton")
    with pytest.raises(ValueError, match=message):
        select_attention_backend("triton", CUDA, torch.bfloat16, head_dim, block_size)


def test_triton_on_the_cpu_needs_the_interpreter(monkeypatch):
    triton_backend = pytest.importorskip("tokenmill.executor.attention.triton")
    monkeypatch.setattr(triton_backend, "INTERPRET", False)
    with pytest.raises(ValueError, match="attention_backend='triton' needs a CUDA device"):
        select_attention_backend("triton", CPU, torch.float32, 64, 16)


def test_triton_not_installed_names_the_backend(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton now fails
    monkeypatch.delitem(sys.modules, "tokenmill.executor.attention.triton", raising=False)
    with pytest.raises(ValueError, match="attention_backend='triton' cannot be used: .*triton"):
        select_attention_backend("triton", CUDA, torch.bfloat16, 128, 16)


def test_engine_uses_the_backend_it_was_given(checkpoints):
    llm = LLM(str(checkpoints("llama")), dtype="float32", kv_cache_memory="8MiB", attention_backend="torch")
    assert llm.engine.runner.attn.name == "torch"
    with pytest.raises(ValueError, match="attention_backend='cpu' runs on the CPU only"):
        select_attention_backend("cpu", CUDA, torch.float32, 16, 16)


def test_graph_buckets_follow_vllm():
    assert graph_buckets(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert graph_buckets(1) == [1]
    assert graph_buckets(320)[-6:] == [248, 256, 272, 288, 304, 320]  # steps of 16 above 256 (vLLM's)
    assert graph_rows(64, 1) == 64 and graph_rows(64, 5) == 320 and graph_rows(256, 5) == 512
    assert graph_rows(600, 5) == 600  # never fewer rows than a decode a request
    assert graph_rows(64, 5, max_tokens=128) == 128  # nor more than a step's tokens

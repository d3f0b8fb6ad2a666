"""Linear layers on the CPU: oneDNN's packed layout, and for small float32 weights their plain
copy at steps of up to SMALL_ROWS rows (through the CPU kernels' small_linear, or MKL's GEMM
up to PLAIN_ROWS rows without them: tests/unit/test_cpu_kernels.py); all give F.linear's
result. These tests take the packed layout (SMALL_ONLY off, as on a CPU with AVX-512);
test_cpu_kernels.py tests the layers with small_linear's copy alone."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tokenmill.executor.layers import linear
from tokenmill.executor.layers.linear import PLAIN_ROWS, SMALL_FLOAT32_WEIGHT, Linear


@pytest.fixture(autouse=True)
def packed_layout(monkeypatch):
    monkeypatch.setattr(linear, "SMALL_ONLY", False)


def packed_layer(out_features: int, in_features: int, bias: bool, dtype=torch.float32) -> tuple[Linear, torch.Tensor]:
    torch.manual_seed(0)
    layer = Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features) / in_features ** 0.5)
        if bias:
            layer.bias.copy_(torch.randn(out_features))
    layer.to(dtype)
    weight = layer.weight.detach().clone()
    layer.pack()
    return layer, weight


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, PLAIN_ROWS, PLAIN_ROWS + 1, 64])
def test_small_float32_layers_keep_a_plain_copy_for_few_rows(rows, bias, monkeypatch):
    layer, weight = packed_layer(256, 128, bias)
    assert layer.packed is not None and layer.small is not None and layer.weight.numel() == 0
    x = torch.randn(rows, 128)
    assert torch.allclose(layer(x), F.linear(x, weight, layer.bias), atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(linear, "load_cpu_kernels", lambda: None)  # as where the kernels do not build
    layer, weight = packed_layer(256, 128, bias)
    assert layer.small_kernel is None and torch.equal(layer.small, weight)
    assert torch.allclose(layer(x), F.linear(x, weight, layer.bias), atol=1e-5, rtol=1e-5)
    if rows <= PLAIN_ROWS:  # the plain copy's path: exactly F.linear
        assert torch.equal(layer(x), F.linear(x, weight, layer.bias))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")
def test_large_float32_layers_keep_only_the_packed_weight():
    layer, weight = packed_layer(SMALL_FLOAT32_WEIGHT // 128, 128, False)
    assert layer.packed is not None and layer.small is None
    x = torch.randn(2, 128)
    assert torch.allclose(layer(x), F.linear(x, weight), atol=1e-5, rtol=1e-5)


def test_packed_calls_round_their_rows_to_a_few_sizes():
    """oneDNN compiles a kernel per shape: a packed call computes its rows rounded up (at most
    1/8 more), so that a model's layers have a few shapes whatever the steps' sizes."""
    from tokenmill.executor.layers.linear import packed_rows
    sizes = [packed_rows(n) for n in range(1, 2049)]
    assert sizes[:16] == list(range(1, 17))
    assert all(n <= p <= n * 9 / 8 for n, p in zip(range(1, 2049), sizes))
    assert sizes == sorted(sizes) and len(set(sizes)) == 72
    assert [packed_rows(n) for n in (17, 18, 33, 1000, 2048)] == [18, 18, 36, 1024, 2048]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_call_of_rounded_rows_gives_the_layers_product(dtype):
    layer, weight = packed_layer(SMALL_FLOAT32_WEIGHT // 128, 128, True, dtype)
    for rows in (17, 33, 100):
        x = torch.randn(rows, 128).to(dtype)
        y = layer(x)
        assert y.shape == (rows, layer.out_features)
        assert torch.allclose(y.float(), F.linear(x, weight, layer.bias).float(), atol=2e-2, rtol=2e-2)

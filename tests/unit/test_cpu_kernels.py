"""The fused CPU kernels against the PyTorch ops they replace."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tokenmill.executor.cpu_kernels import load_cpu_kernels

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)]


@pytest.fixture(scope="module")
def kernels():
    k = load_cpu_kernels()
    if k is None:
        pytest.skip("CPU kernels could not be built here")
    return k


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("rows", [1, 37])
def test_rms_norm_with_and_without_residual(kernels, dtype, tol, rows):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    res = torch.randn(rows, 96, generator=g).to(dtype)
    w = torch.randn(96, generator=g).to(dtype)
    ref = F.rms_norm(x.float(), (96,), w.float(), 1e-6)
    assert torch.allclose(kernels.rms_norm(x, None, w, 1e-6).float(), ref, atol=tol, rtol=tol)
    summed = (x + res)  # rounded to dtype, as the model's residual stream is
    res_inplace = res.clone()
    out = kernels.rms_norm(x, res_inplace, w, 1e-6)
    assert torch.equal(res_inplace, summed)
    assert torch.allclose(out.float(), F.rms_norm(summed.float(), (96,), w.float(), 1e-6), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_rotary_in_place_on_strided_rows(kernels, dtype, tol):
    g = torch.Generator().manual_seed(1)
    tokens, heads, dim = 11, 3, 32
    qkv = torch.randn(tokens, 5 * dim, generator=g).to(dtype)  # rows wider than the rotated heads
    x = qkv[:, :heads * dim].view(tokens, heads, dim)
    positions = torch.randint(0, 50, (tokens,), generator=g)
    freqs = torch.outer(torch.arange(64, dtype=torch.float32), torch.rand(dim // 2, generator=g))
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    cos = torch.cat((freqs.cos(), freqs.cos()), -1)[positions].unsqueeze(1)
    sin = torch.cat((freqs.sin(), freqs.sin()), -1)[positions].unsqueeze(1)
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    ref = xf * cos + torch.cat((-x2, x1), dim=-1) * sin
    untouched = qkv[:, heads * dim:].clone()
    kernels.rotary(x, positions, cos_sin)
    assert torch.allclose(x.float(), ref, atol=tol, rtol=tol)
    assert torch.equal(qkv[:, heads * dim:], untouched)


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_silu_and_mul(kernels, dtype, tol):
    gate_up = (torch.randn(13, 2 * 80, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    assert torch.allclose(kernels.silu_and_mul(gate_up).float(), F.silu(gate) * up, atol=tol * 4, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_rows_first_index_on_ties(kernels, dtype):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(37, 1000 + 7, generator=g).to(dtype)  # a vocabulary that is not a multiple of 16
    logits[0, 5] = logits[0, 900] = 50.0  # a tie: the first wins
    logits[1, -1] = 50.0  # the maximum in the scalar tail
    logits[2, :] = float("-inf")
    logits[2, 3] = -1e4  # banned tokens everywhere else
    logits[3] = 1.0  # all equal: index 0
    ids = kernels.argmax_rows(logits)
    assert ids.dtype == torch.int64
    assert torch.equal(ids, logits.float().argmax(dim=-1))
    assert ids[:4].tolist() == [5, 1006, 3, 0]
    assert torch.equal(kernels.argmax_rows(logits[:, :500]), logits[:, :500].float().argmax(dim=-1))  # strided rows


@pytest.fixture(scope="module")
def small_linear(kernels):
    """The kernel, called with an [out, in] weight (laid out by pack_small here)."""
    from tokenmill.executor.layers.linear import pack_small
    if not kernels.has_small_linear:
        pytest.skip("small_linear needs AVX2 and FMA")
    return lambda x, w, b=None: kernels.small_linear(x, pack_small(w), b, len(w))


@pytest.mark.parametrize("rows", [*range(1, 10), 16, 21])  # past 6: passes of 6 rows
@pytest.mark.parametrize("out_features, in_features", [(512, 256), (37, 70), (130, 8), (5, 3), (200, 1)])
def test_small_linear_against_float64(small_linear, rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows)
    # every other row of a wider tensor: rows with a stride, an input not a multiple of 8
    x = torch.randn(rows, 2 * in_features, generator=g)[:, ::2]
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g)
    ref = x.double() @ w.double().T
    assert torch.allclose(small_linear(x, w).double(), ref, atol=1e-4, rtol=1e-5)
    assert torch.allclose(small_linear(x, w, b).double(), ref + b.double(), atol=1e-4, rtol=1e-5)


def test_small_linear_rows_do_not_depend_on_each_other(small_linear):
    """A row's output is the same, bit for bit, whatever rows are computed with it: a
    verified draft's row equals the decode that would have made it."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(21, 700, generator=g)
    w = torch.randn(1408, 700, generator=g)
    alone = torch.cat([small_linear(x[i:i + 1], w) for i in range(21)])
    for rows in range(2, 22):
        assert torch.equal(small_linear(x[:rows], w), alone[:rows])


@pytest.mark.parametrize("out_features", [40, 130])
def test_small_linear_splits_the_rows_of_a_narrow_layer_exactly(small_linear, out_features):
    """A layer of one or three chunks of outputs (64 each) splits a step of many rows between
    the threads in groups of passes: each row's output is the one it has alone, bit for bit."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(301, 300, generator=g)
    w = torch.randn(out_features, 300, generator=g)
    b = torch.randn(out_features, generator=g)
    y = small_linear(x, w, b)
    assert torch.equal(y, torch.cat([small_linear(x[i:i + 1], w, b) for i in range(301)]))
    assert torch.allclose(y.double(), x.double() @ w.double().T + b.double(), atol=1e-4, rtol=1e-5)


def test_small_linear_refuses_what_it_does_not_run(small_linear, kernels):
    from tokenmill.executor.layers.linear import pack_small
    w = torch.randn(16, 32)
    with pytest.raises(RuntimeError, match="at least one row"):
        small_linear(torch.randn(0, 32), w)
    with pytest.raises(RuntimeError, match="float32"):
        small_linear(torch.randn(2, 32, dtype=torch.bfloat16), w.bfloat16())
    with pytest.raises(RuntimeError, match="x \\[rows, in\\]"):
        small_linear(torch.randn(2, 31), w)
    with pytest.raises(RuntimeError, match="x \\[rows, in\\]"):
        kernels.small_linear(torch.randn(2, 32), w, None, 16)  # not laid out
    with pytest.raises(RuntimeError, match="out \\(17\\) within the weight's 1 blocks"):
        kernels.small_linear(torch.randn(2, 32), pack_small(w), None, 17)


@pytest.mark.parametrize("small_only", [False, True])
def test_linear_runs_small_steps_through_small_linear(small_linear, small_only, monkeypatch):
    """A packed float32 layer keeps its plain weight for steps of up to SMALL_ROWS rows and
    runs them through the kernel; larger steps take the packed weight. Where that copy is the
    only one (SMALL_ONLY: a CPU without AVX-512), every step takes the kernel. All give the
    layer's product."""
    from tokenmill.executor.layers import linear
    from tokenmill.executor.layers.linear import SMALL_ROWS, Linear
    if not torch.backends.mkldnn.is_available() and not small_only:
        pytest.skip("no oneDNN: layers stay plain")
    monkeypatch.setattr(linear, "SMALL_ONLY", small_only)
    g = torch.Generator().manual_seed(3)
    layer = Linear(64, {"a": 48, "b": 80}, bias=True)
    w, b = torch.randn(128, 64, generator=g), torch.randn(128, generator=g)
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(b)
    layer.pack()
    kernel = layer.small_kernel
    assert kernel.func is load_cpu_kernels().small_linear and kernel.keywords == {"out": 128}
    calls = []
    layer.small_kernel = lambda *args: calls.append(len(args[0])) or kernel(*args)
    with torch.inference_mode():
        for rows in (1, SMALL_ROWS, SMALL_ROWS + 1, 2 * SMALL_ROWS):
            x = torch.randn(rows, 64, generator=g)
            assert torch.allclose(layer(x).double(), x.double() @ w.double().T + b.double(), atol=1e-4)
        assert layer(torch.randn(0, 64)).shape == (0, 128)  # no rows: not the kernel's (it refuses them)
        if small_only:  # any shape of rows
            x = torch.randn(3, 5, 64, generator=g)
            assert torch.equal(layer(x), kernel(x.view(15, 64), layer.small, layer.bias).view(3, 5, 128))
            assert layer(torch.randn(2, 0, 64)).shape == (2, 0, 128)
    assert (layer.packed is None) == small_only
    assert calls == ([1, SMALL_ROWS, SMALL_ROWS + 1, 2 * SMALL_ROWS, 15] if small_only else [1, SMALL_ROWS])


def test_small_linear_widens_a_bfloat16_weight_exactly(small_linear):
    """A bfloat16 weight gives the output of its float32 values bit for bit (each value widened as
    it is read), at 1-21 rows of a strided x, outputs not a multiple of 16, with and without a
    bias."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(200, 703, generator=g).bfloat16()
    b = torch.randn(200, generator=g)
    x = torch.randn(21, 2 * 703, generator=g)[:, ::2]
    for rows in (1, 2, 3, 5, 8, 9, 16, 21):
        assert torch.equal(small_linear(x[:rows], w), small_linear(x[:rows], w.float()))
        assert torch.equal(small_linear(x[:rows], w, b), small_linear(x[:rows], w.float(), b))


@pytest.mark.parametrize("small_only", [False, True])
def test_a_float32_weight_of_bfloat16_values_keeps_its_small_copy_in_bfloat16(small_linear, small_only,
                                                                              monkeypatch):
    """A float32 layer whose values are all bfloat16 ones (a bfloat16 checkpoint served in float32)
    keeps its copy for small steps in bfloat16, up to twice the elements of a float32 copy (the
    built-in model's 8,192 x 256 LM head): its output is the float32 copy's bit for bit. One value
    off keeps float32, and past that size the packed weight alone. Where that copy is the only one
    (SMALL_ONLY), every size keeps it, in bfloat16 where it can, and every step runs on it."""
    from tokenmill.executor.layers import linear
    from tokenmill.executor.layers.linear import SMALL_FLOAT32_WEIGHT, SMALL_ROWS, Linear
    if not torch.backends.mkldnn.is_available() and not small_only:
        pytest.skip("no oneDNN: layers stay plain")
    monkeypatch.setattr(linear, "SMALL_ONLY", small_only)
    g = torch.Generator().manual_seed(4)

    def layer(out: int, inputs: int, w: torch.Tensor) -> Linear:
        linear = Linear(inputs, out)
        linear.weight.data.copy_(w)
        linear.pack()
        return linear

    w = torch.randn(SMALL_FLOAT32_WEIGHT // 256, 256, generator=g).bfloat16().float()  # past the float32 copy's size
    x = torch.randn(16, 256, generator=g)
    half = layer(len(w), 256, w)
    assert half.small.dtype == torch.bfloat16 and half.small_kernel.func is load_cpu_kernels().small_linear
    assert half.small_rows == SMALL_ROWS
    with torch.inference_mode():
        for rows in (1, 5, 16):
            assert torch.equal(half(x[:rows]), small_linear(x[:rows], w))
    off = w[:1024].clone()
    off[7, 3] += off[7, 3].abs() * 2 ** -12  # between two bfloat16 values
    assert layer(1024, 256, off).small.dtype == torch.float32
    big = torch.randn(SMALL_FLOAT32_WEIGHT // 128, 256, generator=g).bfloat16().float()
    if not small_only:
        assert layer(len(big), 256, big).small is None
        return
    alone = layer(len(big), 256, big)
    assert alone.packed is None and alone.small.dtype == torch.bfloat16 and alone.weight.numel() == 0
    x = torch.randn(SMALL_ROWS + 50, 256, generator=g)
    with torch.inference_mode():
        assert torch.equal(alone(x), small_linear(x, big))
    big[7, 3] += big[7, 3].abs() * 2 ** -12
    assert layer(len(big), 256, big).small.dtype == torch.float32


@pytest.fixture(scope="module")
def small_linear_bf16(kernels):
    if not kernels.has_small_linear_bf16:
        pytest.skip("small_linear_bf16 needs AVX512-BF16")
    return kernels.small_linear_bf16


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 16])
@pytest.mark.parametrize("out_features, in_features", [(512, 256), (37, 71), (130, 8), (5, 3), (16, 1)])
def test_small_linear_bf16_against_float64(small_linear_bf16, rows, out_features, in_features):
    """Outputs not a multiple of 16 and odd inputs come out of the padded layout; the result is
    the float64 product rounded to bfloat16 (as close as F.linear's, which rounds once too)."""
    from tokenmill.executor.layers.linear import pack_bf16_pairs
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 2 * in_features, generator=g).bfloat16()[:, ::2]  # rows with a stride
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16()
    packed = pack_bf16_pairs(w)
    assert packed.shape == (-(-out_features // 16), -(-in_features // 2), 16, 2)
    for bias in (None, b):
        ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
        y = small_linear_bf16(x, packed, bias, out_features)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
        assert torch.allclose(y.double(), ref, rtol=2 ** -8, atol=1e-6)  # within a bfloat16 rounding


def test_small_linear_bf16_rows_do_not_depend_on_each_other(small_linear_bf16):
    """A row's output is the same, bit for bit, whatever rows are computed with it."""
    from tokenmill.executor.layers.linear import pack_bf16_pairs
    g = torch.Generator().manual_seed(9)
    x = torch.randn(16, 700, generator=g).bfloat16()
    packed = pack_bf16_pairs(torch.randn(1408, 700, generator=g).bfloat16())
    alone = torch.cat([small_linear_bf16(x[i:i + 1], packed, None, 1408) for i in range(16)])
    for rows in range(2, 17):
        assert torch.equal(small_linear_bf16(x[:rows], packed, None, 1408), alone[:rows])


def test_small_linear_bf16_refuses_what_it_does_not_run(small_linear_bf16):
    from tokenmill.executor.layers.linear import pack_bf16_pairs
    w = torch.randn(32, 64).bfloat16()
    packed = pack_bf16_pairs(w)
    with pytest.raises(RuntimeError, match="1 to 16 rows"):
        small_linear_bf16(torch.randn(17, 64).bfloat16(), packed, None, 32)
    with pytest.raises(RuntimeError, match="bfloat16"):
        small_linear_bf16(torch.randn(2, 64), packed, None, 32)
    with pytest.raises(RuntimeError, match="pack_bf16_pairs"):
        small_linear_bf16(torch.randn(2, 64).bfloat16(), w, None, 32)
    with pytest.raises(RuntimeError, match="x has 62 columns"):
        small_linear_bf16(torch.randn(2, 62).bfloat16(), packed, None, 32)
    with pytest.raises(RuntimeError, match="bias of 32 elements"):
        small_linear_bf16(torch.randn(2, 64).bfloat16(), packed, torch.randn(31).bfloat16(), 32)


def test_bfloat16_linear_runs_small_steps_through_small_linear_bf16(small_linear_bf16):
    """A packed bfloat16 layer keeps a copy for small_linear_bf16 and runs steps of up to its
    small_rows rows through it (more rows for fewer elements); larger steps take oneDNN's
    packed weight. Both give the layer's product; a large weight keeps no second copy. (Inputs
    not a multiple of 32: amx_linear, where the CPU has it, does not take them.)"""
    from tokenmill.executor.layers.linear import SMALL_BFLOAT16_WEIGHT, Linear, small_bfloat16_rows
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN: layers stay plain")
    assert small_bfloat16_rows(128 * 64) == 16 and small_bfloat16_rows(1408 * 256) == 9
    assert small_bfloat16_rows(8192 * 256) == 5 and small_bfloat16_rows(SMALL_BFLOAT16_WEIGHT - 1) == 4
    g = torch.Generator().manual_seed(3)
    layer = Linear(66, {"a": 48, "b": 80}, bias=True).bfloat16()
    w, b = torch.randn(128, 66, generator=g).bfloat16(), torch.randn(128, generator=g).bfloat16()
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(b)
    layer.pack()
    assert layer.small_rows == 16 and layer.small.shape == (8, 33, 16, 2)
    assert layer.small_kernel.func is small_linear_bf16
    calls = []
    kernel = layer.small_kernel
    layer.small_kernel = lambda *args: calls.append(len(args[0])) or kernel(*args)
    with torch.inference_mode():
        for rows in (1, 16, 17, 40):
            x = torch.randn(rows, 66, generator=g).bfloat16()
            ref = x.double() @ w.double().T + b.double()
            assert torch.allclose(layer(x).double(), ref, rtol=2e-2, atol=2e-2)
        assert layer(torch.randn(0, 66).bfloat16()).shape == (0, 128)
    assert calls == [1, 16]
    big = Linear(1024, SMALL_BFLOAT16_WEIGHT // 1024).bfloat16()
    big.pack()
    assert big.packed is not None and big.small is None


@pytest.fixture(scope="module")
def amx_linear(kernels):
    if not kernels.has_amx_linear:
        pytest.skip("amx_linear needs AMX-BF16 (and the tiles granted by the operating system)")
    return kernels.amx_linear


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 32, 33, 48, 50, 64, 65, 130, 256])
@pytest.mark.parametrize("out_features, in_features", [(512, 256), (37, 64), (16, 32), (1408, 704), (8, 96)])
def test_amx_linear_against_float64(amx_linear, rows, out_features, in_features):
    """One to four tiles of rows (the last of 1-16 rows), more rows 64 at a time, an odd number
    of output blocks and a last block of fewer than 16 outputs; strided rows of x. The result
    is the float64 product rounded to bfloat16 (the sums are float32's)."""
    from tokenmill.executor.layers.linear import pack_bf16_pairs
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features + 32, generator=g).bfloat16()[:, 32:]  # rows with a stride
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16()
    packed = pack_bf16_pairs(w)
    for bias in (None, b):
        ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
        y = amx_linear(x, packed, bias, out_features)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
        # within a bfloat16 rounding, and float32 summation's error where the terms cancel
        summed = x.double().abs() @ w.double().abs().T
        assert ((y.double() - ref).abs() <= 2 ** -8 * ref.abs() + 1e-6 * summed).all()


def test_amx_linear_rows_do_not_depend_on_each_other(amx_linear):
    """A row's output is the same, bit for bit, whatever rows are computed with it (one to
    four tiles of rows, more rows 64 at a time)."""
    from tokenmill.executor.layers.linear import pack_bf16_pairs
    g = torch.Generator().manual_seed(9)
    x = torch.randn(150, 704, generator=g).bfloat16()
    packed = pack_bf16_pairs(torch.randn(1400, 704, generator=g).bfloat16())  # an odd number of blocks
    alone = torch.cat([amx_linear(x[i:i + 1], packed, None, 1400) for i in range(150)])
    for rows in [*range(2, 66), 129, 150]:
        assert torch.equal(amx_linear(x[:rows], packed, None, 1400), alone[:rows])


def test_amx_linear_refuses_what_it_does_not_run(amx_linear):
    from tokenmill.executor.layers.linear import pack_bf16_pairs
    w = torch.randn(32, 64).bfloat16()
    packed = pack_bf16_pairs(w)
    with pytest.raises(RuntimeError, match="at most 256 rows"):
        amx_linear(torch.randn(257, 64).bfloat16(), packed, None, 32)
    with pytest.raises(RuntimeError, match="bfloat16"):
        amx_linear(torch.randn(2, 64), packed, None, 32)
    with pytest.raises(RuntimeError, match="pack_bf16_pairs"):
        amx_linear(torch.randn(2, 64).bfloat16(), w, None, 32)
    with pytest.raises(RuntimeError, match="a multiple of 32"):
        amx_linear(torch.randn(2, 48).bfloat16(), pack_bf16_pairs(torch.randn(32, 48).bfloat16()), None, 32)
    with pytest.raises(RuntimeError, match="bias of 32 elements"):
        amx_linear(torch.randn(2, 64).bfloat16(), packed, torch.randn(31).bfloat16(), 32)


def test_bfloat16_linear_runs_small_steps_through_amx_linear(amx_linear):
    """Where the CPU has AMX, a packed bfloat16 layer whose inputs are a multiple of 32 runs
    steps of up to AMX_ROWS rows through amx_linear (AMX_NARROW_ROWS for at most AMX_NARROW
    inputs or twice as many outputs), larger ones through oneDNN."""
    from tokenmill.executor.layers.linear import AMX_NARROW, AMX_NARROW_ROWS, AMX_ROWS, Linear
    assert (AMX_ROWS, AMX_NARROW, AMX_NARROW_ROWS) == (64, 256, 256)
    g = torch.Generator().manual_seed(4)
    for in_features, out_features, most in ((64, 128, 256), (288, 128, 256), (288, 528, 64)):
        layer = Linear(in_features, {"a": 48, "b": out_features - 48}, bias=True).bfloat16()
        w = torch.randn(out_features, in_features, generator=g).bfloat16()
        b = torch.randn(out_features, generator=g).bfloat16()
        layer.weight.data.copy_(w)
        layer.bias.data.copy_(b)
        layer.pack()
        assert layer.small_rows == most and layer.small_kernel.func is amx_linear
        calls = []
        kernel = layer.small_kernel
        layer.small_kernel = lambda *args: calls.append(len(args[0])) or kernel(*args)
        with torch.inference_mode():
            for rows in (1, 17, most, most + 1):
                x = torch.randn(rows, in_features, generator=g).bfloat16()
                ref = x.double() @ w.double().T + b.double()
                assert torch.allclose(layer(x).double(), ref, rtol=2e-2, atol=5e-2)
        assert calls == [1, 17, most]

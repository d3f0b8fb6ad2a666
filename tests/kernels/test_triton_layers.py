"""The Triton layer kernels (rms_norm, qk_norm_rotary, silu_and_mul, quantize_fp8_rows, and the
last fused into the first and third) against float64 references or the torch versions.

Without a GPU they run under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1). Outputs start as NaN (torch.empty is poisoned), and rows or heads
outside what a kernel may touch keep their sentinel, so a missed or stray write shows.
"""

from __future__ import annotations

import pytest
import torch

ops = pytest.importorskip("tokenmill.executor.layers.triton_ops",
                          reason="Triton is not installed (x86-64 Linux test dependency)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
ULP = {torch.float32: 2**-23, torch.float16: 2**-10, torch.bfloat16: 2**-7}  # relative, at most


@pytest.fixture
def poisoned_outputs(monkeypatch):
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))


def close(out, ref, dtype):
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, dim", [(1, 64), (37, 96), (130, 1024), (5, 80)])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm(poisoned_outputs, dtype, rows, dim, with_residual):
    g = torch.Generator().manual_seed(rows * dim)
    # x is a strided view (rows of a wider tensor), as the q/k norms and the fused outputs are
    wide = torch.randn(rows, dim + 24, generator=g).to(dtype).to(DEVICE)
    x = wide[:, 8:8 + dim]
    weight = (1 + 0.1 * torch.randn(dim, generator=g)).to(dtype).to(DEVICE)
    residual = torch.randn(rows, dim, generator=g).to(dtype).to(DEVICE) if with_residual else None
    before = wide.clone()
    total = None
    if residual is not None:
        total = (x.double() + residual.double()).to(dtype)  # the stream is kept in the model dtype
        source = total.double()
    else:
        source = x.double()
    ref = source * torch.rsqrt(source.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    out = ops.rms_norm(x, residual, weight, 1e-6)
    close(out, ref, dtype)
    if residual is not None:
        # the sum rounded once to the model dtype (the interpreter may round it the other way)
        torch.testing.assert_close(residual, total, atol=0, rtol=ULP[dtype])
    assert torch.equal(wide, before)  # x is read only


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, dim", [(1, 64), (23, 1408), (3, 2500)])
def test_silu_and_mul(poisoned_outputs, dtype, rows, dim):
    g = torch.Generator().manual_seed(rows + dim)
    gate_up = (3 * torch.randn(rows, 2 * dim, generator=g)).to(dtype).to(DEVICE)
    gate, up = gate_up.double().chunk(2, dim=-1)
    ref = gate * torch.sigmoid(gate) * up
    close(ops.silu_and_mul(gate_up), ref, dtype)


def test_bad_inputs_name_the_argument():
    x = torch.randn(4, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="rms_norm: x must be"):
        ops.rms_norm(x, None, torch.ones(16, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="qk_norm_rotary: cos_sin"):
        ops.qk_norm_rotary(x, x, None, None, 1e-6, torch.zeros(4, dtype=torch.int64, device=DEVICE),
                           torch.ones(10, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="silu_and_mul"):
        ops.silu_and_mul(torch.randn(4, 7, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 64), (16, 8, 128), (3, 1, 80)])
@pytest.mark.parametrize("norm", [True, False], ids=["qk-norm", "rotary-only"])
def test_qk_norm_rotary_from_the_qkv_views(poisoned_outputs, dtype, heads, kv_heads, head_dim, norm):
    tokens = 7
    g = torch.Generator().manual_seed(heads * head_dim + norm)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=g).to(dtype).to(DEVICE)
    before = qkv.clone()
    q = qkv[:, :q_size].view(tokens, heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(tokens, kv_heads, head_dim)
    weights = [(1 + 0.1 * torch.randn(head_dim, generator=g)).to(dtype).to(DEVICE) for _ in range(2)] if norm \
        else [None, None]
    positions = torch.randint(0, 500, (tokens,), generator=g).to(DEVICE)
    half = head_dim // 2
    freqs = torch.outer(torch.arange(512, dtype=torch.float64), 1.0 / 10000 ** (torch.arange(half) * 2 / head_dim))
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    cos, sin = cos_sin[positions.cpu(), :half].to(DEVICE)[:, None], cos_sin[positions.cpu(), half:].to(DEVICE)[:, None]

    def reference(x, w):
        x = x.double()
        if w is not None:  # the unfused norm's output is rounded to the model dtype
            x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()).to(dtype).double()
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    q_out, k_out = ops.qk_norm_rotary(q, k, weights[0], weights[1], 1e-6, positions, cos_sin.float().to(DEVICE))
    assert q_out.is_contiguous() and k_out.is_contiguous()
    close(q_out, reference(q, weights[0]), dtype)
    close(k_out, reference(k, weights[1]), dtype)
    assert torch.equal(qkv, before)  # the projection's output is read only


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, k", [(1, 64), (9, 1024), (3, 3000)])
def test_quantize_fp8_rows_equals_the_torch_version(dtype, rows, k):
    """Scales and codes equal quantization/fp8.py's nine-op torch version (which the FP8
    checkpoint format is checked against), a zero row included."""
    from tokenmill.executor.layers.quantization.fp8 import quantize_fp8_rows
    g = torch.Generator().manual_seed(rows * k)
    wide = (torch.randn(rows, k + 16, generator=g) * torch.logspace(-3, 2, rows)[:, None]).to(dtype).to(DEVICE)
    wide[0, :] = 0
    x = wide[:, 5:5 + k]  # rows a wider stride apart
    q_ref, s_ref = quantize_fp8_rows(x)
    q, s = ops.quantize_fp8_rows(x)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, dim", [(1, 64), (37, 96), (70, 1024), (5, 80)])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_fp8_equals_the_norm_then_the_quantization(poisoned_outputs, dtype, rows, dim, with_residual):
    """rms_norm_fp8 (one launch) gives rms_norm's residual, and the codes and scales of
    quantize_fp8_rows over rms_norm's output, bit for bit: a zero row and rows of very
    different sizes included."""
    g = torch.Generator().manual_seed(rows + dim)
    wide = (torch.randn(rows, dim + 24, generator=g) * torch.logspace(-3, 2, rows)[:, None]).to(dtype).to(DEVICE)
    wide[0] = 0
    x = wide[:, 8:8 + dim]
    weight = (1 + 0.1 * torch.randn(dim, generator=g)).to(dtype).to(DEVICE)
    residual = torch.randn(rows, dim, generator=g).to(dtype).to(DEVICE) * 0.01 if with_residual else None
    residual_ref = residual.clone() if with_residual else None
    q_ref, s_ref = ops.quantize_fp8_rows(ops.rms_norm(x, residual_ref, weight, 1e-6))
    q, s = ops.rms_norm_fp8(x, residual, weight, 1e-6)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (rows, 1)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    if with_residual:
        assert torch.equal(residual, residual_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, dim", [(1, 64), (23, 1408), (3, 2500)])
def test_silu_and_mul_fp8_equals_the_activation_then_the_quantization(poisoned_outputs, dtype, rows, dim):
    """silu_and_mul_fp8 gives the codes and scales of quantize_fp8_rows over silu_and_mul's
    output bit for bit (2,500: a row in two passes of 2,048)."""
    g = torch.Generator().manual_seed(rows + dim)
    gate_up = (torch.randn(rows, 2 * dim, generator=g) * torch.logspace(-2, 1, rows)[:, None]).to(dtype).to(DEVICE)
    q_ref, s_ref = ops.quantize_fp8_rows(ops.silu_and_mul(gate_up))
    q, s = ops.silu_and_mul_fp8(gate_up)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_before_fp8_layers_quantize_their_output(dtype):
    """With FP8 layers and the Triton layer kernels, the kernels whose output only an FP8 layer
    reads (the norms before qkv and gate/up, the activation before down) quantize it in their
    launch once the weights are packed: the layers' outputs and the residual stream are those of
    the kernels and the quantization apart."""
    import dataclasses

    from tokenmill.config import DEFAULT_MODEL_DIR, ModelConfig
    from tokenmill.executor.layers.quantization.fp8 import Fp8Config, Fp8Rows
    from tokenmill.executor.models.llama import LlamaForCausalLM

    cfg = dataclasses.replace(ModelConfig.from_dir(DEFAULT_MODEL_DIR), num_layers=2)
    quant = Fp8Config.__new__(Fp8Config)  # (its constructor refuses a CPU; the method computes on one)
    model = LlamaForCausalLM(cfg, 64, kernels=ops, quant=quant)
    g = torch.Generator().manual_seed(5)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        p.data = 1 + 0.1 * noise if "norm" in name else 0.05 * noise
    model.to(DEVICE, dtype).pack_weights()

    for layer in model.layers:
        assert layer.input_layernorm.fp8_output and layer.post_attention_layernorm.fp8_output and layer.mlp.fp8_down

    def fuse(on: bool) -> None:
        for layer in model.layers:
            layer.input_layernorm.fp8_output = layer.post_attention_layernorm.fp8_output = on
            layer.mlp.fp8_down = on
    x, residual = (torch.randn(7, cfg.hidden_size, generator=g).to(DEVICE, dtype) for _ in range(2))
    for norm, after in ((model.layers[0].input_layernorm, model.layers[0].self_attn.qkv_proj),
                        (model.layers[1].input_layernorm, model.layers[1].self_attn.qkv_proj),
                        (model.layers[1].post_attention_layernorm, model.layers[1].mlp)):
        stream = None if norm is model.layers[0].input_layernorm else residual
        outs = []
        for fused in (False, True):
            fuse(fused)
            normed = norm(x, None if stream is None else stream.clone())
            h, res = (normed, None) if stream is None else normed
            assert isinstance(h, Fp8Rows) == fused
            outs.append((after(h), res))
        assert torch.equal(outs[0][0], outs[1][0]) and (stream is None or torch.equal(outs[0][1], outs[1][1]))


def test_fp8_layer_with_the_triton_activation_quantization():
    """The FP8 linear layer as CUDA runs it (its activations through the Triton kernel)
    gives the torch version's output exactly (torch._scaled_mm also runs on the CPU)."""
    from tokenmill.executor.layers.linear import Linear
    from tokenmill.executor.layers.quantization.fp8 import Fp8LinearMethod, quantize_fp8_rows

    g = torch.Generator().manual_seed(2)
    w, x, bias = torch.randn(96, 64, generator=g) * 0.05, torch.randn(5, 64, generator=g), torch.randn(96, generator=g)
    layer = Linear(64, 96, bias=True, quant_method=Fp8LinearMethod(from_checkpoint=False))
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(bias)
    layer.to(DEVICE).pack()
    x = x.to(DEVICE)
    method = layer.quant_method
    # chosen when the weights are packed, by their device
    assert method.quantize is (ops.quantize_fp8_rows if DEVICE == "cuda" else quantize_fp8_rows)
    method.quantize = quantize_fp8_rows
    reference = layer(x)
    method.quantize = ops.quantize_fp8_rows
    assert torch.equal(layer(x), reference)


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("m, n, k", [(1, 96, 64), (5, 200, 1024), (17, 64, 600), (64, 130, 300)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
def test_fp8_gemm_matches_the_scaled_product(poisoned_outputs, out_dtype, m, n, k, with_bias):
    """triton_fp8_gemm (decode-sized FP8 steps, split along K where the columns are few) gives
    (q @ w^T) * row scales * column scales (+ bias) of the same fp8 codes: a float64 reference,
    and torch._scaled_mm (which also runs on the CPU). Shapes with one split and with several,
    a last K tile cut short, and ragged rows and columns."""
    from tokenmill.executor.layers import triton_fp8_gemm
    from tokenmill.executor.layers.quantization.fp8 import quantize_fp8_rows

    g = torch.Generator().manual_seed(m * n + k)
    q, x_scale = quantize_fp8_rows(torch.randn(m, k, generator=g) * torch.logspace(-2, 1, m)[:, None])
    w, w_scale = quantize_fp8_rows(torch.randn(n, k, generator=g) * 0.05)
    bias = torch.randn(n, generator=g).to(out_dtype) if with_bias else None
    if DEVICE == "cpu":  # the interpreter's plan counts 8 multiprocessors: both kinds of launch run here
        assert (triton_fp8_gemm.plan(m, n, k, 8)[1] > 1) == (k >= 4 * triton_fp8_gemm.BLOCK_K)
    out = triton_fp8_gemm.fp8_gemm(q.to(DEVICE), x_scale.to(DEVICE), w.to(DEVICE), w_scale.reshape(1, -1).to(DEVICE),
                                   None if bias is None else bias.to(DEVICE), out_dtype)
    assert out.dtype == out_dtype and out.shape == (m, n)
    ref = (q.double() @ w.double().T) * x_scale.double() * w_scale.reshape(1, -1).double()
    if bias is not None:
        ref += bias.double()
    close(out.cpu(), ref, out_dtype)
    scaled = torch._scaled_mm(q, w.t(), scale_a=x_scale, scale_b=w_scale.reshape(1, -1).contiguous(),
                              out_dtype=torch.float32)
    scaled = (scaled + (0 if bias is None else bias.float())).to(out_dtype)
    # two float32 sums of k products in their own orders: the kernel is held to TOL of the exact
    # sum above, and to twice that of the CPU's _scaled_mm (1.6e-5 apart at k = 1024 on an
    # AVX2-only AMD EPYC)
    torch.testing.assert_close(out.cpu().float(), scaled.float(), atol=2 * TOL[out_dtype], rtol=2 * TOL[out_dtype])


@pytest.mark.skipif(DEVICE != "cuda", reason="the layer takes triton_fp8_gemm on CUDA only")
def test_fp8_layer_takes_the_small_gemm_when_asked(monkeypatch):
    """TOKENMILL_FP8_GEMM=triton: steps of up to SMALL_M rows go through triton_fp8_gemm, larger
    ones through torch._scaled_mm; both agree with the default layer."""
    from tokenmill.executor.layers import triton_fp8_gemm
    from tokenmill.executor.layers.linear import Linear
    from tokenmill.executor.layers.quantization.fp8 import Fp8LinearMethod

    g = torch.Generator().manual_seed(3)
    w = torch.randn(256, 512, generator=g) * 0.05
    layers = []
    for choice in ("cublas", "triton"):
        monkeypatch.setenv("TOKENMILL_FP8_GEMM", choice)
        layer = Linear(512, 256, bias=False, quant_method=Fp8LinearMethod(from_checkpoint=False))
        layer.weight.data.copy_(w)
        layer.to(DEVICE, torch.bfloat16).pack()
        layers.append(layer)
    assert layers[0].quant_method.small_gemm is None
    assert layers[1].quant_method.small_gemm is triton_fp8_gemm.fp8_gemm
    for rows in (1, triton_fp8_gemm.SMALL_M, triton_fp8_gemm.SMALL_M + 1):
        x = torch.randn(rows, 512, generator=g).to(DEVICE, torch.bfloat16)
        torch.testing.assert_close(layers[1](x), layers[0](x), atol=1.6e-2, rtol=1.6e-2)

"""INT8 W8A8 linear layers (layers/quantization/int8.py), native and through torch's
quantized op, against exact integer arithmetic, and the engine with quantization on."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch.nn import functional as F

from tokenmill import LLM, SamplingParams
from tokenmill.config import DEFAULT_MODEL_DIR, EngineConfig
from tokenmill.executor.cpu_kernels import load_cpu_kernels
from tokenmill.executor.layers.linear import Linear
from tokenmill.executor.layers.quantization.int8 import Int8LinearMethod, quantize_per_channel

pytestmark = pytest.mark.skipif("fbgemm" not in torch.backends.quantized.supported_engines,
                                reason="int8 runs on fbgemm (x86-64)")


def exact_w8a8(x: torch.Tensor, w: torch.Tensor, qmax: int) -> torch.Tensor:
    """Per-token (to [-qmax, qmax]) x per-channel int8, symmetric, multiplied exactly (float64)."""
    qw, sw = quantize_per_channel(w)
    amax = x.abs().amax(dim=1, keepdim=True)
    sx = amax / qmax
    qx = torch.round(x / sx).clamp(-qmax, qmax)
    return ((qx.double() @ qw.double().t()) * sx.double() * sw.double()).float()


def int8_method(path: str) -> Int8LinearMethod:
    """The W8A8 method whose GEMM is `path`'s: fbgemm through the native kernels, oneDNN's (with
    the native kernels' row quantization) for every step, amx_int8_linear for steps of up to
    AMX_ROWS rows (oneDNN's above where torch has it), or torch's quantized op."""
    kernels = None if path == "torch" else load_cpu_kernels()
    method = Int8LinearMethod(kernels, onednn=None if path == "amx" else path == "onednn",
                              amx=path == "amx")
    if path != "torch" and not method.native:
        pytest.skip("no native int8 kernels")
    if path == "onednn" and not method.onednn:
        pytest.skip("oneDNN's int8 GEMM is exact only with VNNI (else its int16 pair sums saturate), "
                    "or this torch has no oneDNN int8 ops")
    if path == "amx" and not method.amx:
        pytest.skip("amx_int8_linear needs AMX-INT8 (and the tiles granted by the operating system)")
    return method


def packed_layer(method: Int8LinearMethod, w: torch.Tensor, bias: torch.Tensor) -> Linear:
    layer = Linear(w.shape[1], w.shape[0], bias=True, quant_method=method)
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(bias)
    layer.pack()
    if method.onednn and not method.amx:
        layer.onednn_rows = 1  # every step through oneDNN (by default only larger ones)
    return layer


@pytest.mark.parametrize("rows, k, n", [(1, 64, 48), (5, 96, 200), (7, 512, 1024), (64, 1408, 512),
                                        (300, 128, 40)])
@pytest.mark.parametrize("path", ["fbgemm", "onednn", "amx", "torch"])
@pytest.mark.parametrize("outlier", [1, 20], ids=["plain", "outlier"])
def test_int8_linear_matches_exact_int8_arithmetic(rows, k, n, path, outlier):
    gen = torch.Generator().manual_seed(rows + k)
    w = torch.randn(n, k, generator=gen) * 0.05
    x = torch.rand(rows, k, generator=gen) * 2 - 1  # uniform: many large values, the hardest case for saturation
    x[:, 3] *= outlier  # an outlier channel, as real activations have
    bias = torch.randn(n, generator=gen)
    method = int8_method(path)
    layer = packed_layer(method, w, bias)
    assert layer.weight.numel() == 0  # the float copy is gone
    y = layer(x)
    exact = exact_w8a8(x, w, method.qmax) + bias
    ref = F.linear(x, w, bias)
    # 7-bit activations without VNNI: fbgemm's int16 pair sums never saturate, so it is exact
    # but for an activation a float ulp from half a step, which may round the other way (one
    # such is 3e-5 at 64 x 1408; the scheme's own error is 1000 times that)
    assert (y - exact).norm() / exact.norm() < 1e-4
    # the scheme's own error: an outlier channel coarsens the step of the whole row
    assert (y - ref).norm() / ref.norm() < (0.03 if outlier == 1 else 0.08)


@pytest.mark.parametrize("path", ["fbgemm", "onednn"])
def test_native_int8_linear_dtypes_and_shapes(path):
    """float32, bf16 and fp16 rows in and out, rows with a stride (read in place), more rows
    than fbgemm's row block (120 on AVX2), a width not a multiple of 4, an all-zero row,
    tiny rows, a bias, and no rows at all; packed with two threads, fbgemm's columns come in
    two parts (200 columns: 128 and 72); oneDNN's 130 rows are padded to 144 with zero rows."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(200, 99, generator=gen) * 0.05
    bias = torch.randn(200, generator=gen)
    method = int8_method(path)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        layer = packed_layer(method, w, bias)
    finally:
        torch.set_num_threads(threads)
    wide = torch.randn(130, 150, generator=gen)
    wide[7] = 0.0
    wide[8] *= 1e-38
    x = wide[:, 10:109]  # rows 150 apart
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)):
        xd = x.to(dtype) if dtype != torch.float32 else x
        layer.bias.data = bias.to(dtype)
        y = layer(xd)
        assert y.dtype == dtype and y.shape == (130, 200)
        rows = [r for r in range(130) if r not in (7, 8)]  # the reference divides by a zero scale there
        exact = exact_w8a8(xd[rows].float(), w, method.qmax) + bias.to(dtype).float()
        assert (y[rows].float() - exact).norm() / exact.norm() < tol  # the 16-bit output's own rounding
        torch.testing.assert_close(y[7].float(), bias.to(dtype).float())  # a zero row gives the bias
        assert torch.isfinite(y[8]).all()
    layer.bias.data = bias
    assert layer(torch.empty(0, 99)).shape == (0, 200)
    with pytest.raises(RuntimeError, match="in_features"):
        layer(torch.randn(2, 98))


def test_amx_int8_linear_rows_dtypes_and_routing():
    """amx_int8_linear's sums are exact integers: its output is the kernel's own quantized rows
    times the int8 weight, rescaled, whatever rows come with a row (bit for bit), for 1 to 4
    tiles of rows, more 64 at a time, an odd number of output blocks, a last block of fewer
    than 16, strided rows, an all-zero row, float32, bfloat16 and float16. A layer takes it for
    steps of up to AMX_ROWS rows (oneDNN or fbgemm above), and not for inputs that are not a
    multiple of 64."""
    from tokenmill.executor.layers.quantization.int8 import AMX_ROWS
    method = int8_method("amx")
    kernels = method.kernels
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(200, 192, generator=gen) * 0.05
    bias = torch.randn(200, generator=gen)
    layer = packed_layer(method, w, bias)
    qw, sw = quantize_per_channel(w)
    assert layer.amx_int8 is not None and (layer.packed_int8 is None) == method.onednn
    calls = []
    amx = kernels.amx_int8_linear
    method.kernels = type("Spy", (), {"__getattr__": lambda _, name: getattr(kernels, name),
                                      "amx_int8_linear": staticmethod(lambda *a: calls.append(len(a[0])) or amx(*a))})()
    x = (torch.randn(300, 256, generator=gen) * 3)[:, 32:224]  # rows 256 apart
    x[7] = 0.0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        layer.bias.data = bias.to(dtype)
        q, row_scale = kernels.int8_quantize_rows(xd, 300, 127)
        exact = (q.double() @ qw.double().T) * row_scale.double()[:, None] * sw.double() + bias.to(dtype).double()
        alone = torch.cat([layer(xd[i:i + 1]) for i in range(70)])
        for rows in (1, 2, 16, 17, 33, 64, 65, 70, AMX_ROWS, AMX_ROWS + 1, 300):
            calls.clear()
            y = layer(xd[:rows])
            assert calls == ([rows] if rows <= AMX_ROWS else [])
            assert y.dtype == dtype and y.shape == (rows, 200)
            assert rows > AMX_ROWS or torch.equal(y[:70], alone[:rows])  # (oneDNN rescales in another order)
            tol = {torch.float32: 1e-6, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[dtype]
            assert ((y.double() - exact[:rows]).abs() <= tol * exact[:rows].abs() + 1e-5).all()
        torch.testing.assert_close(layer(xd[7:8])[0], bias.to(dtype))  # a zero row gives the bias
    layer.bias.data = bias
    assert layer(torch.empty(0, 192)).shape == (0, 200)
    with pytest.raises(RuntimeError, match="in_features"):
        layer(torch.randn(2, 160))
    assert packed_layer(method, torch.randn(40, 96, generator=gen), torch.zeros(40)).amx_int8 is None


def test_engine_with_int8_stays_close_to_float():
    """The built-in model quantized on load: most greedy tokens equal float32's, the LM head
    stays unquantized, and preemption and prefix caching work as before."""
    prompts = ["def add(a, b):", "import os\n", "class Stack:", "for i in range(10):"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ref = LLM(str(DEFAULT_MODEL_DIR), dtype="float32", kv_cache_memory="16MiB")
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(DEFAULT_MODEL_DIR), dtype="float32", kv_cache_memory="1MiB", quantization="int8")
    model = llm.engine.runner.model
    assert model.lm_head.quant_method is None and model.layers[0].mlp.down_proj.quant_method is not None
    got = [o.outputs[0].token_ids for o in llm.generate(prompts * 3, params, use_tqdm=False)]
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.kv_cache.prefix_hits > 0
    assert got[:4] == got[4:8] == got[8:]  # preempted, recomputed, prefix hits: the same tokens
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    assert same / (len(prompts) * 24) >= 0.8


def test_bad_quantization_is_named(tmp_path):
    with pytest.raises(ValueError, match="quantization must be one of auto, none, int8"):
        EngineConfig(quantization="int4")
    ckpt = tmp_path / "quantized"
    shutil.copytree(DEFAULT_MODEL_DIR, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantization_config: .*'gptq'"):
        LLM(str(ckpt), kv_cache_memory="1MiB")


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """The built-in model written by `tokenmill quantize` in both schemes."""
    from tokenmill.cli import main

    root = tmp_path_factory.mktemp("quantized")
    for scheme in ("w8a8-int8", "fp8-dynamic"):
        assert main(["quantize", "--model", str(DEFAULT_MODEL_DIR), "--scheme", scheme,
                     "--output", str(root / scheme)]) == 0
    return root


@pytest.mark.parametrize("scheme, fmt, dtype", [("w8a8-int8", "int-quantized", torch.int8),
                                                ("fp8-dynamic", "float-quantized", torch.float8_e4m3fn)])
def test_quantize_writes_the_compressed_tensors_format(quantized, scheme, fmt, dtype):
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors import safe_open

    cfg = json.loads((quantized / scheme / "config.json").read_text())["quantization_config"]
    QuantizationConfig.model_validate(cfg)  # the format's own schema
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == fmt and cfg["ignore"] == ["lm_head"]
    assert cfg["quantization_status"] == "compressed"
    group = cfg["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"]
    assert group["weights"]["num_bits"] == 8 and group["weights"]["strategy"] == "channel"
    assert group["input_activations"]["strategy"] == "token" and group["input_activations"]["dynamic"]
    with safe_open(str(quantized / scheme / "model.safetensors"), framework="pt") as st:
        weight = st.get_tensor("model.layers.0.mlp.down_proj.weight")
        scale = st.get_tensor("model.layers.0.mlp.down_proj.weight_scale")
        assert weight.dtype == dtype and scale.dtype == torch.float32 and scale.shape == (weight.shape[0], 1)
        assert st.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16  # untouched
    assert (quantized / scheme / "tokenizer.json").is_file()


def test_a_w8a8_checkpoint_runs_as_int8_on_load(quantized):
    """Loading the written W8A8 checkpoint gives exactly what quantizing on load gives."""
    prompts = ["def add(a, b):", "import sys\n"]
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=2, ignore_eos=True)
    loaded = LLM(str(quantized / "w8a8-int8"), dtype="float32", kv_cache_memory="4MiB")
    assert loaded.engine.runner.quant.name == "compressed-tensors"
    on_load = LLM(str(DEFAULT_MODEL_DIR), dtype="float32", kv_cache_memory="4MiB", quantization="int8")
    for a, b in zip(loaded.generate(prompts, params, use_tqdm=False), on_load.generate(prompts, params,
                                                                                       use_tqdm=False)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


@pytest.mark.parametrize("scheme", ["fp8-dynamic", "int8-weight-only"])
def test_fp8_and_weight_only_checkpoints_run_dequantized_on_the_cpu(quantized, tmp_path, scheme):
    prompts = ["def add(a, b):", "class Stack:"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ref = LLM(str(DEFAULT_MODEL_DIR), dtype="float32", kv_cache_memory="4MiB")
    path = quantized / scheme if scheme == "fp8-dynamic" else _edit_quantization_config(
        quantized / "w8a8-int8", tmp_path / scheme, lambda q: q["config_groups"]["group_0"].pop("input_activations"))
    fp8 = LLM(str(path), dtype="float32", kv_cache_memory="4MiB")
    layer = fp8.engine.runner.model.layers[0].mlp.down_proj
    assert layer.weight.dtype == torch.float32 and not hasattr(layer, "weight_scale")
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in fp8.generate(prompts, params, use_tqdm=False)]
    assert sum(a == b for g, w in zip(got, want) for a, b in zip(g, w)) / 48 >= 0.75


def _edit_quantization_config(src, dst, edit):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg["quantization_config"])
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("edit, message", [
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=4),
     r"config_groups.group_0.weights: '4-bit int'"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="group", group_size=128),
     r"config_groups.group_0.weights.strategy: 'group"),
    (lambda q: q["config_groups"]["group_0"]["input_activations"].update(symmetric=False),
     r"config_groups.group_0.input_activations: .*symmetric=False"),
    (lambda q: q["config_groups"]["group_0"]["input_activations"].update(dynamic=False, strategy="tensor"),
     r"config_groups.group_0.input_activations: .*dynamic=False"),
    (lambda q: q.update(format="pack-quantized"), r"quantization_config.format: 'pack-quantized'"),
])
def test_unsupported_schemes_are_named_at_load(quantized, tmp_path, edit, message):
    path = _edit_quantization_config(quantized / "w8a8-int8", tmp_path / "edited", edit)
    with pytest.raises(ValueError, match=message):
        LLM(str(path), kv_cache_memory="1MiB")


def test_a_missing_scale_and_a_second_quantization_are_named(quantized, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "no-scale"
    shutil.copytree(quantized / "w8a8-int8", path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight_scale"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"weights missing .*layers.1.self_attn.qkv_proj.weight_scale#k"):
        LLM(str(path), kv_cache_memory="1MiB")
    with pytest.raises(ValueError, match="quantization: 'int8' asks to quantize a checkpoint that is quantized"):
        LLM(str(quantized / "w8a8-int8"), kv_cache_memory="1MiB", quantization="int8")


def test_fp8_layer_matches_exact_fp8_arithmetic():
    """The CUDA fp8 layer's math, run through torch._scaled_mm on the CPU: per-token fp8
    activations times per-channel fp8 weights, rescaled, with the bias."""
    from tokenmill.executor.layers.quantization.fp8 import Fp8LinearMethod, quantize_fp8_rows

    gen = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=gen) * 0.05
    x = torch.randn(5, 64, generator=gen)
    bias = torch.randn(96, generator=gen)
    layer = Linear(64, 96, bias=True, quant_method=Fp8LinearMethod(from_checkpoint=False))
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(bias)
    layer.pack()
    assert layer.weight.dtype == torch.float8_e4m3fn
    qx, sx = quantize_fp8_rows(x)
    qw, sw = quantize_fp8_rows(w)
    exact = (qx.double() @ qw.double().t()) * sx.double() * sw.double().t() + bias.double()
    torch.testing.assert_close(layer(x).double(), exact, rtol=1e-4, atol=1e-4)
    assert (layer(x) - F.linear(x, w, bias)).norm() / F.linear(x, w, bias).norm() < 0.1


def test_fp8_is_refused_on_the_cpu():
    with pytest.raises(ValueError, match="quantization: fp8 runs on CUDA"):
        LLM(str(DEFAULT_MODEL_DIR), kv_cache_memory="1MiB", quantization="fp8")


@pytest.mark.parametrize("scheme", ["w8a8-int8", "fp8-dynamic"])
def test_dummy_weights_fill_a_quantized_checkpoints_layers(quantized, scheme):
    llm = LLM(str(quantized / scheme), load_format="dummy", dtype="float32", kv_cache_memory="1MiB")
    out = llm.generate("def f(x):", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4

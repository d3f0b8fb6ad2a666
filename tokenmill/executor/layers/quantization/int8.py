"""W8A8 INT8 on the CPU: weights int8 per output channel (symmetric), activations int8 per
token (symmetric, dynamic), the GEMM in fbgemm, and in oneDNN for larger steps on CPUs with
AMX (see ONEDNN_WORK). On CPUs with AMX, layers whose inputs are a multiple of 64 take the
native amx_int8_linear (csrc/amx_linear.cpp) instead of fbgemm, for steps of up to AMX_ROWS rows,
and oneDNN above: on a 2-core Xeon it ran the 56M model's layers at 0.9-2.6x the bfloat16
layers (amx_linear) from 1 to 256 rows, where fbgemm ran them at 0.3-1.8x, and the wide model's
at 1.7-2.8x up to 16 rows (benchmarks/int8_gemm.py, `amx` and `direct`).

The GEMM was picked by measurement (benchmarks/int8_gemm.py, a 2-core AVX2 CPU without
VNNI): fbgemm ran the engine's shapes 1.3-7.9x faster than the fp32 dense layer, while
oneDNN's qlinear (0.1-1.3x) and torch._int_mm (0.01-0.15x) were slower than dense.
The native kernels call fbgemm directly (csrc/int8_linear.cpp): each token's row is
quantized, the GEMM runs on one column part per thread and each part rescales its own
columns, in one op. Without them, torch's quantized op does the GEMM: it quantizes its
input with one scale for the whole tensor, so each row is first scaled to the quantized
range (the row's scale kept), fbgemm rounds it with scale 1 (zero point qmax + 1, its
unsigned form), and the output is multiplied back by the row scales.
Without VNNI, fbgemm multiplies u8 x s8 pairs into int16 sums, which saturate with 8-bit
activations (4% off on plain inputs); there activations take 7 bits (qmax 63, PyTorch's
reduce_range), which is exact integer arithmetic again and closer to float (1% off). With
AVX512-VNNI the sums are int32 and activations keep 8 bits.
"""

from __future__ import annotations

import warnings
from functools import cache
from types import ModuleType

import torch
from torch import nn

from tokenmill.executor.layers.linear import pack_int8_quads, packed_rows

# A layer of K x N weights takes oneDNN's int8 GEMM from ONEDNN_WORK / (K N) rows on (at least
# 17, at most 128), where both are there: on the 2-core Xeon above, fbgemm won below about 64-100
# rows at 512 x 1024, 48-64 at 512 x 2816, and 16 or fewer from 2048 x 4096 on.
ONEDNN_WORK = 64 << 20
ONEDNN_ROWS = (17, 128)
# amx_int8_linear's row limit (its MAX_ROWS) and the inputs it needs a multiple of
AMX_ROWS, AMX_CHUNK = 256, 64


class Int8Config:
    name = "int8"

    def __init__(self, device: torch.device, kernels: ModuleType | None) -> None:
        if device.type != "cpu":
            raise ValueError("quantization: int8 runs on the CPU (fbgemm); on CUDA it is not built yet")
        if "fbgemm" not in torch.backends.quantized.supported_engines:
            raise ValueError("quantization: int8 needs torch's fbgemm engine (x86-64 CPUs), which this torch build "
                             f"lacks (it has {', '.join(torch.backends.quantized.supported_engines)})")
        self.kernels = kernels

    def linear_method(self, layer_name: str, shard_names: tuple[str, ...] = ()) -> Int8LinearMethod | None:
        return None if layer_name.endswith("lm_head") else Int8LinearMethod(self.kernels)


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of w [N, K]: (q int8, scale float32 [N]) with w ~ q * scale."""
    scale = w.float().abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w.float() / scale.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux), or none where they cannot be read; read once (every
    int8 layer's method asks)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split()[2:])
    except OSError:
        return frozenset()


def activation_qmax() -> int:
    """The largest activation value: 127 where fbgemm's int8 products accumulate in int32
    (AVX512-VNNI), else 63, so that its int16 pair sums cannot saturate."""
    return 127 if "avx512_vnni" in cpu_flags() else 63


def has_vnni() -> bool:
    """Whether the CPU multiplies int8 into int32 sums (VNNI or AMX-INT8). Without it, oneDNN's
    int8 GEMM sums pairs of u8 x s8 products in saturating int16 (its s8 activations shifted to
    u8), whatever the activations' range: on an AVX2-only AMD EPYC its outputs were 1-2% off
    exact int8 arithmetic, where fbgemm's with 7-bit activations were exact."""
    return not {"avx512_vnni", "avx_vnni", "amx_int8"}.isdisjoint(cpu_flags())


def onednn_rows(in_features: int, out_features: int) -> int:
    """The rows from which a layer of this shape takes oneDNN's int8 GEMM (see ONEDNN_WORK)."""
    low, high = ONEDNN_ROWS
    return max(low, min(high, ONEDNN_WORK // (in_features * out_features)))


def scale_rows(x: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x scaled to [-qmax, qmax] per row, float32; the rows' scales [T, 1])."""
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    return x.float() / scale, scale


class Int8LinearMethod:
    """The layer loads its 16-bit weight as usual; after loading, it is quantized and packed
    for the layer's GEMMs (`pack`) and the 16-bit copy is dropped. The bias stays in the
    layer's dtype and is added after the rescale."""

    def __init__(self, kernels: ModuleType | None, qmax: int | None = None, onednn: bool | None = None,
                 amx: bool | None = None) -> None:
        """`onednn`: whether layers also take oneDNN's GEMM for larger steps; `amx`: whether they
        take amx_int8_linear for steps of up to AMX_ROWS rows; both by default where the CPU has
        AMX-INT8 (with the native kernels, which quantize the rows for them). oneDNN's only
        where the CPU has VNNI (`has_vnni`: without it, its sums saturate)."""
        self.kernels = kernels
        self.native = kernels is not None and hasattr(kernels, "int8_linear")  # else torch's quantized op
        self.qmax = qmax or activation_qmax()
        if onednn is None:
            onednn = self.native and "amx_int8" in cpu_flags()
        self.onednn = onednn and self.native and has_vnni() and hasattr(torch.ops.onednn, "qlinear_prepack")
        if amx is None:
            amx = "amx_int8" in cpu_flags()
        self.amx = amx and self.native and self.qmax == 127 and kernels.has_amx_linear

    def create_weights(self, layer: nn.Module) -> None:
        layer.packed_int8 = None  # the native kernels' Int8Weight, else torch's fbgemm packing
        layer.onednn_int8 = None  # (oneDNN's packed weight, its scales, zero points), where it is used
        layer.onednn_rows = 0  # the rows from which a step takes it
        layer.amx_int8 = None  # (the weight laid out by pack_int8_quads, its scales), where it is used

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        qweight, scale = quantize_per_channel(layer.weight.detach())
        self.pack(layer, qweight, scale)

    def pack(self, layer: nn.Module, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        """An int8 weight and its per-channel scales packed for the layer's GEMMs: amx_int8_linear's
        layout and oneDNN's where the CPU has AMX (and the inputs are a multiple of 64), else
        fbgemm's (and oneDNN's)."""
        self.create_weights(layer)
        layer.weight = nn.Parameter(torch.empty(0, dtype=layer.weight.dtype), requires_grad=False)
        if self.native:
            amx = self.amx and qweight.shape[1] % AMX_CHUNK == 0
            if amx:
                layer.amx_int8 = (pack_int8_quads(qweight), scale.float().contiguous())
            if not (amx and self.onednn):  # (with both, fbgemm's copy would serve no step)
                layer.packed_int8 = self.kernels.int8_pack(qweight, scale, self.qmax)
            if self.onednn:
                scale = scale.float().contiguous()
                layer.onednn_int8 = (torch.ops.onednn.qlinear_prepack(qweight.contiguous(), None), scale,
                                     torch.zeros(len(scale), dtype=torch.int64))
                layer.onednn_rows = onednn_rows(qweight.shape[1], qweight.shape[0])
            return
        torch.backends.quantized.engine = "fbgemm"
        zero_points = torch.zeros(len(scale), dtype=torch.int64)
        with warnings.catch_warnings():  # torch marks its quantized tensors deprecated; fbgemm still takes them
            warnings.simplefilter("ignore", UserWarning)
            q = torch._make_per_channel_quantized_tensor(qweight, scale.double(), zero_points, 0)
        layer.packed_int8 = torch.ops.quantized.linear_prepack(q, None)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            x = x if x.stride(-1) == 1 else x.contiguous()
            if layer.amx_int8 is not None and x.dim() == 2 and len(x) <= AMX_ROWS:
                return self.kernels.amx_int8_linear(x, *layer.amx_int8, layer.bias, layer.out_features)
            if (layer.onednn_int8 is not None and x.dim() == 2 and len(x) >= layer.onednn_rows
                    and x.shape[1] == layer.in_features):  # (a wrong width gets int8_linear's error)
                return self._onednn(layer, x)
            return self.kernels.int8_linear(x, layer.packed_int8, layer.bias)
        scaled, row_scale = scale_rows(x, self.qmax)
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(scaled, 1.0, self.qmax + 1,
                                                                              layer.packed_int8)
        y = y.mul_(row_scale)
        if layer.bias is not None:
            y = y.add_(layer.bias)
        return y.to(x.dtype)

    def _onednn(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        weight, scale, zero_points = layer.onednn_int8
        q, row_scale = self.kernels.int8_quantize_rows(x, packed_rows(len(x)), self.qmax)
        acc = torch.ops.onednn.qlinear_pointwise(q, 1.0, 0, weight, scale, zero_points, None, 1.0, 0, torch.float32,
                                                 "none", [], "")
        return self.kernels.int8_rescale_rows(acc, row_scale, layer.bias, x.dtype)

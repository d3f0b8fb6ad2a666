"""FP8 W8A8 on CUDA (Hopper and later): weights float8_e4m3fn per output channel,
activations float8_e4m3fn per token (dynamic), one `torch._scaled_mm` per layer with both
scale vectors (rowwise scaling), the output in the model's dtype.

`quantization="fp8"` makes the weights on load from a 16-bit checkpoint (vLLM's
`--quantization fp8`, here with per-channel weight scales); compressed-tensors FP8_DYNAMIC
checkpoints load into the same method (compressed_tensors.py). On the CPU, fp8 is
refused by name (FP8_DYNAMIC checkpoints run dequantized there instead). On CUDA the
activations are quantized by one Triton launch (layers/triton_ops.py), which gives the
same scales and codes as `quantize_fp8_rows` below; on an H200 the nine torch ops of that
function, in every linear layer, left FP8 at 0.91x bf16's throughput.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric float8_e4m3fn per row of x [M, K]: (q, float32 scale [M, 1]), x ~ q * scale."""
    # times the reciprocal, not / FP8_MAX: CUDA divides by a Python number that way, so a
    # checkpoint quantized on the CPU gets the scales (and codes) the GPU makes on load
    scale = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) * (1.0 / FP8_MAX)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


@dataclass(frozen=True)
class Fp8Rows:
    """An FP8 layer's input quantized already, by the kernel before it (triton_ops.rms_norm_fp8
    or silu_and_mul_fp8): the codes [M, K], the float32 scales [M, 1], and the dtype of the
    unquantized activations (the layer's output dtype)."""
    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    def __len__(self) -> int:
        return len(self.q)


def quantizes_input(kernels, fused: str, layer: nn.Module) -> bool:
    """Whether the input of `layer`, which only it reads, can come out of the kernel before it
    quantized (Fp8Rows): an FP8 layer, and that kernel's fused version (`fused`) among `kernels`
    (the Triton layer kernels have rms_norm_fp8 and silu_and_mul_fp8)."""
    return isinstance(layer.quant_method, Fp8LinearMethod) and hasattr(kernels, fused)


class Fp8Config:
    name = "fp8"

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError("quantization: fp8 runs on CUDA (torch._scaled_mm, Hopper or later); on the CPU use int8")

    def linear_method(self, layer_name: str, shard_names: tuple[str, ...] = ()) -> Fp8LinearMethod | None:
        return None if layer_name.endswith("lm_head") else Fp8LinearMethod(from_checkpoint=False)


class Fp8LinearMethod:
    """from_checkpoint: the layer loads fp8 `weight` and float32 `weight_scale` [N, 1]
    (compressed-tensors); otherwise it loads its 16-bit weight and quantizes it after."""

    def __init__(self, from_checkpoint: bool) -> None:
        self.from_checkpoint = from_checkpoint
        self.quantize = quantize_fp8_rows  # the activations' quantization, chosen at load
        self.small_gemm, self.small_rows = None, 0  # steps of up to small_rows rows: that GEMM, chosen at load

    def create_weights(self, layer: nn.Module) -> None:
        if self.from_checkpoint:
            layer.weight = nn.Parameter(torch.empty(layer.weight.shape, dtype=FP8), requires_grad=False)
            layer.weight_scale = nn.Parameter(torch.empty(layer.out_features, 1, dtype=torch.float32),
                                              requires_grad=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.from_checkpoint:
            weight, scale = layer.weight.detach(), layer.weight_scale.detach()
            del layer.weight_scale
        else:
            weight, scale = quantize_fp8_rows(layer.weight.detach())
        layer.weight = nn.Parameter(weight, requires_grad=False)  # [N, K]: its .t() is the column-major B
        layer.weight_scale_row = scale.reshape(1, -1).float().contiguous()  # [1, N]
        if weight.is_cuda:  # one Triton launch per layer and step instead of nine torch ops
            from tokenmill.executor.layers import triton_fp8_gemm, triton_ops
            self.quantize = triton_ops.quantize_fp8_rows
            if triton_fp8_gemm.enabled():  # TOKENMILL_FP8_GEMM=triton: not yet timed on a GPU
                self.small_gemm, self.small_rows = triton_fp8_gemm.fp8_gemm, triton_fp8_gemm.SMALL_M

    def apply(self, layer: nn.Module, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        (q, scale), dtype = ((x.q, x.scale) if isinstance(x, Fp8Rows) else self.quantize(x)), x.dtype
        bias = layer.bias if layer.bias is None or layer.bias.dtype == dtype else layer.bias.to(dtype)
        if len(x) <= self.small_rows:
            return self.small_gemm(q, scale, layer.weight, layer.weight_scale_row, bias, dtype)
        late = bias is not None and dtype == torch.float32  # CUDA's _scaled_mm takes no bias for float32 out
        out = torch._scaled_mm(q, layer.weight.t(), scale_a=scale, scale_b=layer.weight_scale_row,
                               bias=None if late else bias, out_dtype=dtype)
        return out + bias if late else out

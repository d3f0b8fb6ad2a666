"""RMSNorm with an optional residual add before it (the residual stream of a decoder layer)."""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.executor.layers.quantization.fp8 import Fp8Rows


class RMSNorm(nn.Module):
    """`kernels`: the native CPU kernels, or the Triton layer kernels beside Triton attention
    (executor/layers/triton_ops.py), when the model is built; the choice between them and
    torch ops is made here, once, not on every call."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, kernels: ModuleType | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.kernels = kernels
        self.impl = self.forward_kernels if kernels is not None else self.forward_native
        # the output quantized for the FP8 layer that alone reads it (Fp8Rows), set once the
        # weights are packed (LlamaForCausalLM.pack_weights); the Triton kernels only
        self.fp8_output = False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.impl(x, residual)

    def forward_kernels(self, x: torch.Tensor, residual: torch.Tensor | None
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # one launch: residual += x in place, then the norm of the sum; [T, heads, d]
        # (q/k norm) is flattened to rows, copied when the heads are a strided view
        if self.fp8_output:
            out = Fp8Rows(*self.kernels.rms_norm_fp8(x, residual, self.weight, self.eps), x.dtype)
        else:
            out = self.kernels.rms_norm(x.reshape(-1, x.shape[-1]), residual, self.weight, self.eps).view(x.shape)
        return out if residual is None else (out, residual)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            # the residual stream stays in the model dtype, as in the reference implementation
            x = x + residual
            residual = x
        out = F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # accumulates in float32
        return out if residual is None else (out, residual)

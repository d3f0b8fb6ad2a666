"""RMSNorm with an optional residual add before it (the residual stream of a decoder layer)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.executor.cpu_kernels import kernels_for


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        kernels = kernels_for(x)
        if kernels is not None:
            # one pass: residual += x in place, then the norm of the sum; [T, heads, d]
            # (q/k norm) is flattened to rows, copied when the heads are a strided view
            out = kernels.rms_norm(x.reshape(-1, x.shape[-1]), residual, self.weight, self.eps).view(x.shape)
            return out if residual is None else (out, residual)
        if residual is not None:
            # the residual stream stays in the model dtype, as in the reference implementation
            x = x + residual
            residual = x
        out = F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # accumulates in float32
        return out if residual is None else (out, residual)

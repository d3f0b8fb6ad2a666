"""RMSNorm with an optional residual add before it (the residual stream of a decoder layer)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            # the residual stream stays in the model dtype, as in the reference implementation
            x = x + residual
            residual = x
        # one fused op; it accumulates in float32 like the reference does
        out = F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return out if residual is None else (out, residual)

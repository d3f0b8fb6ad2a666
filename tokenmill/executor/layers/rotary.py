"""Rotary position embeddings (rotate-half layout) with linear and llama3 frequency scaling."""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any, NamedTuple

import torch
from torch import nn


class Rope(NamedTuple):
    positions: torch.Tensor  # [T] int64
    cos_sin: torch.Tensor  # float32 [max_position, head_dim]
    cos: torch.Tensor | None  # [T, 1, head_dim] in the model dtype, torch path only
    sin: torch.Tensor | None
    kernels: ModuleType | None  # the CPU or Triton layer kernels, which rotate in place


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between
    # interpolated smoothly (Llama 3.1 technical report, section on long context)
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin are precomputed once for every position up to max_position. With kernels (the
    native CPU ones or Triton's, chosen when the model is built) q and k are rotated in place."""

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None = None, kernels: ModuleType | None = None) -> None:
        super().__init__()
        self.kernels = kernels
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # float32 [max_position, head_dim]: cos of the half-dim frequencies, then their sin
        self.register_buffer("cos_sin", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """The step's rotary inputs, looked up once and used by every layer."""
        if self.kernels is not None:
            return Rope(positions, self.cos_sin, None, None, self.kernels)
        cos, sin = self.cos_sin[positions].chunk(2, dim=-1)
        # the reference rounds cos and sin to the model dtype before multiplying
        cos = torch.cat((cos, cos), dim=-1).to(dtype).unsqueeze(1)
        sin = torch.cat((sin, sin), dim=-1).to(dtype).unsqueeze(1)
        return Rope(positions, self.cos_sin, cos, sin, None)

    @staticmethod
    def apply(rope: Rope, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, head_dim], k: [T, kv_heads, head_dim]; a kernel rotates in place."""
        if rope.kernels is not None:
            rope.kernels.rotary(q, rope.positions, rope.cos_sin)
            rope.kernels.rotary(k, rope.positions, rope.cos_sin)
            return q, k
        return _rotate(q, rope.cos, rope.sin), _rotate(k, rope.cos, rope.sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin

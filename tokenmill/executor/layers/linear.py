"""Linear layers that know how to load their checkpoint shards.

Several checkpoint tensors may map onto one fused layer (q/k/v into qkv_proj,
gate/up into gate_up_proj): one matmul instead of three is worth it on every
device. `load_shard` copies one checkpoint tensor into its rows of the fused weight; under tensor
parallelism (`tp_shard`, executor/distributed) it first takes this rank's part of it.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.executor.cpu_kernels import load_cpu_kernels

if TYPE_CHECKING:
    from tokenmill.executor.distributed.parallel import ColumnShard, RowShard

# float32 weights with fewer elements than this (8 MB) also keep a copy laid out by pack_small (on
# a CPU without AVX-512, every float32 weight keeps that copy alone: SMALL_ONLY below), for
# steps of at most SMALL_ROWS rows (decodes of a batch, speculative verification, short prompt
# chunks): the CPU kernels' small_linear reads each weight once for up to 6 rows, in passes of 6
# over a thread's chunk of weights past 6, and keeps each output in one lane (AVX2 + FMA). On a
# 2-core AMD EPYC (AVX2, no AVX-512) it beat oneDNN's packed float32 call up to 256 rows at the
# built-in and 56M models' shapes (benchmarks/linear_layout.py): 2-6x at one row, 1.2-1.7x at 64,
# 1.1-1.25x at 256, where it runs near the FMA peak (the draft's 128 x 128 alone fell behind, at
# 256 rows); a small model's steps of up to SMALL_ROWS tokens then also run in one native call
# (executor/fused_decoder.py). The built-in model decoded 24 requests at 1.23x and 64 at 1.10x
# the tokens/s it did with 16 rows (the limit before that layout). On CPUs with AVX-512, oneDNN's
# float32 call has twice the vector width, and the old limit stays (not measured past it there).
# Without the kernels MKL's GEMM runs a plain copy up to PLAIN_ROWS rows, where it beats
# oneDNN's packed layout
SMALL_FLOAT32_WEIGHT = 1 << 21
AVX512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
SMALL_ROWS = 16 if AVX512 else 256
PLAIN_ROWS = 4
# On a CPU without AVX-512 (with the kernels) every float32 layer keeps that copy alone, whatever
# its size, and runs every step on small_linear: no oneDNN copy. With a bfloat16 copy it ran the
# built-in, 56M and wide (hidden 2048) models' layers at 3.3-8.5x oneDNN's packed float32 call at
# one row, 0.95-1.9x at 16-256 rows and about even from 512 to 2,048 (0.78-1.29x), on a 2-core
# AMD EPYC (benchmarks/linear_layout.py), while a bfloat16 checkpoint served in float32 keeps half
# the bytes of float32 in memory, not 1.5x (a copy of each kind) or 1x (the packed one alone,
# past SMALL_FLOAT32_WEIGHT); benchmarks/float32_weights.py compares the engines.
SMALL_ONLY = not AVX512
# a float32 weight whose every value is a bfloat16 one (a bfloat16 checkpoint served in float32, as
# on a CPU without AVX512-BF16) keeps that copy in bfloat16, which small_linear widens exactly as it
# reads it: the same output bit for bit from half the bytes, and up to twice the elements in the
# same 8 MB (the built-in model's 8,192 x 256 LM head).


# bfloat16 weights with fewer elements than this (8 MB), with the CPU kernels' small_linear_bf16
# (AVX512-BF16), keep a copy laid out by pack_bf16_pairs for steps of up to 4 rows, and 4 more
# for each SMALL_BFLOAT16_WORK elements fewer, up to 16: oneDNN's packed call (AMX where the CPU
# has it) costs 20-30 us at least alone, flat in the rows, while the kernel's dot products grow
# with them (benchmarks/linear_layout.py). In the engine, after attention, oneDNN's call cost
# more: 75 us for 6 rows of the built-in model's 256 x 1408 gate_up, against 30 us through the
# kernel, which stayed ahead up to about 12 rows. With up to `SMALL_BFLOAT16_WORK // elements`
# rows (5 for that gate_up) the built-in model decoded 8 requests at 2,511 tok/s; with 4 more
# (9), at 2,890 (1.16x, a 2-core Xeon, interleaved turns); 1.02x at 16 and 1 request. Larger
# weights gain little (12% at one row of 2048 x 11264) for a second copy of many megabytes.
SMALL_BFLOAT16_WEIGHT = 1 << 22
SMALL_BFLOAT16_WORK = 1 << 21
# on a CPU with AMX-BF16 (Sapphire Rapids and later Xeons) that copy runs through amx_linear
# instead, for steps of up to AMX_ROWS rows, where the layer's inputs are a multiple of 32: at
# the built-in model's shapes it costs 3-8 us a call from 1 to 32 rows and 5-15 at 64, against
# oneDNN's 17-25 and 23-35 and small_linear_bf16's 3-50 (up to 16 rows), and its LM head 35-63
# and 110 us against 71-135 and 171 (benchmarks/linear_layout.py, a 2-core Xeon). Layers of at
# most AMX_NARROW inputs (a 64-row tile of x in 32 KB, within L1) or 2 x AMX_NARROW outputs (x
# read again for few blocks of outputs) take up to AMX_NARROW_ROWS rows, 64 at a time: at 65 rows the
# built-in model's gate/up costs 19 us against oneDNN's 37, at 256 rows 64 against 73 (its down
# 42 against 65, its LM head 454 against 498); the 56M model's 1024 x 512 and 2816 x 512 fell
# behind oneDNN past 128. A step that left every layer for oneDNN at 65 rows cost 2.35 ms
# against 1.51 at 64 (the built-in model), and adaptive n-gram at 64 requests, verifying drafts
# past it, lost 7-13%
AMX_ROWS = 64
AMX_NARROW, AMX_NARROW_ROWS = 256, 256


def amx_linear_rows(out_features: int, in_features: int) -> int:
    """The most rows amx_linear takes for a weight of that shape (0: none, inputs not a
    multiple of 32); see AMX_ROWS."""
    if in_features % 32:
        return 0
    return AMX_NARROW_ROWS if in_features <= AMX_NARROW or out_features <= 2 * AMX_NARROW else AMX_ROWS


def exactly_bfloat16(w: torch.Tensor) -> bool:
    """Whether every value of `w` is a bfloat16 one."""
    return torch.equal(w.detach().to(torch.bfloat16).to(w.dtype), w.detach())


def packed_rows(rows: int) -> int:
    """The rows a packed (oneDNN) call computes for a step of `rows`: up to 16 as they are,
    then rounded up to one of 8 sizes an octave (18, 20, ..., 32, 36, ..., 64, 72, ...: at most
    1/8 more rows, zeros). oneDNN JIT-compiles a kernel for each distinct shape and keeps it in
    a cache (tokenmill/__init__.py); a step's row count changes from step to step (batch size,
    prompt chunks, verified drafts), and on a 2-core Xeon with AMX a compile took 0.7 ms a layer
    shape: with each count its own kernel, 64 kept, 16 n-gram requests that verified 1-64 drafts
    a step recompiled a few kernels every step, and ran at 0.81x the throughput of no drafts
    (1.12x with the kernels kept). Rounded, a model's layers have at most 72 shapes up to 2,048
    rows each."""
    if rows <= 16:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def small_bfloat16_rows(numel: int) -> int:
    """The most rows a bfloat16 weight of `numel` elements runs through small_linear_bf16."""
    return min(16, 4 + SMALL_BFLOAT16_WORK // max(1, numel))


def pack_bf16_pairs(w: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [out / 16, in / 2, 16, 2], zero-padded: for each block of 16 outputs and
    pair of inputs, the 16 outputs' two weights (what small_linear_bf16 reads)."""
    out_features, in_features = w.shape
    w = F.pad(w, (0, in_features % 2, 0, -out_features % 16))
    return w.view(w.shape[0] // 16, 16, w.shape[1] // 2, 2).transpose(1, 2).contiguous()


def pack_small(w: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [out / 16, in, 16], zero-padded: for each block of 16 outputs and each input,
    the 16 outputs' weights (what small_linear reads); a bfloat16 block's in the order [0-3, 8-11,
    4-7, 12-15], which an in-lane unpack widens to outputs 0-7 and 8-15."""
    out_features, in_features = w.shape
    w = F.pad(w, (0, 0, 0, -out_features % 16)).view(-1, 16, in_features)
    if w.dtype == torch.bfloat16:
        w = w[:, BFLOAT16_LANES]
    return w.transpose(1, 2).contiguous()


BFLOAT16_LANES = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]


def pack_int8_quads(w: torch.Tensor) -> torch.Tensor:
    """int8 [out, in] (in a multiple of 4) -> [out / 16, in / 4, 16, 4], zero-padded: for each block
    of 16 outputs and four inputs, the 16 outputs' four weights (what amx_int8_linear reads)."""
    out_features, in_features = w.shape
    w = F.pad(w, (0, 0, 0, -out_features % 16))
    return w.view(w.shape[0] // 16, 16, in_features // 4, 4).transpose(1, 2).contiguous()


class Linear(nn.Module):
    """y = x W^T (+ b), whose output rows may be split into named shards. With a
    `quant_method` (layers/quantization), the method declares what the layer loads, packs
    it after loading and runs the layer."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int] | int, bias: bool = False,
                 quant_method=None, tp_shard: ColumnShard | RowShard | None = None) -> None:
        super().__init__()
        self.tp_shard = tp_shard
        if isinstance(shard_sizes, int):
            shard_sizes = {"": shard_sizes}
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size
        self.in_features, self.out_features = in_features, offset
        self.weight = nn.Parameter(torch.empty(offset, in_features))
        self.bias = nn.Parameter(torch.empty(offset)) if bias else None
        self.packed: torch.Tensor | None = None
        # the weight kept beside the packed one for steps of at most small_rows rows: a float32
        # one laid out by pack_small (plain where small_linear is missing), a bfloat16 one by
        # pack_bf16_pairs; small_kernel: the CPU kernel for it
        self.small: torch.Tensor | None = None
        self.small_kernel = None
        self.small_rows = SMALL_ROWS
        self.quant_method = quant_method
        if quant_method is not None:
            quant_method.create_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x)
        if self.packed is None and self.small_kernel is not None:  # its only copy (SMALL_ONLY)
            if x.dim() == 2 and x.shape[0] > 0:
                return self.small_kernel(x, self.small, self.bias)
            flat = x.reshape(-1, x.shape[-1])  # (the kernel takes rows, at least one)
            y = self.small_kernel(flat, self.small, self.bias) if len(flat) else x.new_empty(0, self.out_features)
            return y.view(*x.shape[:-1], self.out_features)
        if self.packed is not None:
            if self.small is not None and x.shape[0] <= self.small_rows:
                if self.small_kernel is not None:
                    if x.dim() == 2 and x.shape[0] > 0:
                        return self.small_kernel(x, self.small, self.bias)
                elif x.shape[0] <= PLAIN_ROWS and self.small.dtype == torch.float32:
                    return F.linear(x, self.small, self.bias)
            rows = x.shape[0]
            padded = packed_rows(rows) if x.dim() == 2 else rows
            if padded != rows:
                x = F.pad(x, (0, 0, 0, padded - rows))
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")[:rows]
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def pack(self) -> None:
        """Switches to oneDNN's packed layout once weights are loaded, on the CPU: 16-bit
        weights are 15-40% faster on small batches; float32 ones 1.3-1.5x faster end to
        end than MKL's GEMM on an AVX2 AMD CPU (the 56M model, 1 and 64 requests), up to
        2.8x at the LM head's shape. Small float32 weights keep a second copy too, for steps
        of at most SMALL_ROWS rows (see SMALL_FLOAT32_WEIGHT): laid out by pack_small for
        small_linear, or plain for MKL's GEMM without the kernels (oneDNN's call costs about
        30 us more at one row, which made a forward of the built-in model 11% slower and of
        its draft 26% than MKL's GEMM, `benchmarks/linear_layout.py`); in bfloat16 where
        every value is a bfloat16 one (see exactly_bfloat16).
        Small bfloat16 weights keep a copy for small_linear_bf16, or amx_linear where the CPU
        has AMX (see SMALL_BFLOAT16_WEIGHT and AMX_ROWS).
        Otherwise the plain copy is dropped once packed. A quantized layer packs as its
        method says. On a CPU without AVX-512 a float32 weight is laid out for small_linear
        alone, in bfloat16 where every value is a bfloat16 one (SMALL_ONLY)."""
        if self.quant_method is not None:
            self.quant_method.process_weights_after_loading(self)
            return
        w = self.weight
        if SMALL_ONLY and w.device.type == "cpu" and w.dtype == torch.float32:
            kernels = load_cpu_kernels()
            if kernels is not None and kernels.has_small_linear:
                self._keep_small(w, kernels, exactly_bfloat16(w))
                self.weight = nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)
                return
        if w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16, torch.float16) \
                and torch.backends.mkldnn.is_available():
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 64)
            except RuntimeError:  # no 16-bit path in oneDNN on this CPU (no AVX-512 or AVX-NE-CONVERT)
                return
            kernels = load_cpu_kernels()
            if w.dtype == torch.float32 and kernels is not None and kernels.has_small_linear \
                    and w.numel() < 2 * SMALL_FLOAT32_WEIGHT and exactly_bfloat16(w):
                self._keep_small(w, kernels, bfloat16=True)
            elif w.dtype == torch.float32 and w.numel() < SMALL_FLOAT32_WEIGHT:
                self.small = w.detach()  # (MKL's plain copy where the kernels do not build)
                if kernels is not None and kernels.has_small_linear:
                    self._keep_small(w, kernels, bfloat16=False)
            elif w.dtype == torch.bfloat16 and w.numel() < SMALL_BFLOAT16_WEIGHT and kernels is not None \
                    and kernels.has_small_linear_bf16:
                self.small = pack_bf16_pairs(w.detach())
                if kernels.has_amx_linear and (rows := amx_linear_rows(*w.shape)):
                    self.small_kernel = partial(kernels.amx_linear, out=self.out_features)
                    self.small_rows = rows
                else:
                    self.small_kernel = partial(kernels.small_linear_bf16, out=self.out_features)
                    self.small_rows = small_bfloat16_rows(w.numel())
            self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def _keep_small(self, w: torch.Tensor, kernels, bfloat16: bool) -> None:
        """small_linear's copy of the float32 weight `w`, laid out by pack_small (in bfloat16 where
        its values are bfloat16 ones), and the kernel for it."""
        self.small = pack_small(w.detach().to(torch.bfloat16) if bfloat16 else w.detach())
        self.small_kernel = partial(kernels.small_linear, out=self.out_features)

    def load_shard(self, param_name: str, shard: str, tensor: torch.Tensor) -> None:
        param = self._parameters.get(param_name)  # weight, bias, and what a quantization method adds
        if param is None:
            raise ValueError(f"checkpoint has a {param_name} for a layer built without one")
        if self.tp_shard is not None:
            tensor = self.tp_shard.narrow(param_name, shard, tensor)
        start, size = self.shard_offsets[shard]
        target = param.data.narrow(0, start, size)
        if target.shape != tensor.shape:
            raise ValueError(f"shape mismatch for shard {shard or 'weight'}: checkpoint {tuple(tensor.shape)}, "
                             f"model {tuple(target.shape)}")
        target.copy_(tensor)

"""Llama, Mistral, Qwen2 and Qwen3 from one module; the differences are flags in ModelConfig:
q/k/v bias (Qwen2, Llama's attention_bias), per-head q/k RMSNorm (Qwen3), tied
embeddings, head_dim, rope scaling. Tokens arrive flattened: [T] ids, [T] positions.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.config import ModelConfig
from tokenmill.executor.attention.base import AttentionBackend
from tokenmill.executor.distributed.parallel import (TensorParallel, VocabParallelEmbedding, attention_shards, mlp_shards,
                                                     shard_model_config)
from tokenmill.executor.layers.linear import Linear
from tokenmill.executor.layers.quantization import QuantConfig
from tokenmill.executor.layers.quantization.fp8 import Fp8Rows, quantizes_input
from tokenmill.executor.layers.norm import RMSNorm
from tokenmill.executor.layers.rotary import Rope, RotaryEmbedding

# checkpoint name piece -> (our module piece, shard)
_FUSED = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
}


def _method(quant: QuantConfig | None, name: str):
    """The quantization method of the layer `name`, told which checkpoint layers it fuses."""
    if quant is None:
        return None
    shards = tuple(k for k, (target, _) in _FUSED.items() if target == name.rsplit(".", 1)[1])
    return quant.linear_method(name, shards)


class LlamaAttention(nn.Module):
    """`cfg`: the whole model's shape; under tensor parallelism (`tp`) this rank builds its
    heads only, and sums o_proj's partial outputs with the other ranks'."""

    def __init__(self, cfg: ModelConfig, layer: int, kernels: ModuleType | None,
                 quant: QuantConfig | None = None, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.tp = tp
        local = shard_model_config(cfg, tp.size) if tp else cfg
        self.num_heads, self.num_kv_heads, self.head_dim = local.num_heads, local.num_kv_heads, cfg.head_dim
        q_size, kv_size = local.num_heads * cfg.head_dim, local.num_kv_heads * cfg.head_dim
        qkv_shard, o_shard = attention_shards(tp, cfg) if tp else (None, None)
        prefix = f"model.layers.{layer}.self_attn"
        self.qkv_proj = Linear(cfg.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias=cfg.qkv_bias,
                               quant_method=_method(quant, f"{prefix}.qkv_proj"), tp_shard=qkv_shard)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=cfg.o_bias, quant_method=_method(quant, f"{prefix}.o_proj"),
                             tp_shard=o_shard)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, kernels) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, kernels) if cfg.qk_norm else None
        self.splits = [q_size, kv_size, kv_size]
        # the Triton layer kernels norm and rotate q and k in one launch
        self.qk_norm_rotary = getattr(kernels, "qk_norm_rotary", None)

    def forward(self, rope: Rope, x: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.splits, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm_rotary is not None:
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.q_norm is not None else \
                (None, None, 0.0)
            q, k = self.qk_norm_rotary(q, k, norms[0], norms[1], norms[2], rope.positions, rope.cos_sin)
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = RotaryEmbedding.apply(rope, q, k)
        o = attn(q, k, v, self.layer)
        o = self.o_proj(o.reshape(-1, self.num_heads * self.head_dim))
        return o if self.tp is None else self.tp.all_reduce(o)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, kernels: ModuleType | None,
                 quant: QuantConfig | None = None, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.kernels = kernels
        self.tp = tp
        size = (shard_model_config(cfg, tp.size) if tp else cfg).intermediate_size
        gate_up_shard, down_shard = mlp_shards(tp, cfg) if tp else (None, None)
        prefix = f"model.layers.{layer}.mlp"
        self.gate_up_proj = Linear(cfg.hidden_size, {"gate": size, "up": size}, bias=cfg.mlp_bias,
                                   quant_method=_method(quant, f"{prefix}.gate_up_proj"), tp_shard=gate_up_shard)
        self.down_proj = Linear(size, cfg.hidden_size, bias=cfg.mlp_bias,
                                quant_method=_method(quant, f"{prefix}.down_proj"), tp_shard=down_shard)
        self.fp8_down = False  # the activation quantized for an FP8 down_proj in its launch (pack_weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fp8_down:
            x = self.down_proj(Fp8Rows(*self.kernels.silu_and_mul_fp8(gate_up), gate_up.dtype))
        elif self.kernels is not None:
            x = self.down_proj(self.kernels.silu_and_mul(gate_up))
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            x = self.down_proj(F.silu(gate) * up)
        return x if self.tp is None else self.tp.all_reduce(x)


class LlamaDecoderLayer(nn.Module):
    """`input_norm=False`: the layer reads its input as it is (an EAGLE head's first layer)."""

    def __init__(self, cfg: ModelConfig, layer: int, kernels: ModuleType | None,
                 quant: QuantConfig | None = None, tp: TensorParallel | None = None, input_norm: bool = True) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer, kernels, quant, tp)
        self.mlp = LlamaMLP(cfg, layer, kernels, quant, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels) if input_norm else None
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)

    def forward(self, rope: Rope, x: torch.Tensor, residual: torch.Tensor | None,
                attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            if self.input_layernorm is not None:
                x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, attn)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """`kernels`: the native CPU kernels when built for the CPU, the Triton layer kernels beside
    Triton attention, or None (torch ops); every layer picks its implementation once, here.
    `quant`: the linear layers' quantization (the LM head and embeddings stay unquantized).
    `tp`: this rank's place in a tensor-parallel group (executor/distributed), which builds
    its part of each layer."""

    def __init__(self, cfg: ModelConfig, max_position: int, kernels: ModuleType | None = None,
                 quant: QuantConfig | None = None, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling, kernels)
        if tp is None:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(tp, cfg.vocab_size, cfg.hidden_size)
            self.lm_head = Linear(cfg.hidden_size, self.embed_tokens.rows, tp_shard=self.embed_tokens.shard)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, kernels, quant, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # one parameter, named embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        rope = self.rotary.lookup(positions, x.dtype)
        for layer in self.layers:
            x, residual = layer(rope, x, residual, attn)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, vocab] in the model's dtype; the sampler widens them when it needs to. Under
        tensor parallelism every rank computes its slice of the vocabulary and gets them all."""
        if self.tp is None:
            return self.lm_head(hidden)
        return self.tp.all_gather_last(self.lm_head(hidden))[:, :self.cfg.vocab_size]

    def pack_weights(self) -> None:
        """After loading: every linear layer in the fastest CPU layout. A tied head packs
        its own copy; the embedding keeps the plain weight for lookups. A norm whose output
        only an FP8 layer reads (qkv, gate/up) quantizes it in its own launch (Fp8Rows), and so
        does the activation before an FP8 down projection."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        for layer in self.layers:
            for norm, linear in ((layer.input_layernorm, layer.self_attn.qkv_proj),
                                 (layer.post_attention_layernorm, layer.mlp.gate_up_proj)):
                if norm is not None and quantizes_input(norm.kernels, "rms_norm_fp8", linear):
                    norm.fp8_output = True
            layer.mlp.fp8_down = quantizes_input(layer.mlp.kernels, "silu_and_mul_fp8", layer.mlp.down_proj)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies checkpoint tensors (Hugging Face names) into the model; returns the
        names of the parameters it filled."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue
            if name.endswith("_zero_point"):  # quantized checkpoints: symmetric schemes store zeros
                if tensor.any():
                    raise ValueError(f"checkpoint tensor {name}: nonzero zero points (asymmetric quantization) "
                                     "are not supported")
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue  # tied: the embedding is the head
            parts = name.split(".")
            target, shard = _FUSED.get(parts[-2], (None, "")) if len(parts) >= 2 else (None, "")
            if target is not None:
                parts[-2] = target
            module_name, param_name = ".".join(parts[:-1]), parts[-1]
            module = modules.get(module_name)
            if isinstance(module, Linear):
                module.load_shard(param_name, shard, tensor)
            elif name in params:
                if isinstance(module, VocabParallelEmbedding):
                    tensor = module.shard.narrow(param_name, "", tensor)
                if params[name].shape != tensor.shape:
                    raise ValueError(f"weight {name}: checkpoint shape {tuple(tensor.shape)}, "
                                     f"model expects {tuple(params[name].shape)}")
                params[name].data.copy_(tensor)
            else:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {self.cfg.architecture}")
            loaded.add(f"{module_name}.{param_name}" if target is None else f"{module_name}.{param_name}#{shard}")
        return loaded

    def expected_weights(self) -> set[str]:
        """The names load_weights must see for the model to be complete."""
        out = set()
        modules = dict(self.named_modules())
        for name, _ in self.named_parameters():
            module_name, param_name = name.rsplit(".", 1)
            module = modules[module_name]
            if isinstance(module, Linear):
                out.update(f"{name}#{s}" if s else name for s in module.shard_offsets)
            else:
                out.add(name)
        return out

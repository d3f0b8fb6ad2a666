"""A small Llama's decode forward in one native call (csrc/small_decode.cpp), where the model is
a plain Llama whose every linear layer runs on amx_linear over a bfloat16 cache (a CPU with
AMX), or on small_linear over a float32 one (in float32 on a CPU with AVX2 and FMA, AMX or not).

- The model runner's steps whose every token is a row of its own (decodes, speculative
  verification, chunks of up to 1 + 16 tokens) and that fit the kernels' rows: through the Python
  modules a step pays for each layer's module calls, which a small model's kernels do not
  outweigh. The built-in model (6 layers, hidden 256, float32) at one request on a 2-core AMD
  EPYC: 2.23 ms a token through the modules, 1.52 ms in one call (`enforce_eager` runs the
  modules).
- A draft model's forwards: its forward of one token cost 0.27 ms at one request on a 2-core
  Xeon (bfloat16) through the modules, its kernels about 0.04 ms of it, and 0.50 ms on the AMD
  EPYC (float32); a draft model makes k drafts with k forwards a step, so that time decides
  whether drafting pays. The drafts' LM head and argmax join the call where their head runs
  on the same kernel too.
- An EAGLE head's forwards (executor/models/llama_eagle.py: `fc` before one layer without an
  input norm, no final norm; the target's embedding and LM head), which read features too:
  at one request of the built-in model on the 2-core AMD EPYC, 0.73 ms a forward through
  the modules.

The same kernels run in the same order, so the output equals the modules' bit for bit
(tests/models/test_speculative.py, tests/models/test_builtin_models.py)."""

from __future__ import annotations

from functools import partial
from types import ModuleType

import torch
from torch import nn

from tokenmill.executor.attention.cpu import CpuBackend
from tokenmill.executor.attention.kv_cache import KVCache
from tokenmill.executor.layers.linear import Linear
from tokenmill.executor.models.llama import LlamaForCausalLM
from tokenmill.executor.models.llama_eagle import EagleLlamaForCausalLM
from tokenmill.executor.spec.vocab import DraftVocab


def _rows(linear: Linear, kernels: ModuleType) -> tuple[int, bool]:
    """(the most rows `linear` runs on amx_linear or small_linear, whether small_linear's: a float32
    weight, or a bfloat16 one of float32 x); 0 rows where it runs on neither, or has a bias or a method."""
    kernel = linear.small_kernel
    if linear.quant_method is not None or linear.bias is not None or kernel is None:
        return 0, False
    if isinstance(kernel, partial) and kernel.func in (kernels.small_linear, kernels.amx_linear):
        return linear.small_rows, kernel.func is kernels.small_linear
    return 0, False


def fused_decoder(model: nn.Module, kv_cache: KVCache, attn, kernels: ModuleType | None,
                  vocab: DraftVocab | None = None):
    """(kernels.SmallLlama, the most rows a forward may have, whether it drafts) for `model`, or
    None where the one-call forward does not apply (then the modules run): every linear layer
    on amx_linear, or every one on small_linear. It drafts (kernels.small_llama_draft: the
    argmax in the same call) where the drafts' LM head, `vocab`'s (a token map) or else the
    model's, runs on the same kernel too. An EAGLE head's `fc` runs on it too, and its
    drafts in one call are kernels.small_eagle_draft's."""
    eagle = type(model) is EagleLlamaForCausalLM
    if kernels is None or not hasattr(kernels, "small_eagle_draft") \
            or type(model) not in (LlamaForCausalLM, EagleLlamaForCausalLM) or model.tp is not None \
            or not isinstance(attn, CpuBackend) or kv_cache.quantized or model.rotary.kernels is None:
        return None
    embed, lm_head = model.shared if eagle else (model.embed_tokens, model.lm_head)
    if not isinstance(embed, nn.Embedding):  # (a target under tensor parallelism)
        return None
    rows, plain, layers = [], set(), []
    eps = model.layers[0].post_attention_layernorm.eps if eagle else model.norm.eps
    if eagle:  # its map of (embedding, features) to the layer's input
        fc_rows, fc_plain = _rows(model.fc, kernels)
        rows, plain = [fc_rows], {fc_plain}
    for i, layer in enumerate(model.layers):
        a, mlp, norm = layer.self_attn, layer.mlp, layer.input_layernorm
        norms = {n.eps for n in (norm, layer.post_attention_layernorm) if n is not None}
        if (norm is None and not eagle) or a.q_norm is not None or a.qk_norm_rotary is not None \
                or mlp.kernels is None or norms != {eps}:
            return None
        found = [_rows(linear, kernels) for linear in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if min(r for r, _ in found) == 0:
            return None
        rows += [r for r, _ in found]
        plain |= {p for _, p in found}
        k_cache, v_cache, _, _ = kv_cache.layer(i)
        layers.append(kernels.SmallLayer(None if norm is None else norm.weight, a.qkv_proj.small, a.o_proj.small,
                                         layer.post_attention_layernorm.weight, mlp.gate_up_proj.small,
                                         mlp.down_proj.small, k_cache, v_cache))
    # (no model of amx_linear and small_linear layers both)
    if not layers or min(rows) == 0 or len(plain) > 1:
        return None
    plain = plain.pop()
    head = vocab.head if vocab is not None else lm_head
    head_rows, head_plain = _rows(head, kernels) if isinstance(head, Linear) else (0, False)
    if head_plain != plain:
        head_rows = 0
    first = model.layers[0].self_attn
    fused = kernels.SmallLlama(embed.weight, None if eagle else model.norm.weight, model.rotary.cos_sin, layers,
                               first.num_heads, first.num_kv_heads, first.head_dim,
                               model.layers[0].mlp.down_proj.in_features, eps, first.head_dim ** -0.5,
                               head.small if head_rows else None, head.out_features if head_rows else 0,
                               vocab.ids.to(torch.int64) if head_rows and vocab is not None else None, plain,
                               model.fc.small if eagle else None)
    return fused, min(rows + [head_rows] if head_rows else rows), bool(head_rows)

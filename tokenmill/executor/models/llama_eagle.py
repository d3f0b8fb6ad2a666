"""EAGLE-1 draft head for a Llama-family target (Li et al. 2024), in the checkpoint layout
vLLM and SGLang load for `method: "eagle"`.

At position p the head reads the target's last hidden state f_p (after its final norm)
joined with the embedding of the token after p, `fc` maps the pair to the hidden size, and
one decoder layer (no input norm, no final norm) predicts f_{p+1}; the target's LM head
turns that into the draft's logits. The embedding and LM head are the target's, shared.

Checkpoint tensors: `fc.weight` [hidden, 2 x hidden] (`fc.bias` where the checkpoint has
one), `layers.0.*` under Llama's names, with or without a `model.` prefix.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from tokenmill.config import ModelConfig, read_config_json
from tokenmill.executor.attention.base import AttentionBackend
from tokenmill.executor.layers.linear import Linear
from tokenmill.executor.layers.rotary import RotaryEmbedding
from tokenmill.executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM

# the target's tensors, which some head checkpoints carry copies of: not loaded
SKIPPED = ("embed_tokens.weight", "lm_head.weight")


class EagleLlamaForCausalLM(LlamaForCausalLM):
    """`cfg`: the head's config (the target's shape with one layer, checked against the target's
    by executor/spec/checkpoint.py's resolve_draft); `target`: the model whose embedding and LM
    head it shares (held outside the module tree: not the head's weights)."""

    def __init__(self, cfg: ModelConfig, target: LlamaForCausalLM, max_position: int,
                 kernels: ModuleType | None = None, fc_bias: bool = False) -> None:
        nn.Module.__init__(self)
        if cfg.num_layers != 1:
            raise ValueError(f"an EAGLE head has one decoder layer, this config has {cfg.num_layers}")
        self.cfg = cfg
        self.tp = None
        self.embed = target.embed_tokens.forward
        self.target_logits = target.compute_logits
        self.shared = (target.embed_tokens, target.lm_head)  # (for the one-call forward: executor/fused_decoder.py)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling, kernels)
        self.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg, 0, kernels, input_norm=False)])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                features: torch.Tensor | None = None) -> torch.Tensor:
        """The predicted next features [T, hidden] of `features` [T, hidden] (the target's, or
        the head's own for later drafts) and the tokens after them. None: zeros (timing)."""
        x = self.embed(input_ids)
        if features is None:
            features = torch.zeros_like(x)
        x = self.fc(torch.cat((x, features), dim=-1))
        x, residual = self.layers[0](self.rotary.lookup(positions, x.dtype), x, None, attn)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Llama's loading, less the embedding and LM head, which are the target's: a
        checkpoint that carries copies of them (some do) has them skipped."""
        return super().load_weights((name, t) for name, t in weights if name.removeprefix("model.") not in SKIPPED)


def eagle_config(path: Path) -> ModelConfig:
    """An EAGLE head's config.json read as Llama's: vLLM writes the head's architecture as
    `Eagle` + the target's (EagleLlamaForCausalLM); checkpoints from the EAGLE authors name
    the target's (LlamaForCausalLM)."""
    cfg = read_config_json(path)
    archs = cfg.get("architectures") or ["LlamaForCausalLM"]
    return ModelConfig.from_dict({**cfg, "architectures": [archs[0].removeprefix("Eagle")]})

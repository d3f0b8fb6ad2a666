"""Train an EAGLE draft head for tokenmill's built-in model (or any Llama checkpoint).

EAGLE (Li et al. 2024) drafts from the target's own features: one decoder layer reads,
at position t, the target's last hidden state f_t (after its final norm) joined with the
embedding of the next token x_{t+1}, and predicts f_{t+1}; the target's LM head turns
that into draft logits. Later drafts feed the head's own output back as the feature.
The head is saved in the layout vLLM and SGLang load for ``method: "eagle"`` (EAGLE-1,
Llama): ``fc.weight`` [hidden, 2 x hidden] and ``layers.0.*`` with no input norm in that
layer and no final norm; the embedding and LM head are the target's.

Loss, as in EAGLE-1: smooth L1 between predicted and true features, plus 0.1 x the
cross-entropy of the head's next-token distribution against the target's; the input
features get uniform noise (+-0.1) so that the head tolerates its own errors when it
drafts from its own output.

Usage::

    python scripts/train_eagle_head.py                        # about 30 min on 2 cores
    python scripts/train_eagle_head.py --agreement tokenmill/data/default_eagle_model
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from train_demo_model import DATA_DIR, TOKENIZER_DIR, load_tokenizer, split_files, token_stream

DEFAULT_TARGET = DATA_DIR / "default_model"
DEFAULT_OUTPUT = DATA_DIR / "default_eagle_model"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class EagleHead(nn.Module):
    """One Llama decoder layer behind `fc`, in dense causal form (training and reference)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.eps, self.theta = cfg.rms_norm_eps, cfg.rope_parameters["rope_theta"]
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[B, T, H] each, positions [T] -> the predicted next features [B, T, H]."""
        x = self.fc(torch.cat((embeds, features), dim=-1))
        b, t, _ = x.shape
        inv = 1.0 / self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
        angles = positions.float()[:, None] * inv[None, :]
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
        q = rotate(self.q_proj(x).view(b, t, self.heads, -1).transpose(1, 2), cos, sin)
        k = rotate(self.k_proj(x).view(b, t, self.kv_heads, -1).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(b, t, self.kv_heads, -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = x + self.o_proj(o.transpose(1, 2).reshape(b, t, -1))
        y = rms_norm(h, self.post_attention_layernorm, self.eps)
        return h + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))

    def checkpoint(self) -> dict[str, torch.Tensor]:
        """The weights under the names of vLLM's EAGLE-1 Llama layout, in bfloat16."""
        return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.checkpoint_params().items()}

    def load_checkpoint(self, weights: dict[str, torch.Tensor]) -> None:
        params = self.checkpoint_params()
        for name, tensor in weights.items():
            params[name.removeprefix("model.")].data.copy_(tensor.float())

    def checkpoint_params(self) -> dict[str, torch.Tensor]:
        out = {"fc.weight": self.fc.weight, "layers.0.post_attention_layernorm.weight": self.post_attention_layernorm}
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"layers.0.self_attn.{name}.weight"] = getattr(self, name).weight
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[f"layers.0.mlp.{name}.weight"] = getattr(self, name).weight
        return out


@torch.no_grad()
def target_features(target, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's last hidden states (after its final norm) and its logits, [B, T, *]."""
    out = target.model(tokens)
    hidden = out.last_hidden_state
    return hidden, target.lm_head(hidden)


def eagle_loss(head: EagleHead, target, tokens: torch.Tensor, noise: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, share of positions whose draft argmax is the target's) over a [B, T + 1] block."""
    feats, logits = target_features(target, tokens[:, :-1])
    embeds = target.model.embed_tokens(tokens[:, 1:-1])
    inputs = feats[:, :-1]
    if noise:
        inputs = inputs + (torch.rand_like(inputs) - 0.5) * 2 * noise
    pred = head(embeds, inputs, torch.arange(inputs.shape[1]))
    want = feats[:, 1:]
    draft_logits = target.lm_head(pred)
    teacher = F.softmax(logits[:, 1:].float(), -1)
    ploss = -(teacher * F.log_softmax(draft_logits.float(), -1)).sum(-1).mean()
    vloss = F.smooth_l1_loss(pred, want)
    agree = (draft_logits.argmax(-1) == logits[:, 1:].argmax(-1)).float().mean()
    return vloss + 0.1 * ploss, agree


@torch.no_grad()
def chain_agreement(head: EagleHead, target, val: torch.Tensor, seq_len: int, num_starts: int = 256,
                    depth: int = 4) -> list[float]:
    """Per draft position j = 1..depth, the share of drafts equal to the target's greedy
    token, among chains whose drafts before j were: the acceptance of draft j in greedy
    decoding. Chains start at `num_starts` held-out positions t: the context is the data up
    to t, the target's greedy continuation c_1, c_2, ... follows; draft 1 reads the true
    features, draft j > 1 the head's own output at the position before, as when drafting."""
    n = (len(val) - 1) // seq_len
    blocks = val[:n * seq_len].long().view(n, seq_len)
    per_block = max(1, num_starts // n)
    head.eval()
    hits, total = [0] * depth, [0] * depth
    embed, lm_head = target.model.embed_tokens, target.lm_head
    for b in blocks:
        for t in torch.linspace(16, seq_len - 1, per_block).long().tolist():
            context = b[None, :t + 1]
            cont = target.generate(context, attention_mask=torch.ones_like(context), max_new_tokens=depth + 1,
                                   do_sample=False, pad_token_id=0)[0, t + 1:]
            if len(cont) < depth + 1:
                continue
            feats, _ = target_features(target, context)
            tokens = torch.cat((b[1:t + 1], cont[:1]))  # x_{p+1} for p = 0..t
            own = feats[0]
            for j in range(depth):
                pred = head(embed(tokens)[None], own[None], torch.arange(len(tokens)))[0]
                draft = lm_head(pred[-1]).argmax().item()  # predicts the token after c_{j+1}
                total[j] += 1
                if draft != cont[j + 1].item():
                    break
                hits[j] += 1
                tokens = torch.cat((tokens, cont[j + 1:j + 2]))
                own = torch.cat((own, pred[-1:]))
    return [h / max(c, 1) for h, c in zip(hits, total)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=DEFAULT_TARGET,
                        help="a Llama with the built-in tokenizer and unscaled RoPE (default: the built-in model)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--noise", type=float, default=0.1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--max-files", type=int, help="use only the first N train and N held-out files (tests)")
    parser.add_argument("--eval-starts", type=int, default=256, help="held-out positions the agreement starts at")
    parser.add_argument("--agreement", type=Path, metavar="DIR", help="evaluate a saved head, then exit")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM
    torch.set_num_threads(args.threads)
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    torch.manual_seed(args.seed)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    target.requires_grad_(False)
    cfg = target.config
    if (cfg.rope_parameters or {}).get("rope_type", "default") != "default" or cfg.vocab_size != 8192:
        raise SystemExit("--target: the head is trained with the built-in tokenizer and unscaled RoPE; "
                         f"{args.target} has another vocabulary or RoPE scaling")
    tokenizer = load_tokenizer(TOKENIZER_DIR)
    train_files, val_files = split_files(args.max_files)
    val_ids = token_stream(tokenizer, val_files)
    head = EagleHead(cfg)
    if args.agreement:
        from safetensors.torch import load_file
        head.load_checkpoint(load_file(args.agreement / "model.safetensors"))
        rates = chain_agreement(head, target, val_ids, args.seq_len, args.eval_starts)
        print(f"{args.agreement}: draft j equal to the target's greedy token (given drafts before it were): "
              + ", ".join(f"j={j + 1} {100 * r:.1f}%" for j, r in enumerate(rates)), flush=True)
        return 0
    train_ids = token_stream(tokenizer, train_files)
    with torch.no_grad():  # start from the target's last layer, whose shapes the head shares
        last = target.model.layers[-1]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(head, name).weight.copy_(getattr(last.self_attn, name).weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(head, name).weight.copy_(getattr(last.mlp, name).weight)
        head.post_attention_layernorm.copy_(last.post_attention_layernorm.weight)
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = min(args.warmup, args.steps // 2) or 1
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / warmup, total_iters=warmup),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(args.steps - warmup, 1), eta_min=args.lr / 10),
    ], milestones=[warmup])
    gen = torch.Generator().manual_seed(args.seed)
    offsets = torch.arange(args.seq_len + 1)
    print(f"EAGLE head: {sum(p.numel() for p in head.parameters()) / 1e6:.2f}M parameters on {args.target}; "
          f"{args.steps} steps of {args.batch_size * args.seq_len} tokens, {torch.get_num_threads()} thread(s)",
          flush=True)
    start = time.perf_counter()
    head.train()
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(train_ids) - args.seq_len - 1, (args.batch_size,), generator=gen)
        loss, agree = eagle_loss(head, target, train_ids[starts[:, None] + offsets].long(), args.noise)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % args.log_every == 0 or step == args.steps:
            print(f"step {step}/{args.steps} loss {loss.item():.4f} train agreement {100 * agree.item():.1f}% "
                  f"lr {sched.get_last_lr()[0]:.2e} wall {time.perf_counter() - start:.0f}s", flush=True)
    wall = time.perf_counter() - start
    rates = chain_agreement(head, target, val_ids, args.seq_len, args.eval_starts)
    args.output.mkdir(parents=True, exist_ok=True)
    save_file(head.checkpoint(), str(args.output / "model.safetensors"), metadata={"format": "pt"})
    config = {**cfg.to_dict(), "num_hidden_layers": 1, "architectures": ["EagleLlamaForCausalLM"],
              "model_type": "llama", "dtype": "bfloat16"}
    (args.output / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"trained in {wall / 60:.1f} min; held-out agreement with the target's greedy token by draft "
          f"position: " + ", ".join(f"j={j + 1} {100 * r:.1f}%" for j, r in enumerate(rates))
          + f"; saved to {args.output}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

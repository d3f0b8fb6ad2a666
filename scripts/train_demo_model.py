"""Train tokenmill's built-in models: a small Llama on the Python standard library.

Trains, on the CPU, two Llama-architecture causal LMs with the shipped BPE
tokenizer on the ``*.py`` sources of the running interpreter's standard
library: the **target** (the built-in default model of ``tokenmill generate``
and ``serve``) and a much smaller **draft** for speculative decoding. A fixed
set of files, chosen by a hash of their path, is held out for validation.
Training uses AdamW, a linear warm-up then cosine learning-rate schedule and
bf16 autocast; batches are drawn from a seeded generator, so a run is
reproducible from ``--seed`` (for one machine and library version).

Each model is saved in the Hugging Face layout (config.json,
model.safetensors in bfloat16, tokenizer files) under ``--output-root``:
``default_model/`` (target) and ``default_draft_model/`` (draft).

Usage::

    python scripts/train_demo_model.py                        # both models (about an hour on 2 cores)
    python scripts/train_demo_model.py --eval tokenmill/data/default_model

``--eval DIR`` reports the validation loss of a saved model, the fraction of
held-out function signatures whose greedy completion (cut at the end of the
function body) parses with ``ast``, and a few sample completions.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import math
import os
import shutil
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from train_tokenizer import stdlib_files

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "tokenmill" / "data"
TOKENIZER_DIR = DATA_DIR / "default_model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
EOS_ID = 0
VAL_PERCENT = 4  # files whose path hashes below this (of 100) are held out

# name -> (output folder, model shape, training steps, peak learning rate)
MODELS = {
    "draft": ("default_draft_model", dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=352), 1200, 3e-3),
    "target": ("default_model", dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=704), 3200, 2e-3),
}


def is_held_out(rel_path: str) -> bool:
    return int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:4], "big") % 100 < VAL_PERCENT


def split_files(max_files: int | None = None) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, validation) lists of (relative path, text) from the running Python's stdlib."""
    files = stdlib_files(Path(sysconfig.get_paths()["stdlib"]))
    train = [f for f in files if not is_held_out(f[0])]
    val = [f for f in files if is_held_out(f[0])]
    return train[:max_files], val[:max_files]


def load_tokenizer(path: Path):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(path / "tokenizer.json"))


def token_stream(tokenizer, files: list[tuple[str, str]]) -> torch.Tensor:
    """All files as one stream of token ids, each file followed by <|endoftext|>."""
    ids: list[int] = []
    for enc in tokenizer.encode_batch([text for _, text in files]):
        ids.extend(enc.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.int16)  # vocab < 32768: half the memory of int32


def make_model(shape: dict, vocab_size: int, max_position: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=vocab_size, head_dim=shape["hidden_size"] // shape["num_attention_heads"],
                         hidden_act="silu", max_position_embeddings=max_position, rms_norm_eps=1e-6,
                         rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=EOS_ID, eos_token_id=EOS_ID,
                         **shape)
    return LlamaForCausalLM(config)


def lm_loss(model, tokens: torch.Tensor, bf16: bool = True) -> torch.Tensor:
    """Mean next-token cross-entropy over a (batch, seq_len + 1) block of token ids."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(tokens[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def distill_loss(model, teacher, tokens: torch.Tensor, bf16: bool = True) -> torch.Tensor:
    """Mean forward KL(teacher || model) of the next-token distributions over a (batch,
    seq_len + 1) block: the student learns the teacher's whole distribution, whose argmax is
    what a speculative draft has to guess."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(tokens[:, :-1]).logits
        with torch.no_grad():
            target = teacher(tokens[:, :-1]).logits
    return F.kl_div(F.log_softmax(logits.float().flatten(0, 1), -1), F.log_softmax(target.float().flatten(0, 1), -1),
                    log_target=True, reduction="batchmean")


@torch.no_grad()
def top1_agreement(model, teacher, val: torch.Tensor, seq_len: int, batch_size: int, bf16: bool = True) -> float:
    """The share of held-out positions (non-overlapping windows) where the model's argmax is
    the teacher's: a greedy draft's chance of being accepted, given the tokens before it."""
    n = (len(val) - 1) // seq_len
    blocks = val[:n * seq_len].long().view(n, seq_len)
    model.eval()
    same = 0
    for b in blocks.split(batch_size):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            same += (model(b).logits.argmax(-1) == teacher(b).logits.argmax(-1)).sum().item()
    return same / blocks.numel()


@torch.no_grad()
def validation_loss(model, val: torch.Tensor, seq_len: int, batch_size: int, bf16: bool = True) -> float:
    """Mean loss over every token of the held-out stream, in non-overlapping windows."""
    n = (len(val) - 1) // seq_len
    windows = val[:n * seq_len + 1].long()
    blocks = torch.stack([windows[i * seq_len:(i + 1) * seq_len + 1] for i in range(n)])
    model.eval()
    total = sum(lm_loss(model, b, bf16).item() * len(b) for b in blocks.split(batch_size))
    return total / n


def train(name: str, args: argparse.Namespace, train_ids: torch.Tensor, val_ids: torch.Tensor,
          vocab_size: int) -> Path:
    folder, shape, steps, lr = MODELS[name]
    overrides = {"hidden_size": args.hidden_size, "num_hidden_layers": args.num_layers}
    shape = {**shape, **{k: v for k, v in overrides.items() if v}}
    steps = args.steps or steps
    lr = args.lr or lr
    torch.manual_seed(args.seed)
    if args.init_from:
        from transformers import AutoModelForCausalLM
        if args.hidden_size or args.num_layers:
            raise SystemExit("--init-from takes the checkpoint's shape: drop --hidden-size and --num-layers")
        model = AutoModelForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
        if model.config.vocab_size != vocab_size:
            raise SystemExit(f"--init-from: the checkpoint's vocabulary has {model.config.vocab_size} tokens, "
                             f"the tokenizer's {vocab_size}")
        shape = {k: getattr(model.config, k) for k in shape}
    else:
        model = make_model(shape, vocab_size, args.max_position)
    teacher = None
    if args.distill_from:
        from transformers import AutoModelForCausalLM
        teacher = AutoModelForCausalLM.from_pretrained(args.distill_from, dtype=torch.float32).eval()
        teacher.requires_grad_(False)
    num_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    warmup = min(args.warmup, steps // 2) or 1
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / warmup, total_iters=warmup),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(steps - warmup, 1), eta_min=lr / 10),
    ], milestones=[warmup])
    if teacher is None:
        loss_fn = lambda m, t: lm_loss(m, t, args.bf16)  # noqa: E731
    else:
        loss_fn = lambda m, t: distill_loss(m, teacher, t, args.bf16)  # noqa: E731
    step_loss = torch.compile(loss_fn) if args.compile else loss_fn
    gen = torch.Generator().manual_seed(args.seed)
    offsets = torch.arange(args.seq_len + 1)
    tokens_per_step = args.batch_size * args.seq_len
    print(f"[{name}] {num_params / 1e6:.2f}M parameters {shape}; {steps} steps of {tokens_per_step} tokens "
          f"({steps * tokens_per_step / len(train_ids):.2f} epochs of {len(train_ids) / 1e6:.2f}M), "
          f"{torch.get_num_threads()} thread(s)"
          + (f", distilled from {args.distill_from}" if teacher is not None else "")
          + (f", starting from {args.init_from}" if args.init_from else ""), flush=True)

    model.train()
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    bar = tqdm(range(1, steps + 1), desc=name, dynamic_ncols=True, mininterval=5)
    for step in bar:
        starts = torch.randint(0, len(train_ids) - args.seq_len - 1, (args.batch_size,), generator=gen)
        loss = step_loss(model, train_ids[starts[:, None] + offsets].long())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % args.log_every == 0 or step == steps:
            wall = time.perf_counter() - start_wall
            bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{step * tokens_per_step / wall:.0f}")
            tqdm.write(f"[{name}] step {step}/{steps} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                       f"wall {wall:.0f}s cpu {time.process_time() - start_cpu:.0f}s "
                       f"{step * tokens_per_step / wall:.0f} tok/s")
    bar.close()
    wall = time.perf_counter() - start_wall

    model = model.to(torch.bfloat16)  # what ships; the validation loss is measured on these weights
    val_loss = validation_loss(model, val_ids, args.seq_len, args.batch_size, args.bf16)
    if teacher is not None:
        agree = top1_agreement(model.float(), teacher, val_ids, args.seq_len, args.batch_size, args.bf16)
        model = model.to(torch.bfloat16)
        print(f"[{name}] argmax equal to the teacher's at {100 * agree:.1f}% of held-out positions", flush=True)
    out = args.output_root / folder
    model.save_pretrained(out)
    copy_tokenizer(out)
    print(f"[{name}] trained in {wall / 60:.1f} min wall ({time.process_time() - start_cpu:.0f}s cpu); "
          f"validation loss {val_loss:.4f}, perplexity {math.exp(val_loss):.2f} on {len(val_ids)} tokens; "
          f"saved to {out}", flush=True)
    return out


def copy_tokenizer(out: Path) -> None:
    for f in TOKENIZER_FILES:
        if not (out / f).exists() or not (out / f).samefile(TOKENIZER_DIR / f):
            shutil.copy(TOKENIZER_DIR / f, out / f)


# ---- evaluation: held-out function signatures completed greedily, checked with ast ----

def functions(files: list[tuple[str, str]]):
    """(file text, its lines, a def's node) for every def of the files that parse."""
    for _, text in files:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield text, lines, node


def function_prompts(files: list[tuple[str, str]], limit: int) -> list[tuple[str, str]]:
    """(file text up to the colon of a def's signature, the signature lines) for defs of held-out files,
    every k-th so that `limit` of them spread over all files. The prompt stops at the colon, not after
    the newline: the tokenizer merges a newline with the next line's indent, so a prompt ending in a
    bare newline tells the model the next line is not indented."""
    found = []
    for _, lines, node in functions(files):
        end = node.body[0].lineno - 1  # lines before the first statement: the signature
        if end < node.lineno or not lines[end - 1].rstrip().endswith(":"):
            continue  # a one-line def, or comments between the signature and the body
        found.append(("".join(lines[:end]).rstrip(), "".join(lines[node.lineno - 1:end]).rstrip()))
    return found[::max(1, len(found) // limit)][:limit]


def cut_body(signature: str, completion: str, finished: bool) -> str | None:
    """The completion up to the end of the function body (the first line indented no deeper
    than the def), or None when the body had not ended when generation stopped."""
    indent = len(signature) - len(signature.lstrip())
    body: list[str] = []
    for line in completion.splitlines(keepends=True):
        if line.strip() and len(line) - len(line.lstrip()) <= indent and any(b.strip() for b in body):
            return "".join(body)
        body.append(line)
    return "".join(body) if finished else None


def parses(signature: str, body: str | None) -> bool:
    if body is None:
        return False
    try:
        ast.parse(textwrap.dedent(signature + body))
        return True
    except (SyntaxError, ValueError):
        return False


SAMPLE_PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef list_python_files(root):",
                  "class Stack:\n    def __init__(self):"]


def evaluate(path: Path, args: argparse.Namespace, val_files: list[tuple[str, str]], val_ids: torch.Tensor) -> None:
    from transformers import AutoModelForCausalLM

    from tokenmill import LLM, SamplingParams

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    val_loss = validation_loss(model, val_ids, args.seq_len, args.batch_size)
    print(f"{path}: validation loss {val_loss:.4f}, perplexity {math.exp(val_loss):.2f} "
          f"on {len(val_ids)} held-out tokens", flush=True)

    llm = LLM(str(path), num_threads=args.threads, kv_cache_memory="256MiB", max_model_len=1024)
    tok = llm.tokenizer
    items = function_prompts(val_files, args.eval_functions)
    prompts = [{"prompt_token_ids": tok.encode(p)[-args.eval_context:]} for p, _ in items]
    params = SamplingParams(max_tokens=args.eval_max_tokens, temperature=0)
    outs = llm.generate(prompts, params)
    bodies = [cut_body(sig, o.outputs[0].text, o.outputs[0].finish_reason == "stop")
              for (_, sig), o in zip(items, outs)]
    ok = [parses(sig, body) for (_, sig), body in zip(items, bodies)]
    print(f"ast: {sum(ok)}/{len(ok)} = {sum(ok) / len(ok):.3f} of held-out function completions parse "
          f"({sum(b is None for b in bodies)} did not end within {args.eval_max_tokens} tokens)", flush=True)
    results = list(zip(items, bodies, ok, outs))
    for good in (True, False):  # the first few of each kind
        for (_, sig), body, _, out in [r for r in results if r[2] == good][:args.samples]:
            text = body if body is not None else out.outputs[0].text[:300] + " <...still going>"
            print(f"--- held-out ({'parses' if good else 'does not parse'}) ---\n{sig}{text}")
    for prompt, out in zip(SAMPLE_PROMPTS, llm.generate(SAMPLE_PROMPTS, SamplingParams(max_tokens=96, temperature=0),
                                                        use_tqdm=False)):
        print(f"--- sample ---\n{prompt}{cut_body(prompt.splitlines()[-1], out.outputs[0].text, True)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--output-root", type=Path, default=DATA_DIR,
                        help="writes <root>/default_model (target) and <root>/default_draft_model (draft)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, help="override the model's step count")
    parser.add_argument("--lr", type=float, help="override the model's peak learning rate")
    parser.add_argument("--hidden-size", type=int, help="override the model's hidden size (tests)")
    parser.add_argument("--num-layers", type=int, help="override the model's layer count (tests)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--max-position", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--max-files", type=int, help="use only the first N train and N held-out files (tests)")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="skip torch.compile")
    parser.add_argument("--no-bf16", dest="bf16", action="store_false",
                        help="train in float32 (for CPUs without native bf16, where autocast is slow)")
    parser.add_argument("--distill-from", type=Path, metavar="DIR",
                        help="train on this model's next-token distributions (KL) instead of the data's tokens")
    parser.add_argument("--init-from", type=Path, metavar="DIR", help="start from this checkpoint's weights")
    parser.add_argument("--agreement", nargs=2, type=Path, metavar=("DRAFT", "TARGET"),
                        help="report how often DRAFT's argmax is TARGET's on the held-out stream, then exit")
    parser.add_argument("--eval", type=Path, metavar="DIR", help="evaluate a saved model instead of training")
    parser.add_argument("--eval-functions", type=int, default=200)
    parser.add_argument("--eval-context", type=int, default=384, help="prompt tokens before the signature end")
    parser.add_argument("--eval-max-tokens", type=int, default=256)
    parser.add_argument("--samples", type=int, default=4)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # the tokenizer's thread pool
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = str(args.threads)
    tokenizer = load_tokenizer(TOKENIZER_DIR)
    train_files, val_files = split_files(args.max_files)
    val_ids = token_stream(tokenizer, val_files)
    print(f"{len(train_files)} training files, {len(val_files)} held out ({len(val_ids)} tokens)", flush=True)
    if args.eval:
        evaluate(args.eval, args, val_files, val_ids)
        return 0
    if args.agreement:
        from transformers import AutoModelForCausalLM
        draft, target = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32) for p in args.agreement)
        agree = top1_agreement(draft, target.eval(), val_ids, args.seq_len, args.batch_size, args.bf16)
        print(f"{args.agreement[0]}: argmax equal to {args.agreement[1]}'s at {100 * agree:.1f}% of "
              f"held-out positions", flush=True)
        return 0
    train_ids = token_stream(tokenizer, train_files)
    for name in args.models:
        train(name, args, train_ids, val_ids, tokenizer.get_vocab_size())
    return 0


if __name__ == "__main__":
    sys.exit(main())

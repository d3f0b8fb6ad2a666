"""Benchmark workloads: prompts and output lengths.

`random_requests` gives token-id prompts for the offline benchmark. The online benchmark
sends text (every OpenAI-compatible server takes it, chat included) made by `PromptMaker`:
words that are single tokens of the server's tokenizer, so that a prompt of N words is a
prompt of N tokens. Without a tokenizer, prompts are common English words and lengths are
approximate (one word per token); the server's `usage` then gives the real counts.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORKLOADS = ("random", "shared-prefix", "file:PATH")
# the workload flags' defaults, applied after vLLM's flags have had their say (bench/vllm_args.py)
WORKLOAD_DEFAULTS = {"workload": "random", "input_len": "32:256", "output_len": "32:256", "num_prefixes": 4,
                     "prefix_len": 512}

# used only when the server's tokenizer cannot be loaded
COMMON_WORDS = (
    "the of and to in is that it was for on are as with his they at be this from have or by one had not but what "
    "all were when we there can an your which their said if do will each about how up out them then she many some "
    "so these would other into has more her two like him see time could no make than first been its who now people "
    "my made over did down only way find use may water long little very after words called just where most know "
    "get through back much before go good new write our used me man too any day same right look think also around "
    "another came come work three word must because does part even place well such here take why things help put "
    "years different away again off went old number great tell men say small every found still between name should "
    "home big give air line set own under read last never us left end along while might next sound below saw "
    "something thought both few those always looked show large often together asked house world going want school "
    "important until form food keep children feet land side without boy once animals life enough took sometimes"
).split()


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt: str | list[int]  # text, or token ids (completions only)
    output_len: int
    prompt_len: int = 0  # tokens; approximate when no tokenizer was at hand
    tenant: str | None = None  # sent with this tenant's API key (bench/tenants.py)


def parse_range(value: str, name: str) -> tuple[int, int]:
    """'128' -> (128, 128); '32:256' -> (32, 256)."""
    try:
        parts = [int(p) for p in str(value).split(":")]
    except ValueError:
        raise ValueError(f"{name}: expected N or MIN:MAX with integers, got {value!r}") from None
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or parts[0] < 1 or parts[1] < parts[0]:
        raise ValueError(f"{name}: expected N or MIN:MAX with 1 <= MIN <= MAX, got {value!r}")
    return parts[0], parts[1]


def random_requests(num: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int,
                    seed: int = 0, prefix_len: int = 0, low_token: int = 16,
                    output_dist: str = "uniform") -> list[BenchRequest]:
    """Token-id prompts of uniformly random tokens (ids below `low_token` avoided: special
    tokens live there), lengths uniform in the given ranges. With `prefix_len`, every
    prompt starts with the same random prefix of that many tokens. `output_dist`
    "loguniform" draws output lengths uniform in log space instead (as many in 16..32 as
    in 256..512: the long tail of chat traffic, where a few long answers hold a batch)."""
    if output_dist not in ("uniform", "loguniform"):
        raise ValueError(f"output_dist must be 'uniform' or 'loguniform', got {output_dist!r}")
    rng = random.Random(seed)
    prefix = [rng.randrange(low_token, vocab_size) for _ in range(prefix_len)]
    lo, hi = output_len
    out = []
    for _ in range(num):
        n = rng.randint(*input_len)
        tokens = prefix + [rng.randrange(low_token, vocab_size) for _ in range(n)]
        if output_dist == "uniform":
            m = rng.randint(lo, hi)
        else:
            m = min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))
        out.append(BenchRequest(tokens, m, len(tokens)))
    return out


class PromptMaker:
    """Random text of a given number of tokens for `tokenizer` (a transformers tokenizer, or
    None: then common English words, one per token as an approximation)."""

    def __init__(self, tokenizer: Any | None, seed: int = 0, sample: int = 20_000) -> None:
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        self.words, self.exact = list(COMMON_WORDS), False
        if tokenizer is not None:
            self.words, self.exact = self._single_token_words(tokenizer, sample)

    @staticmethod
    def _single_token_words(tokenizer: Any, sample: int) -> tuple[list[str], bool]:
        # ' word' tokens that encode back to themselves: with the usual pre-tokenizers (split
        # before a space) a text of such words has exactly one token per word
        ids = range(len(tokenizer))
        if len(ids) > sample:
            ids = sorted(random.Random(0).sample(ids, sample))
        words = []
        for i in ids:
            text = tokenizer.decode([i])
            if re.fullmatch(r" [A-Za-z]{2,}", text) and tokenizer.encode(text, add_special_tokens=False) == [i]:
                words.append(text)
        probe = "".join(words[:200])
        if len(words) < 100 or len(tokenizer.encode(probe, add_special_tokens=False)) != min(len(words), 200):
            return [" " + w for w in COMMON_WORDS], False  # odd tokenizer: lengths are fitted in make()
        return words, True

    def make(self, num_tokens: int) -> tuple[str, int]:
        """(text, its token count)."""
        if self.tokenizer is None:
            return " ".join(self.rng.choice(self.words) for _ in range(num_tokens)), num_tokens
        text = "".join(self.rng.choice(self.words) for _ in range(num_tokens))
        if not self.exact:  # cut to length through the tokenizer; may differ by a token or two
            ids = self.tokenizer.encode(text, add_special_tokens=False)[:num_tokens]
            text = self.tokenizer.decode(ids)
            return text, len(self.tokenizer.encode(text, add_special_tokens=False))
        return text, num_tokens


def text_requests(num: int, input_len: tuple[int, int], output_len: tuple[int, int], tokenizer: Any | None,
                  seed: int = 0) -> list[BenchRequest]:
    """The `random` workload: text prompts of uniformly random lengths."""
    maker, rng = PromptMaker(tokenizer, seed), random.Random(seed + 1)
    out = []
    for _ in range(num):
        prompt, n = maker.make(rng.randint(*input_len))
        out.append(BenchRequest(prompt, rng.randint(*output_len), n))
    return out


def shared_prefix_requests(num: int, num_prefixes: int, prefix_len: int, input_len: tuple[int, int],
                           output_len: tuple[int, int], tokenizer: Any | None, seed: int = 0) -> list[BenchRequest]:
    """The `shared-prefix` workload: `num_prefixes` random prefixes of `prefix_len` tokens,
    taken in turn, each followed by a random suffix of `input_len` tokens."""
    maker, rng = PromptMaker(tokenizer, seed), random.Random(seed + 1)
    prefixes = [maker.make(prefix_len) for _ in range(num_prefixes)]
    out = []
    for i in range(num):
        prefix, n_prefix = prefixes[i % num_prefixes]
        suffix, n_suffix = maker.make(rng.randint(*input_len))
        sep = " " if tokenizer is None else ""
        out.append(BenchRequest(prefix + sep + suffix, rng.randint(*output_len), n_prefix + n_suffix))
    return out


def file_requests(path: str | Path, num: int, output_len: tuple[int, int], tokenizer: Any | None,
                  seed: int = 0, fixed_output_len: int | None = None,
                  flag: str | None = None) -> tuple[list[BenchRequest], str]:
    """The `file:PATH` workload: JSONL, one {"prompt": str, "output_len": int (optional)} per
    line, or ShareGPT JSON (a list of {"conversations": [{"from": "human", "value": ...},
    {"from": "gpt", "value": ...}, ...]}), whose first reply sets the output length when a
    tokenizer is at hand, unless `fixed_output_len` (vLLM's --sharegpt-output-len) does.
    Prompts are shuffled with `seed`; a file with fewer prompts than `num` is repeated.
    Errors name `flag` (default `--workload file:PATH`). Returns the requests and a note on
    what was read."""
    path = Path(path)
    flag = flag or f"--workload file:{path}"
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"{flag}: cannot read it ({e.strerror})") from None
    rng = random.Random(seed)
    count = (lambda s: len(tokenizer.encode(s, add_special_tokens=False))) if tokenizer else (lambda s: len(s.split()))
    if text.lstrip().startswith("["):
        items, note = _sharegpt(flag, text, count, tokenizer is not None, fixed_output_len), "ShareGPT"
    else:
        items, note = _jsonl(flag, text), "JSONL"
    if not items:
        raise ValueError(f"{flag}: no usable prompt in the file")
    rng.shuffle(items)
    note = f"{len(items)} prompts from {note} file {path.name}"
    if len(items) < num:
        note += f", repeated to make {num}"
    requests = []
    for i in range(num):
        prompt, out_len = items[i % len(items)]
        requests.append(BenchRequest(prompt, out_len or rng.randint(*output_len), count(prompt)))
    return requests, note


def _jsonl(flag: str, text: str) -> list[tuple[str, int | None]]:
    items = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag}: line {lineno} is not JSON ({e.msg})") from None
        prompt = obj.get("prompt") if isinstance(obj, dict) else None
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{flag}: line {lineno} has no \"prompt\" string")
        out_len = next((obj[k] for k in ("output_len", "output_tokens", "max_tokens") if k in obj), None)
        if out_len is not None and (not isinstance(out_len, int) or out_len < 1):
            raise ValueError(f"{flag}: line {lineno}: the output length must be an integer >= 1, got {out_len!r}")
        items.append((prompt, out_len))
    return items


def _sharegpt(flag: str, text: str, count: Callable[[str], int], exact: bool,
              fixed_output_len: int | None) -> list[tuple[str, int | None]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag}: not valid JSON ({e.msg}, line {e.lineno})") from None
    items = []
    for entry in data:
        turns = (entry.get("conversations") or entry.get("conversation") or []) if isinstance(entry, dict) else []
        if len(turns) < 2 or not all(isinstance(t, dict) for t in turns[:2]):
            continue
        prompt, reply = (t.get("value", t.get("content")) for t in turns[:2])
        if not isinstance(prompt, str) or not isinstance(reply, str):
            continue
        prompt_len = count(prompt)
        reply_len = count(reply) if fixed_output_len is None else fixed_output_len
        # the filter of vLLM's ShareGPT sampler, so that figures compare (a fixed output
        # length is exempt from the minimum, as there)
        too_short = prompt_len < 4 or (fixed_output_len is None and reply_len < 4)
        if too_short or prompt_len > 1024 or prompt_len + reply_len > 2048:
            continue
        items.append((prompt, reply_len if exact or fixed_output_len else None))
    return items

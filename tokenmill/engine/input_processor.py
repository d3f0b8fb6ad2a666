"""InputProcessor: prompts and sampling parameters turned into validated Requests.

It needs only what the engine core reports once it is built (vocabulary, max_model_len,
KV capacity, EOS ids) and the tokenizer, so the API process runs it while the engine core
runs in a process of its own: bad input is refused where it enters, never in the loop.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.engine.request import Request
from tokenmill.sampling_params import ParamError, SamplingParams


@dataclass(frozen=True)
class EngineLimits:
    """What a request is checked against, as the engine core resolved it."""

    vocab_size: int
    max_model_len: int
    kv_capacity_tokens: int
    eos_token_ids: tuple[int, ...]


def _check_without_tokenizer(params: SamplingParams) -> None:
    """What needs text cannot run under skip_tokenizer_init: raises ParamError naming it."""
    for name, needs_text in (("stop", params.stop_strings), ("bad_words", params.bad_words),
                             ("structured_outputs", params.structured_outputs)):
        if needs_text:
            raise ParamError(name, f"{name}: needs a tokenizer, and this engine runs with skip_tokenizer_init "
                             "(stop_token_ids work without one)")


class InputProcessor:
    def __init__(self, tokenizer, limits: EngineLimits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self._ids = itertools.count()

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ParamError("prompt", "prompt: text needs a tokenizer, and this engine runs with "
                             "skip_tokenizer_init; pass token ids (prompt_token_ids)")
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def make_request(self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None,
                     priority: int = 0, arrival_time: float | None = None, tenant: str | None = None,
                     tenant_weight: float = 1.0) -> tuple[Request, str | None]:
        """Validates a prompt against the model and the cache; raises ParamError naming the limit.
        `priority`, `tenant` and `tenant_weight` are what the scheduling policy sees (fair: the
        lane, whose counter the request's service raises, and that tenant's share)."""
        if not isinstance(params, SamplingParams):
            raise ParamError("sampling_params",
                             f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        lim = self.limits
        vocab = lim.vocab_size
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenize(prompt)
        else:
            text, token_ids = None, list(prompt)
            bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
            if bad:
                raise ParamError("prompt_token_ids", f"prompt_token_ids: {bad[0]!r} is outside the vocabulary "
                                 f"[0, {vocab})")
        if not token_ids:
            raise ParamError("prompt", "prompt: must not be empty (it has 0 tokens)")
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise ParamError("stop_token_ids", f"stop_token_ids: {bad_stop[0]} is outside the vocabulary [0, {vocab})")
        bad_bias = [t for t in params.logit_bias or () if t >= vocab]
        if bad_bias:
            raise ParamError("logit_bias", f"logit_bias: token {bad_bias[0]} is outside the vocabulary [0, {vocab})")
        n = len(token_ids)
        room = lim.max_model_len - n
        if room < 1:
            raise ParamError("prompt", f"prompt: {n} tokens leaves no room to generate within max_model_len "
                             f"{lim.max_model_len} (the prompt must be at most {lim.max_model_len - 1} tokens)")
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise ParamError("max_tokens", f"max_tokens: {max_tokens} is too large: the prompt has {n} tokens and "
                             f"max_model_len is {lim.max_model_len}, so at most {room} tokens can be generated")
        if n + max_tokens > lim.kv_capacity_tokens:
            raise ParamError("max_tokens", f"max_tokens: prompt ({n}) + max_tokens ({max_tokens}) exceeds the KV "
                             f"cache capacity of {lim.kv_capacity_tokens} tokens; raise kv_cache_memory")
        if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool)):
            raise ParamError("priority", f"priority must be an integer, got {priority!r}")
        if tenant is not None and not isinstance(tenant, str):
            raise ParamError("tenant", f"tenant must be a string, got {tenant!r}")
        if isinstance(tenant_weight, bool) or not isinstance(tenant_weight, (int, float)) \
                or not math.isfinite(tenant_weight) or tenant_weight <= 0:
            raise ParamError("tenant_weight", f"tenant_weight must be a finite number > 0, got {tenant_weight!r}")
        rid = request_id if request_id is not None else str(next(self._ids))
        request = Request(rid, token_ids, params, lim.eos_token_ids, max_tokens, priority, arrival_time,
                          tenant, float(tenant_weight))
        if self.tokenizer is None:
            _check_without_tokenizer(params)
        if params.bad_words:
            request.bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
        return request, text

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as the token sequences it may be generated as: on its own and after a
        space (vLLM's rule); a word may not be split in some other way, as in vLLM."""
        out: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

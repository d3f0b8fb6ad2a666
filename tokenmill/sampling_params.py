"""SamplingParams: how one request samples and when it stops. Validated on construction."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPS = 1e-5
MAX_LOGIT_BIAS = 100.0
MAX_LOGPROBS = 20  # top-N of logprobs and prompt_logprobs (vLLM's default max_logprobs)


class ParamError(ValueError):
    """Bad input, with the name of the parameter it is about in `.param` (the server's error
    body reads the attribute, never the message)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class StructuredOutputsParams:
    """Constrains the output to a JSON schema, any JSON object, a regular expression, one of
    some strings, or a grammar (vLLM's names; exactly one of them). Checked on construction
    (a malformed or unsupported one raises ParamError naming `structured_outputs`); the
    engine compiles it against the tokenizer off its thread, once per distinct spec, and
    masks every step's logits with it (llguidance)."""

    json: str | dict[str, Any] | None = None  # a JSON schema
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark, or GBNF as llama.cpp writes it
    json_object: bool = False  # any JSON object
    # JSON without optional whitespace. True by default here (vLLM: False): a model given free
    # whitespace between JSON tokens can spend its whole budget on it (small ones do)
    disable_any_whitespace: bool = True
    whitespace_pattern: str | None = None  # JSON: the regex of the whitespace allowed between tokens
    _grammar: str = field(default="", init=False, repr=False)

    def __post_init__(self) -> None:
        import llguidance

        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ParamError("structured_outputs", "structured_outputs: exactly one of json, regex, choice, grammar "
                             f"and json_object must be given, got {given or 'none'}")
        kind = given[0]
        try:
            if kind in ("json", "json_object"):
                schema = self.json if kind == "json" else {"type": "object"}
                if isinstance(schema, str):
                    schema = json.loads(schema)
                if not isinstance(schema, (dict, bool)):
                    raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
                options: dict[str, Any] = {"whitespace_flexible": not self.disable_any_whitespace}
                if self.whitespace_pattern is not None:
                    options = {"whitespace_pattern": self.whitespace_pattern}
                grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
            elif kind == "choice":
                if not self.choice or any(not isinstance(c, str) or not c for c in self.choice):
                    raise ValueError(f"choice must be a list of non-empty strings, got {self.choice!r}")
                grammar = llguidance.grammar_from("choice", list(self.choice))
            elif not isinstance(getattr(self, kind), str):
                raise ValueError(f"{kind} must be a string, got {type(getattr(self, kind)).__name__}")
            else:
                grammar = llguidance.grammar_from("regex" if kind == "regex" else "grammar", getattr(self, kind))
            error = llguidance.LLMatcher.validate_grammar(grammar)
        except (ValueError, TypeError, RecursionError) as e:  # json.JSONDecodeError is a ValueError
            error = str(e)
        if error:
            raise ParamError("structured_outputs", f"structured_outputs: the {kind} is not usable: {error.strip()}")
        self._grammar = grammar

    @property
    def compiled_form(self) -> str:
        """The grammar as the engine compiles it (llguidance's form); equal specs give equal strings."""
        return self._grammar


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling and stopping controls, with the names and defaults of vLLM's.

    temperature 0 means greedy. `seed` makes sampling reproducible whatever else
    runs in the batch. `logprobs=N` returns the top-N logprobs (plus the sampled
    token's) for every generated token; `prompt_logprobs=N` the same for every prompt
    token after the first (computed in the prefill's forward; such a prompt skips the
    prefix cache, whose hits would have no logits).
    """

    max_tokens: int | None = 16  # None: up to the model's context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: all tokens
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # top-N logprobs (plus the prompt's own token) at every prompt position
    skip_special_tokens: bool = True
    detokenize: bool = True
    n: int = 1  # sequences returned; forked inside the engine after one prefill
    best_of: int | None = None  # sequences generated (>= n); the n of highest cumulative logprob are returned
    presence_penalty: float = 0.0  # OpenAI: -= penalty where a token was generated before
    frequency_penalty: float = 0.0  # OpenAI: -= penalty x times the token was generated
    repetition_penalty: float = 1.0  # HF/vLLM: tokens in the prompt or output, / p if > 0 else x p
    logit_bias: dict[int, float] | None = None  # token id (int, or digits as JSON has them) -> added, -100..100
    bad_words: list[str] | None = None  # never generated (as any of their tokenizations)
    structured_outputs: StructuredOutputsParams | None = None  # JSON schema, regex, choice or grammar
    _stop: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ParamError("max_tokens", f"max_tokens must be an integer >= 1 (or None), got {self.max_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ParamError("temperature", f"temperature must be >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ParamError("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ParamError("top_k", f"top_k must be -1 (disabled) or an integer >= 0, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ParamError("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ParamError("seed", f"seed must be an integer, got {self.seed!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ParamError("min_tokens", f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParamError("min_tokens",
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ParamError("logprobs", f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ParamError("prompt_logprobs", f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], "
                             f"got {self.prompt_logprobs!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ParamError("n", f"n must be an integer >= 1, got {self.n!r}")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
            raise ParamError("best_of", f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise ParamError("stop",
                f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        self._stop = stop
        ids = list(self.stop_token_ids or [])
        if any(not _is_int(t) or t < 0 for t in ids):
            raise ParamError("stop_token_ids",
                f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = ids
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ParamError(name, f"{name} must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 100.0 \
                or math.isnan(self.repetition_penalty):
            raise ParamError("repetition_penalty", f"repetition_penalty must be in (0, 100] (1: off), "
                             f"got {self.repetition_penalty!r}")
        if self.logit_bias:
            bias = {}
            for token, value in dict(self.logit_bias).items():
                if isinstance(token, str) and token.strip().lstrip("-").isdigit():
                    token = int(token)  # JSON object keys are strings (OpenAI's logit_bias)
                if not _is_int(token) or token < 0:
                    raise ParamError("logit_bias", f"logit_bias keys must be token ids >= 0, got {token!r}")
                if not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                    raise ParamError("logit_bias", f"logit_bias values must be in [-100, 100], got {value!r} "
                                     f"for token {token}")
                bias[token] = float(value)
            self.logit_bias = bias
        else:
            self.logit_bias = None
        words = list(self.bad_words or [])
        if any(not isinstance(w, str) or not w.strip() for w in words):
            raise ParamError("bad_words", f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
        self.bad_words = words or None
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ParamError("structured_outputs", "structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        if self.temperature < _GREEDY_EPS:
            # greedy ignores the filters; normalising them keeps the sampler's fast path simple
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def num_sequences(self) -> int:
        """Sequences the engine generates: best_of, else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def has_penalties(self) -> bool:
        """True when any of presence, frequency or repetition penalty is on."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def stop_strings(self) -> list[str]:
        return self._stop


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)

"""Engine configuration: one validated dataclass whose field names are the CLI flags.

`EngineConfig` is what users pass to `LLM(...)` as keyword arguments and what
`tokenmill ... --flag` sets; `ModelConfig` is read from a checkpoint's
`config.json` and carries only what the engine needs to know about the model.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("tokenmill")

DEFAULT_MODEL_DIR = Path(__file__).parent / "data" / "default_model"
DEFAULT_DRAFT_MODEL_DIR = Path(__file__).parent / "data" / "default_draft_model"  # the built-in model's draft
DEFAULT_EAGLE_MODEL_DIR = Path(__file__).parent / "data" / "default_eagle_model"  # and its EAGLE head
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
               "KI": 1024, "MI": 1024**2, "GI": 1024**3, "TI": 1024**4}


def parse_size(value: int | str) -> int:
    """Parses a byte count such as 2147483648, "2GiB", "512MB" or "1.5G"."""
    if isinstance(value, int):
        return value
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError(f"kv_cache_memory: cannot parse {value!r} as a size (examples: 2GiB, 512MB, 1073741824)")
    unit = (m.group(2) or "").upper().removesuffix("B")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


MAX_SPECULATIVE_TOKENS = 16
SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config` keys).
    - `ngram`: prompt lookup, the drafts are the tokens that followed the latest earlier
      occurrence of the request's last n tokens (n from prompt_lookup_max down to
      prompt_lookup_min);
    - `draft_model`: a smaller model with the target's tokenizer (`model`; for the built-in
      model, its built-in draft by default) drafts greedily (executor/spec/draft.py);
    - `eagle`: an EAGLE-1 head (`model`; for the built-in model, its built-in head by
      default) drafts from the target's own hidden states (executor/spec/eagle.py).
    `token_map` (draft_model, eagle; SGLang's `--speculative-token-map`): a file of the token
    ids the drafter's LM head is cut to (executor/spec/vocab.py); None: the built-in drafter's
    own map for the built-in model, else the whole vocabulary; False: the whole vocabulary."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    model: str | None = None  # draft_model, eagle: a checkpoint directory or hub id; None: the built-in one
    # beyond vLLM: each step chooses each request's drafts (0 to num_speculative_tokens) from
    # their measured acceptance and the step's cost (executor/spec/adaptive.py)
    adaptive: bool = True
    token_map: str | bool | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SpeculativeConfig":
        known = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "adaptive",
                 "token_map")
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r} (supported: {', '.join(known)})")
        model = d.get("model")
        if model is not None and not isinstance(model, str):
            raise ValueError(f"speculative_config.model must be a checkpoint directory or hub id, got {model!r}")
        # as vLLM: a draft model given without a method is a draft_model, or an EAGLE head if
        # its name says "eagle-"
        method = d.get("method", None if model is None else "eagle" if "eagle-" in model.lower() else "draft_model")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}; "
                             f"got {method!r}")
        if method == "ngram" and model is not None:
            raise ValueError("speculative_config.model: a draft model is for methods 'draft_model' and 'eagle', "
                             "not 'ngram'")
        k = d.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
        # vLLM's defaults: 5 and 5; one given, the other equals it
        lo, hi = (5, 5) if lo is None and hi is None else (hi if lo is None else lo, lo if hi is None else hi)
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {v!r}")
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        adaptive = d.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {adaptive!r}")
        token_map = d.get("token_map")
        if token_map is not None and token_map is not False and not isinstance(token_map, str):
            raise ValueError(f"speculative_config.token_map must be a file of token ids or false, got {token_map!r}")
        if method == "ngram" and token_map not in (None, False):
            raise ValueError("speculative_config.token_map: a token map cuts a drafter's LM head; it is for methods "
                             "'draft_model' and 'eagle', not 'ngram'")
        return cls(method, k, lo, hi, model, adaptive, token_map)


@dataclass(slots=True)
class EngineConfig:
    """Everything that decides how the engine runs. Names match the CLI flags."""

    model: str | None = None  # local directory or hub id; None: the built-in default model
    tokenizer: str | None = None  # defaults to the model directory
    skip_tokenizer_init: bool = False  # no tokenizer: prompts and outputs are token ids only (vLLM's name)
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    load_format: str = "auto"  # auto (safetensors) | dummy (random weights from config.json)
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # per-step token budget; default 2048 on CPU, 8192 on CUDA
    block_size: int = 16
    kv_cache_memory: int | str | None = None  # bytes for the KV cache on CPU; default 2 GiB
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None  # CUDA: this many KV blocks instead of the profiled number
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduler: str = "continuous"  # continuous | static
    scheduling_policy: str = "fcfs"  # fcfs | priority | fair (priority lanes, then VTC between tenants)
    # fair: a tenant's service is prompt weight * prompt tokens + output weight * output tokens
    # (the VTC paper's defaults, 1 and 2: an output token costs a decode step, engine/request_queue.py)
    fair_prompt_token_weight: float = 1.0
    fair_output_token_weight: float = 2.0
    num_threads: int | None = None  # torch intra-op threads on CPU; default: torch's choice
    attention_backend: str = "auto"  # auto (triton on CUDA, cpu on the CPU) | cpu | torch | triton
    # every step through the model's modules: no CUDA graphs (CUDA), no one-call forward of a small model (CPU)
    enforce_eager: bool = False
    # schedule step N + 1 while the device runs step N (engine.py); None: on for CUDA, off on the
    # CPU (whose forward runs on the host thread, so nothing overlaps), off with speculative
    # decoding or tensor parallel, which it does not run with yet
    async_scheduling: bool | None = None
    quantization: str = "auto"  # auto (the checkpoint's quantization_config, else none) | none | int8 | fp8
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8 (= fp8_e4m3) | fp8_e4m3 | fp8_e5m2 | int8
    # vLLM's keys, e.g. {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    speculative_config: dict[str, Any] | SpeculativeConfig | None = None
    # ranks that split each layer (executor/distributed): gloo on the CPU, NCCL on CUDA
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, dict):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        elif self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            raise ValueError(f"speculative_config must be a dict, got {type(self.speculative_config).__name__}")
        _one_of("dtype", self.dtype, ("auto", "float32", "bfloat16", "float16"))
        _one_of("load_format", self.load_format, ("auto", "safetensors", "dummy"))
        _one_of("device", self.device, ("auto", "cpu", "cuda"))
        _one_of("scheduler", self.scheduler, ("continuous", "static"))
        _one_of("scheduling_policy", self.scheduling_policy, ("fcfs", "priority", "fair"))
        _positive("fair_prompt_token_weight", self.fair_prompt_token_weight)
        _positive("fair_output_token_weight", self.fair_output_token_weight)
        _one_of("attention_backend", self.attention_backend, ("auto", "cpu", "torch", "triton"))
        _one_of("quantization", self.quantization, ("auto", "none", "int8", "fp8", "compressed-tensors"))
        _one_of("kv_cache_dtype", self.kv_cache_dtype, ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"))
        _at_least("max_num_seqs", self.max_num_seqs, 1)
        _at_least("block_size", self.block_size, 1)
        if self.block_size > 256 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two in [1, 256], got {self.block_size}")
        if self.max_num_batched_tokens is not None:
            _at_least("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_model_len is not None:
            _at_least("max_model_len", self.max_model_len, 1)
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_size(self.kv_cache_memory)
            _at_least("kv_cache_memory", self.kv_cache_memory, 1)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None:
            _at_least("num_gpu_blocks_override", self.num_gpu_blocks_override, 1)
        if self.num_threads is not None:
            _at_least("num_threads", self.num_threads, 1)
        _at_least("tensor_parallel_size", self.tensor_parallel_size, 1)
        if self.tensor_parallel_size > 1:
            for name, value, off in (("speculative_config", self.speculative_config, None),
                                     ("quantization", self.quantization, "auto"),
                                     ("kv_cache_dtype", self.kv_cache_dtype, "auto")):
                if value != off and not (name == "quantization" and value == "none"):
                    raise ValueError(f"tensor_parallel_size > 1 does not run with {name} (given {value!r}) yet")
        if self.async_scheduling:
            for name, value, off in (("speculative_config", self.speculative_config, None),
                                     ("tensor_parallel_size", self.tensor_parallel_size, 1)):
                if value != off:
                    raise ValueError(f"async_scheduling does not run with {name} (given {value!r}) yet")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens is not None \
                and self.max_model_len is not None and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when chunked prefill is off, or no long prompt could ever run")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


def _one_of(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def _at_least(name: str, value: int, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape and flags of a Llama-family checkpoint, read from its config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2, and Llama's attention_bias
    o_bias: bool  # Llama's attention_bias also covers o_proj
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k
    sliding_window: int | None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    quantization_config: dict[str, Any] | None = None  # config.json's, as the checkpoint has it

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or [_ARCH_BY_MODEL_TYPE.get(cfg.get("model_type", ""), "")]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r} (model_type {cfg.get('model_type')!r}); "
                             f"tokenmill runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu' for {arch}, got {cfg.get('hidden_act')!r}")
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        # transformers >= 5 writes rope_theta and rope_scaling together as rope_parameters
        rope = dict(cfg.get("rope_parameters") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or rope or None
        if scaling is not None:
            scaling = dict(scaling)
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            if rope_type not in ("default", "linear", "llama3"):
                raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: linear, llama3)")
            scaling = None if rope_type == "default" else {**scaling, "rope_type": rope_type}
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        attention_bias = bool(cfg.get("attention_bias", False))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        sliding = cfg.get("sliding_window")
        if is_qwen2 and not cfg.get("use_sliding_window", False):
            sliding = None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=sliding,
            eos_token_ids=eos_ids,
            quantization_config=cfg.get("quantization_config"),
        )

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "ModelConfig":
        return cls.from_dict(read_config_json(path))

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V of one token in every layer, in a cache of `dtype` (an 8-bit one with its scales)."""
        from tokenmill.executor.attention.kv_cache import bytes_per_slot
        return bytes_per_slot(self.num_layers, self.num_kv_heads, self.head_dim, dtype)


def read_config_json(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint directory's config.json."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"model: {path} has no config.json")
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"model: {cfg_path} is not valid JSON: {e}") from e


_ARCH_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                       "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

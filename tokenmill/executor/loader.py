"""Finding a checkpoint, choosing a dtype and device, and filling a model with weights."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

from tokenmill.config import DEFAULT_MODEL_DIR, ModelConfig
from tokenmill.executor.distributed.parallel import TensorParallel
from tokenmill.executor.layers.quantization import QuantConfig
from tokenmill.executor.models import MODEL_REGISTRY
from tokenmill.executor.models.llama import LlamaForCausalLM

logger = logging.getLogger("tokenmill")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(model: str | None) -> Path:
    """A local checkpoint directory for `model`: the built-in model for None, a local
    directory as is, otherwise a Hugging Face Hub id downloaded with huggingface_hub."""
    if model is None:
        return DEFAULT_MODEL_DIR
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ValueError(f"model: {model!r} is not a checkpoint directory")
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model",
                                                             "*.txt", "*.jinja"]))
    except Exception as e:  # noqa: BLE001 - every hub failure becomes the same clear message
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        why = "HF_HUB_OFFLINE=1 is set" if offline else "no network or the hub refused"
        raise ValueError(f"model: {model!r} is not a local directory and could not be fetched from the "
                         f"Hugging Face Hub ({why}: {type(e).__name__}: {e}). Pass a local checkpoint "
                         f"directory, or leave --model out for the built-in model.") from e


def choose_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but torch sees no CUDA device")
    return torch.device(device)


def cpu_has_native_bf16() -> bool:
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # non-x86 builds
        return False


def choose_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA and on CPUs with native bf16 (several times fp32 there), else float32."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cuda" or cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"model: {index} is not a valid safetensors index: {e}") from e
        files = [path / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"model: {index.name} names weight files that are missing: {', '.join(missing)}")
        return files
    return sorted(path.glob("*.safetensors"))


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"model: cannot read weight file {f}: {e}") from e


def load_model(path: Path, cfg: ModelConfig, load_format: str, dtype: torch.dtype, device: torch.device,
               max_position: int, seed: int = 0, kernels: ModuleType | None = None,
               quant: QuantConfig | None = None, tp: TensorParallel | None = None) -> LlamaForCausalLM:
    """kernels: the native CPU kernels the layers use (None: torch ops); quant: the linear
    layers' quantization (layers/quantization), applied once the weights are in; tp: this
    rank's place in a tensor-parallel group (it loads its part of each checkpoint tensor).
    Dummy weights are drawn per rank, so a tensor-parallel model of dummy weights differs
    from one rank's."""
    with building(dtype, device):
        model = MODEL_REGISTRY[cfg.architecture](cfg, max_position, kernels, quant, tp)
    return fill_weights(model, path, load_format, seed)


@contextmanager
def building(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    """Modules built inside are made in `dtype` on `device`: no float32 copy of the weights
    first, no copy from the CPU."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(default_dtype)


def fill_weights(model: LlamaForCausalLM, path: Path, load_format: str, seed: int = 0) -> LlamaForCausalLM:
    """The built model with its checkpoint's weights (or dummy ones), packed for the device;
    a weight the model needs and the checkpoint lacks is an error."""
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        files = safetensors_files(path)
        if not files:
            raise ValueError(f"model: no *.safetensors weights in {path} (use load_format='dummy' "
                             f"for random weights)")
        loaded = model.load_weights(iter_safetensors(files))
        missing = model.expected_weights() - loaded
        if missing:
            raise ValueError(f"model: weights missing from the checkpoint in {path}: {', '.join(sorted(missing)[:8])}"
                             + (" ..." if len(missing) > 8 else ""))
    model.pack_weights()
    return model.eval()


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """Deterministic random weights: the same seed gives the same model on every machine with
    the same kind of device. They are drawn where they live (an 8B model's weights take a
    minute to draw on one CPU core, well under a second on a GPU)."""
    for name, param in model.named_parameters():
        gen = torch.Generator(device=param.device).manual_seed(seed * 1_000_003 + _stable_hash(name))
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith("bias"):
            param.zero_()
        elif name.endswith("weight_scale"):  # a quantized checkpoint's: 8-bit values of about std
            param.fill_(std / 64)
        elif not param.dtype.is_floating_point or param.dtype.itemsize == 1:  # int8, float8 weights
            values = torch.empty(param.shape, device=param.device).normal_(0.0, 64.0, generator=gen)
            param.copy_(values.clamp_(-127, 127).round_())
        else:
            param.normal_(0.0, std, generator=gen)


def _stable_hash(s: str) -> int:
    h = 0
    for ch in s.encode():
        h = (h * 131 + ch) % (1 << 31)
    return h

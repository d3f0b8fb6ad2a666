"""Quantization methods for linear layers (vLLM's `quant_method` idea).

A quantized `Linear` holds a method that declares the tensors the layer loads
(`create_weights`), turns them into the layout its GEMM wants once after loading
(`process_weights_after_loading`) and runs the layer (`apply`). The model asks the
engine's `QuantConfig` for each layer's method when it is built; the LM head and the
embeddings stay 16-bit, as in vLLM.

    quantization="none"  16-bit (or 32-bit) weights as the checkpoint has them
    quantization="int8"  W8A8 INT8 made on load: per-channel weights, per-token activations (int8.py)
    quantization="fp8"   W8A8 FP8 made on load, the same granularity, CUDA only (fp8.py)
    quantization="auto"  none, unless config.json carries a quantization_config: then its
                         compressed-tensors scheme (compressed_tensors.py), or an error naming
                         the field and what is supported
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Protocol

import torch

QUANTIZATION_CHOICES = ("auto", "none", "int8", "fp8", "compressed-tensors")


class LinearMethod(Protocol):
    def create_weights(self, layer: torch.nn.Module) -> None: ...
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None: ...
    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor: ...


class QuantConfig(Protocol):
    name: str

    def linear_method(self, layer_name: str, shard_names: tuple[str, ...] = ()) -> LinearMethod | None:
        """The method of the linear layer `layer_name` (e.g. "model.layers.0.mlp.down_proj"),
        fused from the checkpoint's `shard_names` if any (q_proj, k_proj, v_proj); None keeps
        it unquantized."""


def resolve_quantization(quantization: str, checkpoint_config: dict[str, Any] | None, device: torch.device,
                         kernels: ModuleType | None) -> QuantConfig | None:
    """The engine's QuantConfig for `quantization` (an EngineConfig value) and the
    checkpoint's quantization_config; raises ValueError naming the field."""
    if checkpoint_config is not None:
        method = checkpoint_config.get("quant_method")
        if method != "compressed-tensors":
            raise ValueError(f"quantization_config: the checkpoint is quantized with quant_method {method!r}; "
                             "tokenmill loads compressed-tensors checkpoints (llm-compressor's format)")
        if quantization not in ("auto", "compressed-tensors"):
            raise ValueError(f"quantization: {quantization!r} asks to quantize a checkpoint that is quantized "
                             "already (compressed-tensors); leave it at auto")
        from tokenmill.executor.layers.quantization.compressed_tensors import CompressedTensorsConfig

        return CompressedTensorsConfig(checkpoint_config, device, kernels)
    if quantization in ("auto", "none"):
        return None
    if quantization == "int8":
        from tokenmill.executor.layers.quantization.int8 import Int8Config

        return Int8Config(device, kernels)
    if quantization == "fp8":
        from tokenmill.executor.layers.quantization.fp8 import Fp8Config

        return Fp8Config(device)
    if quantization == "compressed-tensors":
        raise ValueError("quantization: compressed-tensors needs a checkpoint whose config.json has a "
                         "quantization_config (tokenmill quantize writes one)")
    raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}; got {quantization!r}")

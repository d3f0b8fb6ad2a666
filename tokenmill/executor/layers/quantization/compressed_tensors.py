"""Checkpoints in the compressed-tensors format (llm-compressor's, which vLLM and SGLang
load), read with the `compressed-tensors` package. Supported schemes, each for every
targeted Linear, with symmetric 8-bit weights per output channel:

    W8A8 INT8     format int-quantized, int8 weights, activations int8 per token, dynamic:
                  runs on fbgemm as quantization="int8" does (int8.py)
    FP8_DYNAMIC   format float-quantized, float8_e4m3fn weights, activations fp8 per token,
                  dynamic: on CUDA torch._scaled_mm (fp8.py); on the CPU the weights are
                  dequantized to the engine's dtype on load (correct, not fast; activations
                  stay 16/32-bit)
    INT8 weight-only (W8A16, channel strategy): dequantized the same way

Anything else (4 bits, groups, asymmetric or static activations, a KV-cache scheme) is
refused at load with the field that says so and what is supported.
"""

from __future__ import annotations

import re
from types import ModuleType
from typing import Any

import torch
from torch import nn

from tokenmill.executor.layers.quantization.fp8 import Fp8LinearMethod
from tokenmill.executor.layers.quantization.int8 import Int8LinearMethod

SUPPORTED = ("W8A8 INT8 (int-quantized)", "FP8_DYNAMIC (float-quantized)", "INT8 weight-only (int-quantized)")
_WEIGHT_DTYPES = {"int": torch.int8, "float": torch.float8_e4m3fn}
_FORMATS = {"int": "int-quantized", "float": "float-quantized"}


def _refuse(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"quantization_config.{field}: {value!r} is not supported ({why}); tokenmill loads "
                      f"compressed-tensors checkpoints of the schemes {', '.join(SUPPORTED)}")


class CompressedTensorsConfig:
    name = "compressed-tensors"

    def __init__(self, config: dict[str, Any], device: torch.device, kernels: ModuleType | None) -> None:
        from compressed_tensors.quantization import QuantizationConfig

        try:
            parsed = QuantizationConfig.model_validate(config)
        except Exception as e:  # noqa: BLE001 - pydantic's ValidationError: the format's own check
            raise ValueError(f"quantization_config: not a valid compressed-tensors config: {e}") from e
        if parsed.kv_cache_scheme is not None:
            raise _refuse("kv_cache_scheme", "set", "the checkpoint's static KV scales are not read; "
                          "kv_cache_dtype=int8 or fp8 quantizes the cache with scales computed as it is written")
        if len(parsed.config_groups) != 1:
            raise _refuse("config_groups", sorted(parsed.config_groups), "one group for all linear layers")
        (group_name, scheme), = parsed.config_groups.items()
        where = f"config_groups.{group_name}"
        if [t for t in scheme.targets if t != "Linear"]:
            raise _refuse(f"{where}.targets", scheme.targets, "targets must be ['Linear']")
        w, a = scheme.weights, scheme.input_activations
        if w is None or w.num_bits != 8 or w.type not in _WEIGHT_DTYPES:
            raise _refuse(f"{where}.weights", None if w is None else f"{w.num_bits}-bit {w.type}", "8-bit weights")
        if not w.symmetric or w.strategy != "channel" or w.dynamic:
            raise _refuse(f"{where}.weights.strategy", f"{w.strategy}, symmetric={w.symmetric}",
                          "symmetric per-channel weights")
        if a is not None and (a.num_bits != 8 or a.type != w.type or not a.symmetric or not a.dynamic
                              or a.strategy != "token"):
            raise _refuse(f"{where}.input_activations", f"{a.num_bits}-bit {a.type} {a.strategy}, "
                          f"dynamic={a.dynamic}, symmetric={a.symmetric}",
                          "activations 8-bit of the weights' type, symmetric, dynamic, per token")
        if scheme.output_activations is not None:
            raise _refuse(f"{where}.output_activations", "set", "no output quantization")
        if parsed.format != _FORMATS[w.type]:
            raise _refuse("format", parsed.format, f"{w.type} weights come as {_FORMATS[w.type]}")
        self.weight_dtype = _WEIGHT_DTYPES[w.type]
        self.int8_activations = a is not None and w.type == "int"
        self.ignore = list(parsed.ignore or [])
        self.device, self.kernels = device, kernels
        self.fp8_scaled_mm = self.weight_dtype == torch.float8_e4m3fn and a is not None and device.type == "cuda"
        if self.int8_activations and device.type != "cpu":
            raise ValueError("quantization_config: W8A8 INT8 runs on the CPU (fbgemm); on CUDA it is not built yet")

    def _ignored(self, name: str) -> bool:
        for pattern in self.ignore:
            if pattern.startswith("re:") and re.fullmatch(pattern[3:], name) or name == pattern \
                    or name.endswith("." + pattern):
                return True
        return False

    def linear_method(self, layer_name: str, shard_names: tuple[str, ...] = ()):
        """The method of a (possibly fused) layer: its checkpoint shards must all be quantized
        or all be ignored."""
        names = [f"{layer_name.rsplit('.', 1)[0]}.{s}" for s in shard_names] or [layer_name]
        ignored = [self._ignored(n) for n in names]
        if all(ignored) or layer_name.endswith("lm_head"):
            return None
        if any(ignored):
            raise ValueError(f"quantization_config.ignore: {', '.join(names)} are fused into one layer here, and "
                             "only some of them are ignored")
        if self.fp8_scaled_mm:
            return Fp8LinearMethod(from_checkpoint=True)
        return CompressedTensorsLinearMethod(self.weight_dtype, self.int8_activations, self.kernels)


class CompressedTensorsLinearMethod:
    """Loads `weight` (int8 or float8) and `weight_scale` [N, 1]; then packs the int8 W8A8
    GEMM, or dequantizes into the engine's dtype."""

    def __init__(self, weight_dtype: torch.dtype, int8_activations: bool, kernels: ModuleType | None) -> None:
        self.weight_dtype = weight_dtype
        self.int8 = Int8LinearMethod(kernels) if int8_activations else None

    def create_weights(self, layer: nn.Module) -> None:
        layer.dense_dtype = layer.weight.dtype
        layer.weight = nn.Parameter(torch.empty(layer.weight.shape, dtype=self.weight_dtype), requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.empty(layer.out_features, 1, dtype=torch.float32),
                                          requires_grad=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        scale = layer.weight_scale.detach()
        if self.int8 is not None:
            self.int8.pack(layer, layer.weight.detach(), scale.squeeze(1))
        else:
            dense = layer.weight.detach().float() * scale
            layer.weight = nn.Parameter(dense.to(layer.dense_dtype), requires_grad=False)
        del layer.weight_scale

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            return self.int8.apply(layer, x)
        return nn.functional.linear(x, layer.weight, layer.bias)

"""`tokenmill quantize`: a 16-bit checkpoint written as a compressed-tensors one, the format
llm-compressor writes and vLLM, SGLang and tokenmill load.

Every decoder-layer projection (q, k, v, o, gate, up, down) gets symmetric 8-bit weights
per output channel and a float32 `weight_scale` [N, 1]; embeddings, norms and the LM head
are copied as they are (`ignore: ["lm_head"]`). Activations are quantized per token at run
time (dynamic), so the checkpoint has no activation scales. The `quantization_config` is
built with the compressed-tensors package from its presets, so it follows the format.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from tokenmill.executor.layers.quantization.fp8 import quantize_fp8_rows
from tokenmill.executor.layers.quantization.int8 import quantize_per_channel

SCHEMES = {  # --scheme -> (compressed-tensors preset, format)
    "w8a8-int8": ("W8A8", "int-quantized"),
    "fp8-dynamic": ("FP8_DYNAMIC", "float-quantized"),
}
_PROJECTION = re.compile(r"(model\.)?layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")


def quantize_weight(w: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(8-bit weight, float32 scale [N, 1]) of w [N, K], per output channel."""
    if scheme == "w8a8-int8":
        q, scale = quantize_per_channel(w)
        return q, scale.unsqueeze(1)
    return quantize_fp8_rows(w)


def quantization_config(scheme: str) -> dict:
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    preset, fmt = SCHEMES[scheme]
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])}, format=fmt,
                                ignore=["lm_head"], quantization_status="compressed")
    return json.loads(config.model_dump_json())


def quantize_checkpoint(model_dir: Path, scheme: str, output_dir: Path) -> int:
    """Writes the quantized checkpoint; returns the number of layers quantized."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from tokenmill.executor.loader import safetensors_files

    if scheme not in SCHEMES:
        raise ValueError(f"--scheme must be one of {', '.join(SCHEMES)}; got {scheme!r}")
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("quantization_config") is not None:
        raise ValueError(f"--model: {model_dir} is quantized already (its config.json has a quantization_config)")
    files = safetensors_files(model_dir)
    if not files:
        raise ValueError(f"--model: no *.safetensors weights in {model_dir}")
    if output_dir.resolve() == model_dir.resolve():
        raise ValueError("--output: must not be the --model directory")
    output_dir.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    count = 0
    for f in files:  # one output file per input file, with the same name
        tensors = {}
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                tensor = st.get_tensor(name)
                if _PROJECTION.fullmatch(name):
                    tensors[name], tensors[name + "_scale"] = quantize_weight(tensor, scheme)
                    count += 1
                else:
                    tensors[name] = tensor
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(output_dir / f.name),
                  metadata={"format": "pt"})
        weight_map.update({name: f.name for name in tensors})
    if count == 0:
        raise ValueError(f"--model: no decoder-layer projections (q/k/v/o/gate/up/down_proj) in {model_dir}")
    for extra in model_dir.iterdir():  # tokenizer, generation config, README, ...
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy(extra, output_dir / extra.name)
    if (model_dir / "model.safetensors.index.json").is_file():
        (output_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                                            indent=2))
    config["quantization_config"] = quantization_config(scheme)
    (output_dir / "config.json").write_text(json.dumps(config, indent=2))
    return count

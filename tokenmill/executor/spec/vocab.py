"""A drafter's vocabulary cut to the tokens that occur most (FR-Spec, Zhao et al. 2025; SGLang's
`--speculative-token-map`): its LM head computes the logits of those tokens only.

A draft is the drafter's argmax, and verification keeps a draft only where the target agrees,
so the outputs are the target's whatever the drafter's vocabulary; a draft that would have
been a rarer token is lost, and the rest cost less. On a small model the LM head is much of
a draft forward: the built-in model's 8,192 x 256 head is a third of its weights, read again
in each of the EAGLE head's forwards (with every draft verified, its 4,096-token map made
EAGLE at one request 1.32x the throughput of no drafts against 1.22x, on a 2-core CPU).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import torch

from tokenmill.config import DEFAULT_DRAFT_MODEL_DIR, DEFAULT_EAGLE_MODEL_DIR, SpeculativeConfig
from tokenmill.executor.layers.linear import Linear

KEY = "speculative_config.token_map"
BUILT_IN_TOKEN_MAP = "token_map.json"  # beside each built-in drafter: its default token map
# the hidden dimensions read per pass when the head's rows are recovered (see DraftVocab):
# a [CHUNK, vocab] block of logits at a time
CHUNK = 256


def token_map_file(config: SpeculativeConfig, path: Path) -> str | Path | None:
    """A drafter's token map file: the configured one; by default, a built-in drafter's own."""
    if config.token_map is False:
        return None
    if config.token_map is None:
        own = Path(path) / BUILT_IN_TOKEN_MAP
        built_in = Path(path).resolve() in (DEFAULT_DRAFT_MODEL_DIR.resolve(), DEFAULT_EAGLE_MODEL_DIR.resolve())
        return own if built_in and own.exists() else None
    return config.token_map


def load_token_map(path: str | Path, vocab_size: int) -> torch.Tensor:
    """The token ids in `path`, sorted and without repeats: a JSON list of ints, or a tensor
    (or list) saved with torch.save (`.pt`, the format FR-Spec's and SGLang's token maps
    use). Errors name speculative_config.token_map."""
    path = Path(path)
    try:
        if path.suffix == ".json":
            ids = json.loads(path.read_text())
        else:
            ids = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise ValueError(f"{KEY}: {str(path)!r} does not load: {e}") from e
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist() if ids.dim() == 1 and not ids.is_floating_point() else None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{KEY}: {str(path)!r} must hold a non-empty list of token ids (integers)")
    ids = np.unique(np.asarray(ids, dtype=np.int64))
    if ids[0] < 0 or ids[-1] >= vocab_size:
        bad = int(ids[0] if ids[0] < 0 else ids[-1])
        raise ValueError(f"{KEY}: token id {bad} is outside the vocabulary [0, {vocab_size})")
    return torch.from_numpy(ids)


class DraftVocab:
    """The drafter's LM head restricted to `ids`: the logits of those tokens, as the model's own
    `compute_logits` gives them (its rows are recovered through it, so a tied, packed or
    quantized head is read the same way), and the argmax mapped back to token ids."""

    def __init__(self, model: torch.nn.Module, ids: torch.Tensor, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.ids = ids.to(device)
        with torch.inference_mode():
            bias = model.compute_logits(torch.zeros(1, hidden_size, dtype=dtype, device=device))[0, self.ids]
        has_bias = bool(bias.any())
        self.head = Linear(hidden_size, len(ids), bias=has_bias).to(device=device, dtype=dtype)
        weight = self.head.weight.data
        with torch.inference_mode():
            # logits of unit vectors: the head's columns, CHUNK at a time into the weight (on a GPU
            # the drafter is built after the KV cache: no more than the cut head and a chunk)
            for start in range(0, hidden_size, CHUNK):
                n = min(CHUNK, hidden_size - start)
                units = torch.zeros(n, hidden_size, dtype=dtype, device=device)
                units[:, start:start + n] = torch.eye(n, dtype=dtype, device=device)
                weight[:, start:start + n] = (model.compute_logits(units)[:, self.ids] - bias).T
        if has_bias:
            self.head.bias.data.copy_(bias)
        self.head.pack()

    def __len__(self) -> int:
        return len(self.ids)

    def argmax(self, sampler, hidden: torch.Tensor) -> torch.Tensor:
        """The likeliest token of the map for each row of `hidden` (the first on ties, as over
        the whole vocabulary: the ids are sorted)."""
        return self.ids[sampler._argmax(self.head(hidden))]

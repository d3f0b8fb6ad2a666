"""Which checkpoint drafts for a target (a draft model or an EAGLE head), checked against
the target's before the engine is built: the same vocabulary and tokenizer, and for a
head the same hidden size. Errors name `speculative_config.model`."""

from __future__ import annotations

from pathlib import Path

from tokenmill.config import (DEFAULT_DRAFT_MODEL_DIR, DEFAULT_EAGLE_MODEL_DIR, DEFAULT_MODEL_DIR, ModelConfig,
                              SpeculativeConfig)
from tokenmill.executor.loader import resolve_model_path
from tokenmill.executor.models.llama_eagle import SKIPPED, eagle_config


def resolve_draft(config: SpeculativeConfig, target_path: Path, target: ModelConfig) -> tuple[Path, ModelConfig]:
    """The draft's (a draft model's or an EAGLE head's) checkpoint directory and config,
    checked against the target's; errors name `speculative_config.model`."""
    eagle = config.method == "eagle"
    if config.model is None:
        if Path(target_path).resolve() != DEFAULT_MODEL_DIR.resolve():
            raise ValueError(f"speculative_config.model: method {config.method!r} needs "
                             f"{'an EAGLE head' if eagle else 'a draft model'} checkpoint (the built-in one is "
                             f"the default only for the built-in model)")
        path = DEFAULT_EAGLE_MODEL_DIR if eagle else DEFAULT_DRAFT_MODEL_DIR
    try:
        path = resolve_model_path(str(path) if config.model is None else config.model)
        draft = eagle_config(path) if eagle else ModelConfig.from_dir(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"speculative_config.model: {config.model!r} does not load: {e}") from e
    if eagle and draft.hidden_size != target.hidden_size:
        raise ValueError(f"speculative_config.model: the EAGLE head's hidden size is {draft.hidden_size}, the "
                         f"target's {target.hidden_size}; a head reads the target's hidden states")
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model: the draft's vocabulary has {draft.vocab_size} tokens, the "
                         f"target's {target.vocab_size}; a draft needs the target's tokenizer")
    mine, theirs = _vocab(path), _vocab(Path(target_path))
    if mine is not None and theirs is not None and mine != theirs:
        raise ValueError(f"speculative_config.model: the draft's tokenizer ({path}) differs from the target's; a "
                         f"draft needs the target's tokenizer")
    return path, draft


def _vocab(path: Path) -> dict[str, int] | None:
    """The checkpoint's tokenizer vocabulary, or None without tokenizer files."""
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        return None
    from tokenmill.engine.detokenizer import load_tokenizer
    return load_tokenizer(path).get_vocab()


def skipped_tensors(config: SpeculativeConfig, draft: ModelConfig) -> tuple[str, ...]:
    """The drafter's checkpoint tensors it does not load (names without "model."): an EAGLE
    head's copies of the target's embedding and LM head, a tied draft model's LM head."""
    if config.method == "eagle":
        return SKIPPED
    return ("lm_head.weight",) if draft.tie_word_embeddings else ()

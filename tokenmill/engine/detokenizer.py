"""Incremental detokenization and stop strings.

Text is decoded over a short window of recent tokens, so each new token costs
a small decode, and a token that ends inside a multi-byte UTF-8 character
waits until the character is complete: streamed text is exactly the final text.
Stop strings are searched only in the new text (plus an overlap the length of
the longest stop string); text that could still be the start of a stop string
is held back from streaming.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

# how many prompt tokens give the first output tokens their context (leading spaces etc.)
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str], prompt_token_ids: list[int],
                 stop: list[str], include_stop_str_in_output: bool = False) -> None:
        self.decode = decode
        self.tokens = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.sent = 0  # characters of `text` already handed out as deltas
        self.num_added = 0  # tokens the last add() took: all of them, or those up to a stop string

    def add(self, token_ids: list[int]) -> str | None:
        """Appends tokens to the text; returns the stop string hit, if any (the text is
        then cut at it, and the tokens after the one that completed it are not taken)."""
        self.num_added = len(token_ids)
        if not self.stop and len(token_ids) > 1 and self._add_all(token_ids):
            return None
        for i, token in enumerate(token_ids):
            self.tokens.append(token)
            prefix = self.decode(self.tokens[self.prefix_offset:self.read_offset])
            full = self.decode(self.tokens[self.prefix_offset:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                start = len(self.text)
                self.text += full[len(prefix):]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
                hit = self._find_stop(start)
                if hit is not None:
                    self.num_added = i + 1
                    return hit
        return None

    def _add_all(self, token_ids: list[int]) -> bool:
        """Many tokens and no stop strings (a final_only request's whole output): one decode
        of the window gives the text the token-by-token loop builds, unless it ends inside a
        character; then nothing is taken and the loop runs."""
        tokens = self.tokens + token_ids
        full = self.decode(tokens[self.prefix_offset:])
        if full.endswith("\ufffd"):
            return False
        prefix = self.decode(tokens[self.prefix_offset:self.read_offset])
        self.tokens = tokens
        if len(full) > len(prefix):
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(tokens)
        return True

    def _find_stop(self, new_from: int) -> str | None:
        if not self.stop:
            return None
        search_from = max(0, new_from - self.max_stop_len + 1)
        best = None
        for s in self.stop:
            at = self.text.find(s, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return None
        at, s = best
        self.text = self.text[:at + len(s)] if self.include_stop else self.text[:at]
        return s

    def delta(self, finished: bool) -> str:
        """Text not handed out yet. While running, the last max_stop_len - 1 characters
        wait: they may turn out to be the start of a stop string."""
        end = len(self.text) if finished or not self.max_stop_len else max(
            self.sent, len(self.text) - self.max_stop_len + 1)
        out = self.text[self.sent:end]
        self.sent = end
        return out


def load_tokenizer(path: str | os.PathLike) -> Any:
    """The checkpoint's Hugging Face tokenizer (tokenizer.json, chat template and all)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds here
        raise ValueError(f"tokenizer: cannot load a tokenizer from {path}: {type(e).__name__}: {e}") from e

"""A step's later draft forwards (2 to k) left on the device: each forward's input ids are the
argmax of the one before it as a device tensor, and the host waits once, for all of them.

Before, each later forward copied its argmax to the host and the next forward's ids back, a
wait for the device a forward: on a GPU the device then idles while the host prepares the next
forward (its graph's inputs, or its eager launches), and the host idles while the device
runs. vLLM's drafters loop the same way (the drafts stay on the device until the step's end).

DeviceChain is a mixin of DraftModel (spec/draft.py): it reads the drafter's model, attention
backend, graphs, staging, sampler and its `_argmax`, and adds to its step's forward timing.
The one-call CPU forwards (`_chain`, small_draft_chain) do the same in one native call.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from tokenmill.executor.attention import AttentionMetadata, row_slots


class DeviceChain:
    """Forwards 2, 3, ... of a step, their ids on the device (see the module's docstring)."""

    def _device_chain(self, drafts: list[list[int]], positions: np.ndarray, table: np.ndarray, ks: np.ndarray,
                      features: torch.Tensor | None = None) -> None:
        """Each drafting request's drafts after its first (drafts[a][0], fed at positions[a] over
        table[a]) appended to drafts[a], up to ks[a] in all; the forwards those of the loop one
        by one, and timed as those forwards (together: one wait). `features`: an EAGLE head's
        outputs for the first drafts, each later forward reading the one before's."""
        if int(ks.max()) <= 1:
            return
        start = time.perf_counter()
        self.staging.begin()  # one bracket for all the forwards' copies (a second begin would wait on the device)
        steps = self._chain_forwards([d[0] for d in drafts], positions, table, ks, features)
        self.staging.end()
        host = self.sampler.to_host(*(ids for _, ids in steps))  # the one wait
        self.forward_seconds += time.perf_counter() - start
        self.forwards += [len(active) for active, _ in steps]
        for (active, _), tokens in zip(steps, host):
            for a, t in zip(active.tolist(), tokens.tolist()):
                drafts[a].append(t)

    def _chain_forwards(self, first: list[int], positions: np.ndarray, table: np.ndarray, ks: np.ndarray,
                        features: torch.Tensor | None) -> list[tuple[np.ndarray, torch.Tensor]]:
        """The forwards of `_device_chain`, launched and not waited for: each one's requests (their
        indices) and drafts (on the device)."""
        put = self.staging.to_device
        ids = put(np.array(first, dtype=np.int64))
        active = np.arange(len(first))
        steps = []
        for step in range(1, int(ks.max())):
            keep = np.flatnonzero(ks[active] > step)
            if len(keep) != len(active):  # requests whose drafts are all made drop out
                index = put(keep.astype(np.int64))
                ids = ids[index]
                features = features[index] if features is not None else None
                active = active[keep]
            ids, features = self._forward_ids(positions[active] + step - 1, table[active], ids, features)
            steps.append((active, ids))
        return steps

    def _forward_ids(self, positions: np.ndarray, table: np.ndarray, ids: torch.Tensor,
                     features: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A forward of one token a request, `ids` on the device, at `positions` over `table`'s
        rows, without waiting for it: (its drafts, on the device; its output hidden states where
        the next forward reads them, an EAGLE head's). The graphs' static input ids are filled
        from `ids` on the device; eagerly, the model reads them as they are."""
        n, bs, put = len(positions), self.block_size, self.staging.to_device
        query_lens = np.ones(n, dtype=np.int32)
        slots = row_slots(table, positions, bs)
        seq_lens = (positions + 1).astype(np.int32)
        if self.graphs is not None and self.graphs.can_run(query_lens, n):
            hidden = self.graphs.run(np.zeros(n, dtype=np.int64), positions, slots, seq_lens, table, query_lens,
                                     fill=(slice(0, n), ids), features=features)  # (one copy on the device)
        else:
            self.attn.begin_step(AttentionMetadata.from_host(query_lens, seq_lens, table, put(slots), bs, put))
            hidden = self.model(ids, put(positions), self.attn, *(() if features is None else (features,)))
        return self._argmax(hidden), hidden if features is not None else None

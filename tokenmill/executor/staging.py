"""Host-to-device transfer of a step's inputs: numpy arrays in, device tensors out.

On CUDA every array is copied into a pinned host arena and from there to the device
with a non-blocking copy, so building the next inputs overlaps the GPU's work and no
copy waits on the host. Two arenas take turns, step by step: a step's event is
recorded after its last transfer, which the stream runs after that step's forward, so
a step may overwrite only the arena of the step before last, whose tokens the engine
has synced on by then (with async scheduling, step N is staged while step N - 1 still
runs: a single arena would make it wait for that forward). On the CPU an array becomes
a tensor without a copy.
"""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 64


class Staging:
    def __init__(self, device: torch.device, nbytes: int = 1 << 20) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._arenas = [torch.empty(nbytes if self.pinned else 0, dtype=torch.uint8, pin_memory=self.pinned)
                        for _ in range(2)]
        self._events = [torch.cuda.Event() if self.pinned else None for _ in range(2)]
        # arenas outgrown in a step, kept until that step's copies are done
        self._retired: list[list[torch.Tensor]] = [[], []]
        self._turn = 0
        self._arena = self._arenas[0]
        self._offset = 0

    def begin(self) -> None:
        """Called before a step's first transfer: takes the arena of the step before last."""
        self._turn ^= 1
        event = self._events[self._turn]
        if event is not None:
            event.synchronize()
        self._retired[self._turn].clear()
        self._arena = self._arenas[self._turn]
        self._offset = 0

    def end(self) -> None:
        """Called after a step's last transfer."""
        event = self._events[self._turn]
        if event is not None:
            event.record()

    def to_device(self, array: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        """The array on the device; into `out` (a static buffer of the same shape) when given."""
        array = np.ascontiguousarray(array)
        if not self.pinned:
            host = torch.from_numpy(array)
            return host if out is None else out.copy_(host)
        host = self._host_slice(array)
        if out is None:
            return host.to(self.device, non_blocking=True)
        return out.copy_(host, non_blocking=True)

    def _host_slice(self, array: np.ndarray) -> torch.Tensor:
        n = array.nbytes
        start = -(-self._offset // _ALIGN) * _ALIGN
        if start + n > self._arena.numel():
            self._retired[self._turn].append(self._arena)
            self._arena = self._arenas[self._turn] = torch.empty(max(2 * self._arena.numel(), n),
                                                                 dtype=torch.uint8, pin_memory=True)
            start = 0
        self._offset = start + n
        host = self._arena[start:start + n]
        np.copyto(host.numpy().view(array.dtype).reshape(array.shape), array)
        return host.view(_TORCH_DTYPES[array.dtype.str]).view(array.shape)


_TORCH_DTYPES = {np.dtype(np.int64).str: torch.int64, np.dtype(np.int32).str: torch.int32,
                 np.dtype(np.float32).str: torch.float32, np.dtype(np.bool_).str: torch.bool}

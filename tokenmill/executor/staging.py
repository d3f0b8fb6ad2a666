"""Host-to-device transfer of a step's inputs: numpy arrays in, device tensors out.

On CUDA every array is copied into one pinned host arena and from there to the
device with a non-blocking copy, so building the next inputs overlaps the GPU's
work and no copy waits on the host. The arena is reused step after step: before
it is overwritten, `begin` waits on an event recorded after the last step's
copies (already complete whenever that step synced on its sampled ids, as every
sampling step does). On the CPU an array becomes a tensor without a copy.
"""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 64


class Staging:
    def __init__(self, device: torch.device, nbytes: int = 1 << 20) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._arena = torch.empty(nbytes if self.pinned else 0, dtype=torch.uint8, pin_memory=self.pinned)
        self._offset = 0
        self._retired: list[torch.Tensor] = []  # arenas outgrown this step, kept until its copies are done
        self._copied = torch.cuda.Event() if self.pinned else None

    def begin(self) -> None:
        """Called before a step's first transfer."""
        if self._copied is not None:
            self._copied.synchronize()
        self._retired.clear()
        self._offset = 0

    def end(self) -> None:
        """Called after a step's last transfer."""
        if self._copied is not None:
            self._copied.record()

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
            self._retired.append(self._arena)
            self._arena = torch.empty(max(2 * self._arena.numel(), n), dtype=torch.uint8, pin_memory=True)
            start = 0
        self._offset = start + n
        host = self._arena[start:start + n]
        np.copyto(host.numpy().view(array.dtype).reshape(array.shape), array)
        return host.view(_TORCH_DTYPES[array.dtype.str]).view(array.shape)


_TORCH_DTYPES = {np.dtype(np.int64).str: torch.int64, np.dtype(np.int32).str: torch.int32,
                 np.dtype(np.float32).str: torch.float32, np.dtype(np.bool_).str: torch.bool}

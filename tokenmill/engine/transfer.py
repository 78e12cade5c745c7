"""Every host/device transfer of a step goes through here, so the step's syncs can be counted.

`read_back` is the one place where the host waits for the device: the sampler calls it once per step,
for the sampled tokens (and logprobs, packed into the same tensor), even when no row samples. A step that overlaps
the next one (`EngineConfig.async_scheduling`) reads its tokens later through a `PendingRead`, counted the same way.
Tests count the reads, and a torch function mode in the tests catches any other tensor-to-Python conversion during a
step.
`to_device` copies host values without a sync: from pinned memory with `non_blocking` on CUDA (a copy
from pageable memory would make the host wait for the stream).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

read_backs = 0  # calls of `read_back` so far in this process


def read_back(tensor: torch.Tensor) -> list:
    """`tensor.tolist()`: waits for the device to reach this point of the stream."""
    global read_backs
    read_backs += 1
    return tensor.tolist()


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D (or nested) host list as a device tensor, without waiting for the device."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class PendingRead:
    """A device tensor's values on their way to the host: the copy starts now (into pinned memory, on CUDA) and
    `wait` gives them as a list, waiting for the device only then. `tensor` stays on the device for whoever needs the
    values there before they are read (the next step's input ids)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self._event: torch.cuda.Event | None = None
        self._host = tensor
        if tensor.is_cuda:
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> list:
        """The values (`read_back` of them: counted as one)."""
        if self._event is not None:
            self._event.synchronize()
        return read_back(self._host)


@dataclass
class Feed:
    """Input ids still on the device: tokens the step before sampled, not yet read back. Flat input row `rows[i]` of
    the step takes `tokens[picks[i]]`, over the placeholder its host inputs hold."""

    tokens: torch.Tensor
    rows: list[int]
    picks: list[int]

    def apply(self, input_ids: torch.Tensor) -> None:
        if not self.rows:
            return
        count = len(self.rows)
        if self.rows == self.picks == list(range(count)):  # the steady decode: the same requests in the same order
            input_ids[:count].copy_(self.tokens[:count])
            return
        device = input_ids.device
        picked = self.tokens.index_select(0, to_device(self.picks, torch.int64, device))
        input_ids.index_copy_(0, to_device(self.rows, torch.int64, device), picked)

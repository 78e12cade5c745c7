"""Every host/device transfer of a step goes through here, so the step's syncs can be counted.

`read_back` is the one place where the host waits for the device: the sampler calls it once per step,
for the sampled tokens (and logprobs, packed into the same tensor), even when no row samples: that wait is
also what makes reusing the pinned staging buffer of `step_inputs` safe on the next step. Tests count its calls, and a torch
function mode in the tests catches any other tensor-to-Python conversion during a step.
`to_device` copies host values without a sync: from pinned memory with `non_blocking` on CUDA (a copy
from pageable memory would make the host wait for the stream).
"""

from __future__ import annotations

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

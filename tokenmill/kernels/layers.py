"""A decoder layer's elementwise parts, in plain torch: the reference, and what the torch backend runs.

Each follows transformers' modules op for op, so greedy tokens match `generate` in float32:

- `add_rms_norm(x, residual, weight, eps) -> (normed, new residual)`: the residual (if any) added first, then
  RMSNorm in float32 and cast back (transformers' `LlamaRMSNorm`); the sum is the next residual.
- `rotary(qk, cos, sin) -> [T, H, D]`: rotary position embedding of queries and keys `[T, H, D]` (`rotate_half`),
  with the step's `cos`/`sin` `[T, 1, D]`; a backend may rotate `qk` in place and return it (both do).
- `silu_and_mul(gate_up) -> [T, I]`: SiLU of the first half times the second (the MLP's gate and up, one matmul).

The Triton backend runs each as one kernel (`triton_layers.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps), x
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype), x


def rotary(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """In place: `qk * cos + rotate_half(qk) * sin` rounded as transformers rounds it (each product, then the sum;
    `a + (-b) * s` is `a - b * s` to the bit), without the concatenated copy."""
    half = qk.shape[-1] // 2
    first, second = qk[..., :half], qk[..., half:]
    second_sin, first_sin = second * sin[..., :half], first * sin[..., half:]
    qk.mul_(cos)
    first.sub_(second_sin)
    second.add_(first_sin)
    return qk


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up

"""A decoder layer's elementwise parts as Triton kernels, one launch each (`layers.py` is the torch reference).

- `add_rms_norm`: one program per token row adds the residual, writes the new residual, and normalises the sum in
  float32 (cast back to the input dtype before the weight, as transformers does for half types).

Every kernel computes in float32 and rounds to the tensor's dtype where torch's op would round. Compiled for a GPU,
Triton's square root, division and exponential are its fast forms and multiplies and adds fuse, so a result's last
bits may differ from torch's there; the bit-for-bit checks against torch run under the interpreter.
- `rotary`: one program per (token, head) rotates that head of the queries-and-keys view in place.
- `silu_and_mul`: a program per (token row, column tile) writes SiLU(gate) * up.

Under Triton's interpreter (no CUDA: tests) the same rules as `triton_attention.py` apply: `TRITON_INTERPRET` set
before any kernel is decorated, reductions naming their combine functions instead of `tl.sum`.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # as in triton_attention.py: before the kernels below are decorated
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_res, stride_out,
                         stride_res_out, n_cols, eps, HAS_RESIDUAL: tl.constexpr, FLOAT32: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(dtype).to(tl.float32)  # the residual as stored, as torch's add in the input dtype rounds it
        tl.store(res_out_ptr + row * stride_res_out + cols, x.to(dtype), mask=mask)
    variance = tl.reduce(x * x, 0, tl.standard._sum_combine) / n_cols
    normed = x / tl.sqrt(variance + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if not FLOAT32:
        normed = normed.to(dtype).to(tl.float32)  # cast back before the weight, as transformers does
    tl.store(out_ptr + row * stride_out + cols, (normed * w).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(qk_ptr, cos_ptr, sin_ptr, stride_t, stride_h, stride_cos, HALF: tl.constexpr,
                   HALF_PAD: tl.constexpr):
    token, head = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, HALF_PAD)
    mask = cols < HALF
    dtype = qk_ptr.dtype.element_ty
    base = qk_ptr + token * stride_t + head * stride_h
    x1 = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    cos1 = tl.load(cos_ptr + token * stride_cos + cols, mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + token * stride_cos + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + token * stride_cos + cols, mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + token * stride_cos + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(base + cols, (x1 * cos1 - x2 * sin1).to(dtype), mask=mask)
    tl.store(base + HALF + cols, (x2 * cos2 + x1 * sin2).to(dtype), mask=mask)


@triton.jit
def _silu_and_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_out, n_cols, BLOCK: tl.constexpr):
    row, tile = tl.program_id(0), tl.program_id(1)
    cols = tile * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # rounded as torch's silu in the input dtype
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(dtype), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    out = torch.empty_like(x)
    new_residual = torch.empty_like(x) if residual is not None else x
    if rows:
        _add_rms_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out, new_residual, x.stride(0),
            residual.stride(0) if residual is not None else 0, out.stride(0), new_residual.stride(0), cols, eps,
            HAS_RESIDUAL=residual is not None, FLOAT32=x.dtype == torch.float32, BLOCK=triton.next_power_of_2(cols))
    return out, new_residual


def rotary(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    tokens, heads, head_dim = qk.shape
    assert qk.stride(2) == 1 and cos.stride(-1) == 1 and cos.stride() == sin.stride()
    if tokens:
        _rotary_kernel[(tokens, heads)](qk, cos, sin, qk.stride(0), qk.stride(1), cos.stride(0), HALF=head_dim // 2,
                                        HALF_PAD=triton.next_power_of_2(head_dim // 2))
    return qk


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, width = gate_up.shape
    cols = width // 2
    out = torch.empty((rows, cols), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(cols))
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(cols, block))](gate_up, out, gate_up.stride(0), out.stride(0), cols,
                                                               BLOCK=block)
    return out

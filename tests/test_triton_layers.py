"""The Triton backend's layer kernels (`tokenmill.kernels.triton_layers`) against a float64 reference on fresh
inputs: residual add + RMSNorm, rotary in place on a strided view of the QKV matmul's output, SiLU-and-mul; odd sizes,
float32 and bfloat16 (under the interpreter without CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tokenmill.kernels import triton_layers  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: float32: a few ulps of the float64 reference; bfloat16: the rounding of the output (and of the rounded inputs
#: transformers' order rounds in between).
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 6e-2}


def _fresh(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype).to(DEVICE)


def _close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    scale = expected.abs().max().item() or 1.0
    assert torch.isfinite(got).all()
    assert (got.double() - expected).abs().max().item() <= TOLERANCE[dtype] * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm(dtype: torch.dtype, with_residual: bool, random_seed: int) -> None:
    rows, cols, eps = 7, 96 + 5, 1e-6
    x, residual = (_fresh((rows, cols), dtype, random_seed + i) for i in range(2))
    weight = _fresh((cols,), dtype, random_seed + 2)
    out, new_residual = triton_layers.add_rms_norm(x, residual if with_residual else None, weight, eps)
    total = x.double() + (residual.double() if with_residual else 0)
    expected = total / torch.sqrt(total.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    _close(out, expected, dtype)
    _close(new_residual, total, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_on_the_qkv_view(dtype: torch.dtype, random_seed: int) -> None:
    tokens, q_heads, kv_heads, head_dim = 9, 6, 2, 48
    qkv = _fresh((tokens, (q_heads + 2 * kv_heads) * head_dim), dtype, random_seed)
    before = qkv.clone()
    qk = qkv[:, :(q_heads + kv_heads) * head_dim].view(tokens, q_heads + kv_heads, head_dim)
    angles = _fresh((tokens, 1, head_dim // 2), torch.float64, random_seed + 1).cpu().repeat(1, 1, 2).to(DEVICE)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    x = before[:, :(q_heads + kv_heads) * head_dim].view(tokens, q_heads + kv_heads, head_dim).double()
    half = head_dim // 2
    expected = x * cos.double() + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin.double()
    returned = triton_layers.rotary(qk, cos, sin)
    assert returned.data_ptr() == qk.data_ptr()
    _close(qk, expected, dtype)
    assert torch.equal(qkv[:, (q_heads + kv_heads) * head_dim:], before[:, (q_heads + kv_heads) * head_dim:])  # V


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype: torch.dtype, random_seed: int) -> None:
    rows, cols = 5, 1024 + 37  # more than one column tile
    gate_up = _fresh((rows, 2 * cols), dtype, random_seed)
    gate, up = gate_up.double().chunk(2, dim=-1)
    _close(triton_layers.silu_and_mul(gate_up), gate * torch.sigmoid(gate) * up, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_torch_rotary_is_transformers_to_the_bit_in_place(dtype: torch.dtype, random_seed: int) -> None:
    """The torch backend's rotary (`layers.rotary`) rotates the qkv view in place, and gives transformers' `rotate_half`
    formula's bits in the tensor's own dtype (the engine-parity oracle depends on it)."""
    from tokenmill.kernels import layers

    generator = torch.Generator().manual_seed(random_seed)
    tokens, heads, head_dim = 37, 5, 64
    qkv = torch.randn(tokens, (heads + 2) * head_dim, generator=generator).to(dtype)
    qk = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    angles = torch.randn(tokens, 1, head_dim // 2, generator=generator, dtype=torch.float64).repeat(1, 1, 2) * 50
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    half = head_dim // 2
    # transformers' apply_rotary_pos_emb
    expected = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin
    untouched = qkv[:, heads * head_dim:].clone()
    returned = layers.rotary(qk, cos, sin)
    assert returned.data_ptr() == qk.data_ptr() and torch.equal(qk, expected)
    assert torch.equal(qkv[:, heads * head_dim:], untouched)

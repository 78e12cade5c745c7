"""GPU benchmark of the Triton attention backend against the device's own ceilings.

Measures (1) ceilings: copy bandwidth, read-only bandwidth (a reduction over 2 GiB: what a decode kernel,
which reads K/V and writes almost nothing, can at best reach) and a large bf16 matmul; (2) decode
attention as GB/s of K/V read and its share of the read-only ceiling; (3) the KV write (the step's new K/V
scattered into the paged cache) as GB/s moved; (4) prefill chunks as TFLOP/s and their share of the matmul
rate, next to torch SDPA on the same data; (5) each case's error against a float64 reference (outputs poisoned
with NaN before the checked call), and bitwise batch invariance. Two head shapes: Llama-3-8B (Hq=32, Hkv=8,
D=128) and Qwen2.5-0.5B (Hq=14, Hkv=2, D=64: GQA groups of 7, padded to 8 in the kernel); bf16, block size 16,
block tables shuffled. Every tile configuration in `configs()` is timed, the first being the backend's default, so one
run says whether the default should change; the split decode path (`TileConfig.partition`) among them. Stops starting
new cases after `--deadline` seconds and prints one table at the end. It measures the kernels as they are; it changes
nothing.

    python benchmarks/kernels_gpu.py [--deadline 420] [--shapes llama-3-8b,qwen2.5-0.5b]

Without CUDA it says so and exits 0: there is nothing to measure.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

BLOCK_SIZE = 16
DTYPE = torch.bfloat16
HEADS = {"llama-3-8b": (32, 8, 128), "qwen2.5-0.5b": (14, 2, 64)}  # (Hq, Hkv, D)
DEADLINE_S = 7 * 60
KV_WRITE_TOKENS = [256, 8192]  # a decode step of 256 sequences; a full 8k-token prefill step
ATOL, RTOL = 1e-2, 2e-2  # bf16 keeps 8 bits: an output rounds by up to 2**-9 of itself, P rounds too
DECODE_CASES = [(64, 1024), (64, 4096), (64, 16384), (256, 1024), (256, 4096)]  # (sequences, context)
GRAPH_BOUND = 32768  # the contexts' bound a CUDA graph's split decode has: the block tables' width (max_model_len)
PREFILL_CASES = [(1, 8192, 0), (4, 2048, 0), (2, 4096, 4096), (16, 512, 2048)]  # (sequences, chunk, context)


@dataclass
class Batch:
    """One ragged batch over a freshly filled paged cache; positional args of `paged_attention`."""

    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    chunk: int
    context: int

    def args(self) -> tuple:
        return (self.query, self.k_cache, self.v_cache, self.block_tables, self.cu_seqlens_q, self.seq_lens,
                self.scale, self.chunk, self.chunk + self.context)

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]

    @property
    def hq(self) -> int:
        return self.query.shape[1]

    @property
    def hkv(self) -> int:
        return self.k_cache.shape[2]

    @property
    def head_dim(self) -> int:
        return self.query.shape[2]

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


def make_batch(num_seqs: int, chunk: int, context: int, heads: tuple[int, int, int], device: str = "cuda",
               dtype: torch.dtype | None = None) -> Batch:
    """`num_seqs` sequences of `context` cached tokens plus `chunk` new ones, blocks scattered at random (in `DTYPE`
    unless `dtype` is given)."""
    hq, hkv, head_dim = heads
    dtype = dtype or DTYPE
    length = context + chunk
    blocks = -(-length // BLOCK_SIZE)
    tables = torch.randperm(num_seqs * blocks, device=device).view(num_seqs, blocks).int()
    cache_shape = (num_seqs * blocks, BLOCK_SIZE, hkv, head_dim)
    return Batch(
        query=torch.randn(num_seqs * chunk, hq, head_dim, device=device, dtype=dtype),
        k_cache=torch.randn(cache_shape, device=device, dtype=dtype),
        v_cache=torch.randn(cache_shape, device=device, dtype=dtype),
        block_tables=tables,
        cu_seqlens_q=torch.arange(num_seqs + 1, device=device, dtype=torch.int32) * chunk,
        seq_lens=torch.full((num_seqs,), length, device=device, dtype=torch.int32),
        chunk=chunk, context=context,
    )


def contiguous_kv(batch: Batch, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K and V as `[Hq, L, D]` (GQA heads repeated), the layout SDPA wants."""
    from tokenmill.kernels.torch_attention import gather_kv

    length = batch.chunk + batch.context
    group = batch.hq // batch.hkv
    return tuple(gather_kv(cache, batch.block_tables[seq], length).transpose(0, 1).repeat_interleave(group, 0)
                 for cache in (batch.k_cache, batch.v_cache))


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention aligned to the end of the keys, `[..., H, n, D]` queries over `[..., H, L, D]` keys."""
    from torch.nn.attention.bias import causal_lower_right

    n, length, scale = q.shape[-2], k.shape[-2], q.shape[-1] ** -0.5
    if n == length:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, length), scale=scale)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention in float64, aligned to the end of the keys: `[H, n, D]` queries over `[H, L, D]` keys,
    a few heads at a time so an 8k-token prompt's score matrix stays a few GiB."""
    n, length = q.shape[-2], k.shape[-2]
    mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for first in range(0, q.shape[0], 4):
        heads = slice(first, first + 4)
        scores = (q[heads].double() @ k[heads].double().transpose(-1, -2)) * q.shape[-1] ** -0.5
        out[heads] = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v[heads].double()
    return out


def check(batch: Batch, out: torch.Tensor, seqs: int = 4) -> str:
    """Largest |out - float64 reference| over the first `seqs` sequences, and whether all are within tolerance."""
    worst, ok = 0.0, True
    for seq in range(min(seqs, batch.num_seqs)):
        rows = slice(seq * batch.chunk, (seq + 1) * batch.chunk)
        k, v = contiguous_kv(batch, seq)
        expected = reference(batch.query[rows].transpose(0, 1), k, v).transpose(0, 1)
        worst = max(worst, (out[rows].double() - expected).abs().nan_to_num(nan=float("inf")).max().item())
        ok = ok and torch.allclose(out[rows].double(), expected, atol=ATOL, rtol=RTOL)
    return f"{worst:.1e} {'ok' if ok else 'FAIL'}"


def poisoned(query: torch.Tensor) -> torch.Tensor:
    """An output buffer full of NaN: a row the kernel fails to write cannot pass for a result."""
    return torch.full_like(query, float("nan"), memory_format=torch.contiguous_format)


def bench_ms(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100)


def ceilings() -> tuple[float, float, float]:
    """Copy bandwidth in GB/s (bytes read + written), read-only bandwidth in GB/s (a sum over bf16 data: a
    decode kernel reads K/V and writes almost nothing) and bf16 matmul TFLOP/s."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.numel() / bench_ms(lambda: dst.copy_(src)) / 1e6
    del dst
    values = src.view(torch.bfloat16).view(-1, 1 << 20)
    values.normal_()
    partial = torch.empty(values.shape[0], device="cuda", dtype=torch.float32)
    read_gbs = src.numel() / bench_ms(lambda: torch.sum(values, dim=1, dtype=torch.float32, out=partial)) / 1e6
    del src, values, partial
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    matmul_tflops = 2 * n**3 / bench_ms(lambda: a @ b) / 1e9
    return copy_gbs, read_gbs, matmul_tflops


def causal_flops(batch: Batch) -> float:
    """QK^T and PV multiply-adds of causal attention: each row i of a chunk sees context + i + 1 keys."""
    keys_seen = batch.chunk * batch.context + batch.chunk * (batch.chunk + 1) / 2
    return 4.0 * batch.head_dim * batch.hq * batch.num_seqs * keys_seen


def time_backend(config: object, batch: Batch, bound: int | None = None) -> tuple[torch.Tensor, float]:
    """The output of a first call (which also compiles), then the time per call in ms. `bound`: the contexts' bound
    given instead of the longest context, as a CUDA graph's decode gives its tables' width (`max_model_len`)."""
    from tokenmill.kernels.triton_attention import TritonBackend

    backend = TritonBackend(config)
    args = batch.args() if bound is None else (*batch.args()[:-1], bound)
    out = backend.paged_attention(*args, out=poisoned(batch.query))
    return out, bench_ms(lambda: backend.paged_attention(*args))


def run_decode(name: str, heads: tuple, configs: list, read_gbs: float, rows: list[list[str]]) -> None:
    for num_seqs, context in DECODE_CASES:
        batch = make_batch(num_seqs, 1, context - 1, heads)
        kv_bytes = 2 * num_seqs * context * batch.hkv * batch.head_dim * batch.k_cache.element_size()
        for config in configs:
            if out_of_time():
                return
            # A split decode also as CUDA graphs run it, over a 32k-token width: the empty partitions' cost.
            graph_too = config is not None and config.partition and context == 1024
            for bound in (None, GRAPH_BOUND) if graph_too else (None,):
                out, ms = time_backend(config, batch, bound)
                gbs = kv_bytes / ms / 1e6
                case = f"{name} decode {num_seqs}x{context}" + (f" bound {bound}" if bound else "")
                rows.append([case, config_name(config), f"{ms:.3f}", f"{gbs:.0f} GB/s", f"{gbs / read_gbs:.0%} of read",
                             "-", check(batch, out)])
        del batch
        torch.cuda.empty_cache()


def run_kv_write(name: str, heads: tuple, copy_gbs: float, rows: list[list[str]]) -> None:
    """The Triton KV write of one layer: `tokens` new K and V rows scattered to random slots of the cache."""
    from tokenmill.kernels.triton_attention import TritonBackend

    _, hkv, head_dim = heads
    backend = TritonBackend()
    for tokens in KV_WRITE_TOKENS:
        if out_of_time():
            return
        num_blocks = 4 * tokens
        k_cache, v_cache = (torch.zeros(num_blocks, BLOCK_SIZE, hkv, head_dim, device="cuda", dtype=DTYPE)
                            for _ in range(2))
        key, value = (torch.randn(tokens, hkv, head_dim, device="cuda", dtype=DTYPE) for _ in range(2))
        slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:tokens]
        backend.write_kv(key, value, k_cache, v_cache, slots)
        flat = k_cache.view(-1, hkv, head_dim)
        ok = torch.equal(flat[slots], key) and torch.equal(v_cache.view(-1, hkv, head_dim)[slots], value)
        ms = bench_ms(lambda: backend.write_kv(key, value, k_cache, v_cache, slots))
        moved = 2 * 2 * key.numel() * key.element_size()  # K and V, each read once and written once
        gbs = moved / ms / 1e6
        rows.append([f"{name} kv write {tokens} tokens", "-", f"{ms:.4f}", f"{gbs:.0f} GB/s",
                     f"{gbs / copy_gbs:.0%} of copy", "-", "exact" if ok else "FAIL"])
        del k_cache, v_cache, key, value, slots
        torch.cuda.empty_cache()


def run_prefill(name: str, heads: tuple, configs: list, matmul_tflops: float, rows: list[list[str]]) -> None:
    for num_seqs, chunk, context in PREFILL_CASES:
        batch = make_batch(num_seqs, chunk, context, heads)
        flops = causal_flops(batch)
        kv = [contiguous_kv(batch, seq) for seq in range(num_seqs)]
        q = batch.query.view(num_seqs, chunk, batch.hq, batch.head_dim).transpose(1, 2).contiguous()
        k, v = (torch.stack([pair[i] for pair in kv]) for i in (0, 1))
        sdpa_tflops = flops / bench_ms(lambda: sdpa(q, k, v)) / 1e9
        del kv, k, v
        for config in configs:
            if out_of_time():
                return
            out, ms = time_backend(config, batch)
            tflops = flops / ms / 1e9
            rows.append([f"{name} prefill {num_seqs}x{chunk}+{context}", config_name(config), f"{ms:.3f}",
                         f"{tflops:.0f} TFLOP/s", f"{tflops / matmul_tflops:.0%} of matmul",
                         f"{sdpa_tflops:.0f} TFLOP/s", check(batch, out)])
        del batch
        torch.cuda.empty_cache()


def check_invariance(heads: tuple, config: object = None, length: int = 300, device: str = "cuda") -> str:
    """A `length`-token prompt's rows: alone, inside a busy batch, and through chunks of 1, 7 and 50, bitwise. With
    partitions shorter than the prompt, its chunks of 1 past the first partition are split decode steps."""
    from tokenmill.kernels.triton_attention import TritonBackend

    backend = TritonBackend(config)
    batch = make_batch(40, length, 0, heads, device=device)  # sequence 0 is the probe; the others its neighbours
    rows = slice(0, length)
    scale = batch.scale
    alone = backend.paged_attention(batch.query[rows], batch.k_cache, batch.v_cache, batch.block_tables[:1],
                                    batch.cu_seqlens_q[:2], batch.seq_lens[:1], scale, length, length,
                                    out=poisoned(batch.query[rows]))
    failures = []
    for size in (1, 7, 50):
        parts = []
        for start in range(0, length, size):
            end = min(start + size, length)
            cu = torch.tensor([0, end - start], device=device, dtype=torch.int32)
            seq_len = torch.tensor([end], device=device, dtype=torch.int32)
            parts.append(backend.paged_attention(batch.query[start:end], batch.k_cache, batch.v_cache,
                                                 batch.block_tables[:1], cu, seq_len, scale, end - start, end,
                                                 out=poisoned(batch.query[start:end])))
        if not torch.equal(torch.cat(parts), alone):
            failures.append(f"chunks of {size}")
    # The probe third in a batch of 39 decode rows of the other sequences' last tokens and two full prompts.
    order = [1, 2, 0, *range(3, 40)]
    q_lens = [length, length, length] + [1] * 37
    query = torch.cat([batch.query[s * length + length - n:(s + 1) * length] for s, n in zip(order, q_lens)])
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device=device, dtype=torch.int32)
    mixed = backend.paged_attention(query, batch.k_cache, batch.v_cache, batch.block_tables[order], cu,
                                    batch.seq_lens[order], scale, length, length, out=poisoned(query))
    if not torch.equal(mixed[2 * length:3 * length], alone):
        failures.append("in a mixed batch")
    return "bitwise equal" if not failures else "DIFFERS: " + ", ".join(failures)


def config_name(config: object) -> str:
    if config is None:
        return "default"
    name = f"M{config.block_m} N{config.block_n} w{config.num_warps} s{config.num_stages}"
    return name + (f" P{config.partition}" if config.partition else "")


_START = time.monotonic()


def out_of_time() -> bool:
    return time.monotonic() - _START > DEADLINE_S


def print_table(rows: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)))
        if i == 0:
            print("  ".join("-" * width for width in widths))


def configs(head_dim: int) -> list:
    """The backend's default for this head dim first, then the other pipeline depth (what was the default for every
    head dim up to 128 before the sweeps of 2026-12-04) and the default split into partitions of 256 and 1,024 keys
    (flash decoding: decode steps over longer contexts run a program per partition); none twice."""
    from dataclasses import replace

    from tokenmill.kernels.triton_attention import default_config

    default = default_config(head_dim, DTYPE, on_gpu=True)
    others = [replace(default, num_stages=5 - default.num_stages), replace(default, partition=256),
              replace(default, partition=1024)]
    return [None, *(config for config in others if config != default)]


def main(argv: list[str] | None = None) -> int:
    global DEADLINE_S
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds; later cases are skipped")
    parser.add_argument("--shapes", default=",".join(HEADS), help=f"comma-separated subset of {','.join(HEADS)}")
    args = parser.parse_args(argv)
    DEADLINE_S = args.deadline
    if not torch.cuda.is_available():
        print("kernels_gpu: no CUDA device here; this benchmark needs a GPU, nothing was measured.")
        return 0
    torch.manual_seed(0)
    copy_gbs, read_gbs, matmul_tflops = ceilings()
    rows = [["case", "tiles", "ms", "achieved", "of ceiling", "torch SDPA", "max err vs fp64"],
            ["copy 2 GiB", "-", "-", f"{copy_gbs:.0f} GB/s", "ceiling", "-", "-"],
            ["read 2 GiB (sum)", "-", "-", f"{read_gbs:.0f} GB/s", "ceiling", "-", "-"],
            ["bf16 matmul 8192^3", "-", "-", f"{matmul_tflops:.0f} TFLOP/s", "ceiling", "-", "-"]]
    for name in args.shapes.split(","):
        heads = HEADS[name]
        tiles = configs(heads[2])
        run_decode(name, heads, tiles, read_gbs, rows)
        for config in (None, next(c for c in tiles if c is not None and c.partition == 256)):
            if not out_of_time():
                rows.append([f"{name} batch invariance", config_name(config), "-", check_invariance(heads, config),
                             "-", "-", "-"])
        run_kv_write(name, heads, copy_gbs, rows)
        run_prefill(name, heads, tiles, matmul_tflops, rows)
    if out_of_time():
        rows.append([f"stopped after {DEADLINE_S} s", "-", "-", "-", "-", "-", "-"])
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; shapes (Hq, Hkv, D) "
          f"{ {n: HEADS[n] for n in args.shapes.split(',')} } {DTYPE} block size {BLOCK_SIZE}\n")
    print_table(rows)
    return 1 if any("FAIL" in cell or "DIFFERS" in cell for row in rows for cell in row) else 0


if __name__ == "__main__":
    sys.exit(main())

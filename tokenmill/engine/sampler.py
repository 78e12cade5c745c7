"""Vectorised sampling for a whole batch of rows, each with its own parameters.

Random draws come from a counter-based hash of (request seed, output position, token id), not from a
shared generator: a request's noise is then the same whether it runs alone or in any batch, which is what
makes seeded sampling reproducible. Sampling uses the exponential race (argmax of p / E, E ~ Exp(1)),
which picks token i with probability p_i.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.structured import apply_token_masks

if TYPE_CHECKING:
    from tokenmill.engine.structured import Constraint

_MASK32 = 0xFFFFFFFF
_INT64_SPAN = 1 << 64
_INT64_MAX = (1 << 63) - 1


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row besides its logits."""

    params: SamplingParams
    seed: int
    num_output_tokens: int
    token_ids: list[int]  # prompt + output so far, for the repetition penalty
    suppressed_ids: list[int]  # EOS/stop ids banned while min_tokens is not reached
    constraint: Constraint | None = None  # structured output: the grammar masks the logits first


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict | None]  # per row: None, or the chosen token's logprob and the top-n


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (lowbias32) on int64 tensors holding values < 2**32."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def fold_seed(seed: int) -> int:
    """A seed in [0, 2**64) as the int64 with the same 64 bits (two's complement), so it fits a tensor.

    The noise hash reads the low and high 32-bit halves (`& _MASK32`, `>> 32`), which are the same bits
    for the folded value: seeds below 2**63 sample exactly as before, and distinct seeds stay distinct.
    """
    return seed - _INT64_SPAN if seed > _INT64_MAX else seed


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) draws [rows, vocab] that depend only on each row's (seed, position) and the token id."""
    device = seeds.device
    row_key = hash32((seeds & _MASK32) ^ hash32(((seeds >> 32) & _MASK32) ^ hash32(positions & _MASK32)))
    token_key = hash32(torch.arange(vocab_size, device=device, dtype=torch.int64) * 0x9E3779B1 & _MASK32)
    bits = hash32(row_key[:, None] ^ token_key[None, :]) >> 8  # 24 uniform bits
    uniform = (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    # The top draw rounds to 1.0 in float32, so E would be 0 and a masked token's p / E = 0 / 0 = NaN,
    # which argmax picks (seen under grammar masks, about once per 2**24 draws): keep E > 0.
    return (-torch.log(uniform)).clamp_min_(torch.finfo(torch.float32).tiny)


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
        logits = logits.float()
        params = [row.params for row in rows]
        want_logprobs = [p.logprobs for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(n is not None for n in want_logprobs) else None
        logits = apply_token_masks(logits, rows)  # before every other filter; logprobs stay the model's
        logits = self._suppress(logits, rows)
        logits = self._penalise(logits, rows)
        greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        tokens = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            tokens = torch.where(greedy, tokens, self._sample(logits, rows))
        token_list = tokens.tolist()
        return SampleResult(token_list, _logprobs(raw_logprobs, token_list, want_logprobs))

    @staticmethod
    def _suppress(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        pairs = [(i, t) for i, row in enumerate(rows) for t in row.suppressed_ids if t < logits.shape[1]]
        if pairs:
            index = torch.tensor(pairs, device=logits.device).T
            logits = logits.index_put((index[0], index[1]), torch.tensor(float("-inf"), device=logits.device))
        return logits

    @staticmethod
    def _penalise(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Repetition penalty as in transformers: divide positive logits of seen tokens, multiply negative."""
        penalties = [row.params.repetition_penalty for row in rows]
        if all(p == 1.0 for p in penalties):
            return logits
        device = logits.device
        seen = torch.zeros_like(logits, dtype=torch.bool)
        row_index = torch.cat([torch.full((len(r.token_ids),), i, dtype=torch.long) for i, r in enumerate(rows)])
        token_index = torch.tensor([t for r in rows for t in r.token_ids], dtype=torch.long)
        seen[row_index.to(device), token_index.to(device)] = True
        penalty = torch.tensor(penalties, device=device, dtype=logits.dtype)[:, None]
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        return torch.where(seen, penalised, logits)

    @staticmethod
    def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        device, vocab = logits.device, logits.shape[1]
        params = [row.params for row in rows]
        temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=device)
        probs = torch.softmax(logits / temperature[:, None], dim=-1)
        seeds = torch.tensor([fold_seed(row.seed) for row in rows], device=device, dtype=torch.int64)
        positions = torch.tensor([row.num_output_tokens for row in rows], device=device, dtype=torch.int64)
        noise = exponential_noise(seeds, positions, vocab)
        if all(p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0 for p in params):
            return (probs / noise).argmax(dim=-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        sorted_probs = sorted_probs.masked_fill(_filtered(sorted_probs, params), 0.0)
        choice = (sorted_probs / noise.gather(1, order)).argmax(dim=-1, keepdim=True)
        return order.gather(1, choice)[:, 0]


def _filtered(sorted_probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask of sorted positions removed by top-k, top-p and min-p. The top token always survives."""
    device, vocab = sorted_probs.device, sorted_probs.shape[1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    rank = torch.arange(vocab, device=device)[None, :]
    removed = rank >= top_k[:, None]
    removed |= (sorted_probs.cumsum(dim=-1) - sorted_probs) > top_p[:, None]
    removed |= sorted_probs < (min_p * sorted_probs[:, 0])[:, None]
    removed[:, 0] = False
    return removed


def _logprobs(raw: torch.Tensor | None, tokens: list[int], wanted: list[int | None]) -> list[dict | None]:
    if raw is None:
        return [None] * len(tokens)
    top_n = max(n for n in wanted if n is not None)
    top_values, top_ids = raw.topk(top_n, dim=-1) if top_n else (raw[:, :0], raw[:, :0].long())
    chosen = raw.gather(1, torch.tensor(tokens, device=raw.device)[:, None])[:, 0].tolist()
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    return [
        None if n is None else {
            "token_id": tokens[i],
            "logprob": chosen[i],
            "top_logprobs": [[top_ids[i][k], top_values[i][k]] for k in range(n)],
        }
        for i, n in enumerate(wanted)
    ]

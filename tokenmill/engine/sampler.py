"""Vectorised sampling for a whole batch of rows, each with its own parameters.

Random draws come from a counter-based hash of (request seed, output position, token id), not from a
shared generator: a request's noise is then the same whether it runs alone or in any batch, which is what
makes seeded sampling reproducible. Sampling uses the exponential race (argmax of p / E, E ~ Exp(1)),
which picks token i with probability p_i.

Cost: greedy rows never draw noise, and which rows are greedy is read from the host-side parameters, not
from the device. The noise is hashed in place over reused int64 buffers (the token half of the key is
computed once per vocabulary), a few rows at a time on CPU so the temporaries stay in cache. The tokens
and any logprobs come back to the host in one read (`transfer.read_back`), the step's only sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tokenmill.engine.structured import AllowedTokens, mask_logits
from tokenmill.engine.transfer import PendingRead, read_back, to_device
from tokenmill.sampling_params import GREEDY_TEMPERATURE, SamplingParams

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
    num_output_tokens: int  # the position whose noise the row draws (the engine keeps it current for sampled rows)
    token_ids: list[int]  # prompt + output so far, for the repetition penalty
    suppressed_ids: list[int]  # EOS/stop ids banned while min_tokens is not reached (set with `suppress`)
    constraint: Constraint | None = None  # structured output: the grammar masks the logits first
    # Greedy, with no logprobs, grammar, penalty or suppressed ids: the row's token is its logits' argmax.
    # Known per row so that a batch of such rows (the common batch) is read once, not once per feature.
    argmax_only: bool = field(init=False)

    def __post_init__(self) -> None:
        self.suppress(self.suppressed_ids)

    def suppress(self, token_ids: list[int]) -> None:
        self.suppressed_ids = token_ids
        params = self.params
        self.argmax_only = (params.greedy and params.logprobs is None and params.repetition_penalty == 1.0
                            and self.constraint is None and not token_ids)


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict | None]  # per row: None, or the chosen token's logprob and the top-n
    scores: list[list[float]] | None = None  # the `scores` given to the sampler, read back with the tokens


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


def _hash32_(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """`hash32` in place on `x`, with `scratch` (same shape) for the shifts: no allocation."""
    for multiplier, shift in ((0x7FEB352D, 16), (0x846CA68B, 15)):
        x.bitwise_xor_(torch.bitwise_right_shift(x, shift, out=scratch))
        x.mul_(multiplier).bitwise_and_(_MASK32)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=scratch))


_token_keys_cache: dict[tuple[int, torch.device], torch.Tensor] = {}


def _token_keys(vocab_size: int, device: torch.device) -> torch.Tensor:
    """Each token id's hashed key [vocab]: the same every step, so computed once per vocabulary and device."""
    keys = _token_keys_cache.get((vocab_size, device))
    if keys is None:
        ids = torch.arange(vocab_size, device=device, dtype=torch.int64)
        keys = _token_keys_cache[(vocab_size, device)] = hash32(ids * 0x9E3779B1 & _MASK32)
    return keys


def _row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Each row's key [rows] from its request seed (64 bits) and output position."""
    return hash32((seeds & _MASK32) ^ hash32(((seeds >> 32) & _MASK32) ^ hash32(positions & _MASK32)))


def _noise_(keys: torch.Tensor) -> torch.Tensor:
    """Exp(1) draws from `row_key ^ token_key` values (consumed): hash, top 24 bits, -log of their uniform.

    Float32 `(bits + 0.5) * 2**-24` then `-log`, in place, exactly as the unfused formula computes it."""
    _hash32_(keys, torch.empty_like(keys)).bitwise_right_shift_(8)  # 24 uniform bits
    uniform = keys.to(torch.float32)
    # The top draw rounds to 1.0 in float32, so E would be 0 and a masked token's p / E = 0 / 0 = NaN,
    # which argmax picks (seen under grammar masks, about once per 2**24 draws): keep E > 0.
    return uniform.add_(0.5).mul_(1.0 / (1 << 24)).log_().neg_().clamp_min_(torch.finfo(torch.float32).tiny)


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) draws [rows, vocab] that depend only on each row's (seed, position) and the token id."""
    keys = _row_keys(seeds, positions)[:, None] ^ _token_keys(vocab_size, seeds.device)[None, :]
    return _noise_(keys)


def argmax(rows: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value, the first of equal ones (as `Tensor.argmax`), through `max`: torch's
    CPU kernel for `max` over a dimension reads a row faster than its `argmax`, in bfloat16 most of all."""
    return rows.max(dim=-1).indices


def _race(probs: torch.Tensor, row_keys: torch.Tensor, token_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """argmax over each row of `probs / noise`, the noise of token `token_ids[r, j]` at column j (or of
    token j when `token_ids` is None). On CPU a few rows at a time, so the int64 temporaries of the
    noise stay in cache; on a GPU in one go (each chunk would cost a launch per operation)."""
    rows, columns = probs.shape
    token_keys = _token_keys(vocab_size, probs.device)
    step = rows if probs.is_cuda else max(1, (1 << 17) // columns)
    choices = []
    for a in range(0, rows, step):
        keys = token_keys[token_ids[a : a + step]] if token_ids is not None else token_keys[None, :]
        noise = _noise_(row_keys[a : a + step, None] ^ keys)
        choices.append(argmax(torch.div(probs[a : a + step], noise, out=noise)))
    return choices[0] if len(choices) == 1 else torch.cat(choices)


class Sampler:
    @staticmethod
    def launch(logits: torch.Tensor) -> PendingRead:
        """The tokens of rows that all take their argmax (`SamplingRow.argmax_only`), left on their way to the host:
        the same tokens `__call__` gives, read when the caller waits for them."""
        return PendingRead(argmax(logits))

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow], scores: torch.Tensor | None = None) -> SampleResult:
        """A token per row of `logits`. `scores` (any float64 `[n, 2]` tensor, on the same device) is read back in the
        same transfer as the tokens, so a step still waits for the device once."""
        if all([row.argmax_only for row in rows]):  # the same tokens as below, with one read of the rows
            return _read_back(argmax(logits), None, [None] * len(rows), scores)
        logits = logits.float()
        # Per-row host reads as list comprehensions: on CPython 3.11+ their specialised attribute loads beat
        # map(attrgetter(...)), whose generic lookups cost about twice as much per row.
        params = [row.params for row in rows]
        want_logprobs = [p.logprobs for p in params]
        wants = want_logprobs.count(None) != len(want_logprobs)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if wants else None
        constraints = [row.constraint for row in rows]
        allowed = None
        if constraints.count(None) != len(constraints):  # before every other filter; logprobs stay the model's
            allowed = mask_logits(logits, constraints, [_plain(row) for row in rows])
        logits = self._suppress(logits, rows)
        logits = self._penalise(logits, rows)
        listed = set(allowed.rows) if allowed is not None else set()
        # Greedy or not is known on the host: no device read decides which rows draw noise.
        all_greedy = max([p.temperature for p in params], default=0.0) < GREEDY_TEMPERATURE
        sampled = [] if all_greedy else [i for i, p in enumerate(params) if not p.greedy and i not in listed]
        if sampled and len(sampled) == len(rows):
            tokens = self._sample(logits, rows)
        else:
            greedy = len(rows) - len(sampled) - len(listed)
            tokens = argmax(logits) if greedy else torch.zeros(len(rows), dtype=torch.int64, device=logits.device)
            if sampled:
                index = to_device(sampled, torch.int64, logits.device)
                drawn = self._sample(logits.index_select(0, index), [rows[i] for i in sampled])
                tokens = tokens.index_put((index,), drawn)
        if allowed is not None:
            index = torch.tensor(allowed.rows)
            tokens = tokens.index_put((index,), self._sample_allowed(logits, rows, allowed, index))
        return _read_back(tokens, raw_logprobs, want_logprobs, scores)

    @classmethod
    def _sample_allowed(cls, logits: torch.Tensor, rows: list[SamplingRow], allowed: AllowedTokens,
                        index: torch.Tensor) -> torch.Tensor:
        """The tokens of the listed rows (`index`: `allowed.rows`), from their allowed tokens only: what the masked
        full row would give (the argmax, or the race among the same tokens with the same noise), without a pass
        over the vocabulary."""
        values = logits[index[:, None], allowed.token_ids].masked_fill_(~allowed.valid, float("-inf"))
        choice = values.argmax(dim=1)  # the lowest allowed token among equal maxima, as the full row's argmax
        drawn = [k for k, i in enumerate(allowed.rows) if not rows[i].params.greedy]
        if drawn:
            at = torch.tensor(drawn)
            choice[at] = cls._sample(values[at], [rows[allowed.rows[k]] for k in drawn],
                                     (allowed.token_ids[at], logits.shape[1]))
        return allowed.token_ids.gather(1, choice[:, None])[:, 0]

    @staticmethod
    def _suppress(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        if not any([row.suppressed_ids for row in rows]):
            return logits
        pairs = [(i, t) for i, row in enumerate(rows) for t in row.suppressed_ids if t < logits.shape[1]]
        if pairs:
            index = to_device(pairs, torch.int64, logits.device).T
            logits = logits.index_put((index[0], index[1]), logits.new_full((), float("-inf")))  # no host copy
        return logits

    @staticmethod
    def _penalise(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Repetition penalty as in transformers: divide positive logits of seen tokens, multiply negative."""
        penalties = [row.params.repetition_penalty for row in rows]
        if penalties.count(1.0) == len(penalties):
            return logits
        device = logits.device
        seen = torch.zeros_like(logits, dtype=torch.bool)
        row_index = to_device([i for i, r in enumerate(rows) for _ in r.token_ids], torch.int64, device)
        token_index = to_device([t for r in rows for t in r.token_ids], torch.int64, device)
        seen[row_index, token_index] = True
        penalty = to_device(penalties, logits.dtype, device)[:, None]
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        return torch.where(seen, penalised, logits)

    @staticmethod
    def _sample(logits: torch.Tensor, rows: list[SamplingRow],
                columns: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
        """A token per row; with `columns` (token ids, vocabulary size), for rows without top-k/p or min-p whose
        column j of row r holds token `token_ids[r, j]`: the column index it is at."""
        device = logits.device
        params = [row.params for row in rows]
        temperature = to_device([1.0 if p.greedy else p.temperature for p in params], torch.float32, device)
        probs = torch.softmax(logits / temperature[:, None], dim=-1)
        keys = to_device([[fold_seed(row.seed), row.num_output_tokens] for row in rows], torch.int64, device)
        row_keys = _row_keys(keys[:, 0], keys[:, 1])
        if columns is not None:
            return _race(probs, row_keys, *columns)
        if all(_unfiltered(p) for p in params):
            return _race(probs, row_keys, None, logits.shape[1])
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        sorted_probs = sorted_probs.masked_fill(_filtered(sorted_probs, params), 0.0)
        choice = _race(sorted_probs, row_keys, order, logits.shape[1])
        return order.gather(1, choice[:, None])[:, 0]


def _unfiltered(p: SamplingParams) -> bool:
    """No top-k, top-p or min-p: the race runs over the whole distribution as it is."""
    return p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0


def _plain(row: SamplingRow) -> bool:
    """Whether the row's token depends on its allowed tokens' logits alone: no filter that reads the whole
    distribution, no penalty or suppressed stop to apply first."""
    return _unfiltered(row.params) and row.params.repetition_penalty == 1.0 and not row.suppressed_ids


def _filtered(sorted_probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask of sorted positions removed by top-k, top-p and min-p. The top token always survives."""
    device, vocab = sorted_probs.device, sorted_probs.shape[1]
    top_k = to_device([p.top_k if p.top_k > 0 else vocab for p in params], torch.int64, device)
    top_p, min_p = to_device([[p.top_p, p.min_p] for p in params], torch.float32, device).unbind(1)
    rank = torch.arange(vocab, device=device)[None, :]
    removed = rank >= top_k[:, None]
    removed |= (sorted_probs.cumsum(dim=-1) - sorted_probs) > top_p[:, None]
    removed |= sorted_probs < (min_p * sorted_probs[:, 0])[:, None]
    removed[:, 0] = False
    return removed


def _read_back(tokens: torch.Tensor, raw: torch.Tensor | None, wanted: list[int | None],
               scores: torch.Tensor | None = None) -> SampleResult:
    """The step's one device read: the tokens, and the logprobs packed into the same float64 tensor
    (token ids are exact in float64, float32 logprobs widen exactly), then any `scores` rows after them."""
    if raw is None and scores is None:
        return SampleResult(read_back(tokens), [None] * len(wanted))
    parts = [tokens[:, None].double()]
    if raw is not None:
        top_n = max(n for n in wanted if n is not None)
        top_values, top_ids = raw.topk(top_n, dim=-1) if top_n else (raw[:, :0], raw[:, :0].long())
        parts += [raw.gather(1, tokens[:, None]).double(), top_ids.double(), top_values.double()]
    packed = torch.cat(parts, dim=1)
    values, scored = _read_packed(packed, scores)
    token_list = [int(row[0]) for row in values]
    if raw is None:
        return SampleResult(token_list, [None] * len(wanted), scored)
    return SampleResult(token_list, [
        None if n is None else {
            "token_id": token_list[i],
            "logprob": values[i][1],
            "top_logprobs": [[int(values[i][2 + k]), values[i][2 + top_n + k]] for k in range(n)],
        }
        for i, n in enumerate(wanted)
    ], scored)


def _read_packed(packed: torch.Tensor, scores: torch.Tensor | None) -> tuple[list[list[float]], list[list[float]] | None]:
    """The rows of `packed` and of `scores` (both float64, 2-D), in one read."""
    if scores is None:
        return read_back(packed), None
    flat = read_back(torch.cat([packed.reshape(-1), scores.reshape(-1)]))
    width, split = packed.shape[1], packed.numel()
    return ([flat[i : i + width] for i in range(0, split, width)],
            [flat[i : i + 2] for i in range(split, len(flat), 2)])

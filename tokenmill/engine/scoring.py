"""Scoring continuations of a prompt: label probabilities (`choice_probabilities`) and `LLM.score`.

A request that scores continuations runs as scoring sequences (`Sequence.num_scored_tokens`), which sample nothing:
first its prompt alone, whose last position's logits score every continuation's first token; then, forked from the
prompt's K/V once it is computed (`Scheduler.fork`: its full blocks shared, its partial last block copied), one
sequence per continuation of two tokens or more, the prompt and all but the continuation's last token, whose
positions score the tokens after them. So the prompt is computed once and each continuation adds its length less
one; a continuation that finds no free slot or block queues instead and finds the prompt's full blocks in the prefix
cache. The runner computes logits only at the scored positions, after the sampled rows: log-softmax of the raw
logits (no temperature, no filter) at each target, and whether the target is the row's argmax; both come back in the
step's one read-back with the sampled tokens. Results are written by position, so a preempted sequence that
recomputes them writes the same values again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tokenmill.engine.transfer import to_device
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.scheduler import ScheduledBatch
from tokenmill.scheduler.sequence import Sequence


#: The parameters of every scoring sequence: none is read (a scoring sequence samples nothing).
_NO_SAMPLING = SamplingParams(max_tokens=1)


@dataclass
class ScoreOutput:
    """One continuation scored given the prompt, as lm-eval-harness's `loglikelihood` defines it.

    `logprob`: the sum of its tokens' log-probabilities under the model (log-softmax of the logits: no temperature,
    no filter, nothing sampled); `is_greedy`: whether each of its tokens is the argmax given the prompt and the
    tokens before it; `token_ids` and `token_logprobs`: per token, in order.
    """

    logprob: float
    is_greedy: bool
    token_ids: list[int]
    token_logprobs: list[float]


@dataclass(eq=False)
class ScoredSequence(Sequence):
    """A scoring sequence of `group`: the logits of its k-th scored position (of its last `len(targets)`) score
    the tokens `targets[k]`, with results `logprobs[k]` and `greedy[k]`, filled in as the steps that compute them
    run."""

    group: ScoreGroup | None = None
    targets: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    greedy: list[list[bool]] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.num_scored_tokens = len(self.targets)
        self.logprobs = [[0.0] * len(tokens) for tokens in self.targets]
        self.greedy = [[False] * len(tokens) for tokens in self.targets]


@dataclass(eq=False)
class ScoreGroup:
    """A request that scores `continuations` of its prompt: `prompt`, the prompt's scoring sequence (its last
    position scores the distinct first tokens), and `children[i]` for continuation i (None for a one-token one);
    `remaining` counts those not yet computed. `labels` are the choices of a `choice_probabilities` request."""

    request_id: str
    prompt_token_ids: list[int]
    continuations: list[list[int]]
    labels: list[str] | None
    arrival_time: float
    prompt: ScoredSequence = field(init=False)
    children: list[ScoredSequence | None] = field(init=False)
    remaining: int = field(init=False)
    forked: bool = False

    def __post_init__(self) -> None:
        firsts = list(dict.fromkeys(tokens[0] for tokens in self.continuations))
        self.prompt = ScoredSequence(self.request_id, self.prompt_token_ids, _NO_SAMPLING, group=self, targets=[firsts])
        self.children = [None if len(tokens) == 1 else
                         ScoredSequence(self.request_id, self.prompt_token_ids + tokens[:-1], _NO_SAMPLING, group=self,
                                        targets=[[token] for token in tokens[1:]])
                         for tokens in self.continuations]
        self.remaining = 1 + sum(child is not None for child in self.children)

    @property
    def sequences(self) -> list[ScoredSequence]:
        return [self.prompt] + [child for child in self.children if child is not None]

    def scores(self) -> list[ScoreOutput]:
        first = {token: (logprob, greedy) for token, logprob, greedy
                 in zip(self.prompt.targets[0], self.prompt.logprobs[0], self.prompt.greedy[0])}
        outputs = []
        for tokens, child in zip(self.continuations, self.children):
            logprobs, greedy = [first[tokens[0]][0]], [first[tokens[0]][1]]
            if child is not None:
                logprobs += [values[0] for values in child.logprobs]
                greedy += [values[0] for values in child.greedy]
            outputs.append(ScoreOutput(math.fsum(logprobs), all(greedy), list(tokens), logprobs))
        return outputs


def normalise(logprobs: list[float]) -> list[float]:
    """Probabilities proportional to `exp(logprobs)`, summing to 1 (computed from the largest, so none overflows)."""
    top = max(logprobs)
    weights = [math.exp(value - top) for value in logprobs]
    total = math.fsum(weights)
    return [weight / total for weight in weights]


@dataclass
class ScoreRows:
    """The scored positions a step computes: `rows` (their flat batch rows), the tokens they score (`targets`, each
    with the index of its row in `rows`, `target_rows`), and per sequence the range of its positions they are."""

    rows: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    target_rows: list[int] = field(default_factory=list)
    ranges: list[tuple[ScoredSequence, int, int]] = field(default_factory=list)  # (sequence, first position, end)

    def record(self, values: list[list[float]]) -> None:
        """Write each target's [logprob, 1.0 if argmax else 0.0] (`score_logits`, read back) into its sequence."""
        at = 0
        for seq, first, end in self.ranges:
            for k in range(first, end):
                chunk = values[at : at + len(seq.targets[k])]
                seq.logprobs[k] = [value[0] for value in chunk]
                seq.greedy[k] = [value[1] == 1.0 for value in chunk]
                at += len(chunk)


def score_rows(batch: ScheduledBatch) -> ScoreRows:
    """The scored positions of `batch` (planned, not yet run). Decodes lead the batch and never score, so the walk
    starts after them; a pooling sequence reads hidden states, not logits (`pooling.pool_rows`)."""
    out = ScoreRows()
    offset = head = batch.num_decodes
    for seq, count in zip(batch.seqs[head:], batch.num_new_tokens[head:]):
        if seq.num_scored_tokens and seq.pooling is None:
            start, first = seq.num_computed_tokens, seq.num_tokens - seq.num_scored_tokens
            low, high = max(start, first) - first, start + count - first  # scored positions, as indices
            for k in range(low, high):
                out.target_rows += [len(out.rows)] * len(seq.targets[k])  # type: ignore[attr-defined]  # the engine's
                out.targets += seq.targets[k]  # type: ignore[attr-defined]
                out.rows.append(offset + first + k - start)
            if low < high:
                out.ranges.append((seq, low, high))  # type: ignore[arg-type]
        offset += count
    return out


def score_logits(logits: torch.Tensor, rows: ScoreRows) -> torch.Tensor:
    """`[targets, 2]` float64 on the logits' device, no sync: each target's log-probability under its row (`logits`
    has one per `rows.rows`; log-softmax in float32) and 1.0 where it is the row's argmax (the lowest id among
    equal maxima), else 0.0."""
    logits = logits.float()
    index = to_device(rows.target_rows, torch.int64, logits.device)
    targets = to_device(rows.targets, torch.int64, logits.device)
    chosen = logits[index, targets] - torch.logsumexp(logits, dim=-1)[index]
    greedy = logits.argmax(dim=-1)[index] == targets
    return torch.stack([chosen.double(), greedy.double()], dim=1)

"""Scoring continuations of a prompt: label probabilities (`choice_probabilities`) and `LLM.score`.

A request that scores continuations runs as scoring sequences (`Sequence.num_scored_tokens`), which sample nothing,
over the continuations' trie (`ScoreGroup`): each distinct proper prefix of a continuation is one position to
compute, whose logits score the tokens that follow it (the prompt's last position scores every first token). The
first sequence computes the prompt and one path down the trie; each branch off a path is a sequence forked from the
path's K/V once that is computed (`Scheduler.fork`: its full blocks shared, a partial last block copied). So the
prompt is computed once and the continuations add one token per trie node that has children, shared prefixes once:
Σ(length - 1) tokens where they share none. A forked sequence that finds no free slot or block queues instead and
finds the full blocks in the prefix cache; the prompt is admitted with running slots kept for all its forks
(`Sequence.num_forks`), so that this stays rare. The runner computes logits only at the scored positions, after the
sampled rows: log-softmax of the raw logits (no temperature, no filter) at each target, and whether the target is
the row's argmax; both come back in the step's one read-back with the sampled tokens. Results are written by
position, so a preempted sequence that recomputes them writes the same values again.
"""

from __future__ import annotations

import functools
import math
from collections import deque
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
    run. `forks` start from its K/V once it is computed whole, each taking its first `fork_at` tokens (0: this one
    starts from the prompt alone); `started` once the scheduler holds it. Targets and results are tuples of numbers,
    which the garbage collector stops tracking, so that many short-lived sequences do not make it scan the heap."""

    group: ScoreGroup | None = None
    targets: tuple[tuple[int, ...], ...] = ()
    logprobs: list[tuple[float, ...]] = field(default_factory=list)
    greedy: list[tuple[bool, ...]] = field(default_factory=list)
    forks: tuple[ScoredSequence, ...] = ()
    fork_at: int = 0
    started: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self.num_scored_tokens = len(self.targets)
        self.logprobs = [()] * len(self.targets)
        self.greedy = [()] * len(self.targets)


#: A trie of continuations: each next token to the trie of what follows it (empty where a continuation ends).
Trie = dict[int, "Trie"]

#: Where a continuation token's score is: (index of the chain, its scored position, index in that position's targets).
Spot = tuple[int, int, int]


def trie(continuations: tuple[tuple[int, ...], ...]) -> Trie:
    """The continuations' trie; each node's tokens in the order the continuations first reach them."""
    root: Trie = {}
    for tokens in continuations:
        node = root
        for token in tokens:
            node = node.setdefault(token, {})
    return root


@dataclass(frozen=True)
class Chain:
    """One scoring sequence of a `ScorePlan`: the prompt, then `tokens`. The prompt and the first `fork_at` of its
    `tokens` come from the K/V of the chain it forks from (the first chain forks from none); its last `len(targets)`
    positions score `targets`. `forks` are the indices of the chains that fork from it; `num_forks` counts them and
    theirs in turn."""

    tokens: tuple[int, ...]
    fork_at: int
    targets: tuple[tuple[int, ...], ...]
    forks: tuple[int, ...]
    num_forks: int


@dataclass(frozen=True)
class ScorePlan:
    """How a request scores its continuations, whatever its prompt: `chains[0]` computes the prompt's last position
    and one path down the continuations' trie (see `ScoreGroup`); `paths[i]` locates continuation i's scores."""

    chains: tuple[Chain, ...]
    paths: tuple[tuple[Spot, ...], ...]


@functools.lru_cache(maxsize=256)
def score_plan(continuations: tuple[tuple[int, ...], ...]) -> ScorePlan:
    """The plan of `continuations` (each a non-empty tuple of token ids), built once per distinct set."""
    root = trie(continuations)
    built, forks, where = _split(root)
    descendants = [0] * len(built)
    for index in reversed(range(len(built))):  # a chain's forks follow it
        descendants[index] = sum(1 + descendants[fork] for fork in forks[index])
    chains = tuple(Chain(tokens, fork_at, targets, tuple(forks[index]), descendants[index])
                   for index, (tokens, fork_at, targets) in enumerate(built))
    return ScorePlan(chains, tuple(_path(tokens, root, chains, where) for tokens in continuations))


def _split(root: Trie) -> tuple[list[tuple[tuple[int, ...], int, tuple[tuple[int, ...], ...]]], list[list[int]],
                                dict[int, tuple[int, int]]]:
    """The trie's computed nodes split into chains: each (tokens, fork_at, targets) as `Chain` has them, the indices of
    each one's forks, and for each computed node's id, (its chain's index, its scored position). A chain computes its
    first node and, in turn, the first child of each node that has children of its own; every other such child starts
    a chain forked from it, listed after it."""
    where: dict[int, tuple[int, int]] = {}
    pending: deque[tuple[list[int], Trie, int, int]] = deque([([], root, 0, -1)])  # tokens, node, fork_at, parent
    built: list[tuple[tuple[int, ...], int, tuple[tuple[int, ...], ...]]] = []
    forks: list[list[int]] = []
    while pending:
        tokens, node, fork_at, parent = pending.popleft()
        index, nodes = len(built), [node]
        while computed := [(token, child) for token, child in node.items() if child]:
            pending.extend((tokens + [token], child, len(tokens), index) for token, child in computed[1:])
            token, node = computed[0]
            tokens.append(token)
            nodes.append(node)
        where.update((id(n), (index, k)) for k, n in enumerate(nodes))
        built.append((tuple(tokens), fork_at, tuple(tuple(n) for n in nodes)))
        forks.append([])
        if parent >= 0:
            forks[parent].append(index)
    return built, forks, where


def _path(tokens: tuple[int, ...], root: Trie, chains: tuple[Chain, ...],
          where: dict[int, tuple[int, int]]) -> tuple[Spot, ...]:
    """Where the scores of `tokens` (a continuation) are."""
    path, node = [], root
    for token in tokens:
        index, k = where[id(node)]
        path.append((index, k, chains[index].targets[k].index(token)))
        node = node[token]
    return tuple(path)


@dataclass(eq=False)
class ScoreGroup:
    """A request that scores `continuations` of its prompt, computing each distinct proper prefix of them once.

    A node of the continuations' trie with children is a position to compute: its logits score its children's
    tokens (the root's: the prompt's last position). `prompt` computes the prompt, then follows the first child that
    has children of its own, node after node; every other such child at those nodes starts a sequence forked from it
    (its `forks`), which goes on the same way (`score_plan`). So `sequences` compute each such node once. `remaining`
    counts the sequences not yet computed; `labels` are the choices of a `choice_probabilities` request; every
    sequence is in the request's `share` (`Sequence.share`)."""

    request_id: str
    prompt_token_ids: list[int]
    continuations: list[list[int]]
    labels: list[str] | None
    arrival_time: float
    share: str | None = None
    prompt: ScoredSequence = field(init=False)
    sequences: list[ScoredSequence] = field(init=False)
    plan: ScorePlan = field(init=False)
    remaining: int = field(init=False)

    def __post_init__(self) -> None:
        self.plan = score_plan(tuple(map(tuple, self.continuations)))
        prompt, length = self.prompt_token_ids, len(self.prompt_token_ids)
        self.sequences = [ScoredSequence(self.request_id, [*prompt, *chain.tokens], _NO_SAMPLING, group=self,
                                         targets=chain.targets, fork_at=length + chain.fork_at if index else 0,
                                         num_forks=chain.num_forks, share=self.share)
                          for index, chain in enumerate(self.plan.chains)]
        for seq, chain in zip(self.sequences, self.plan.chains):
            if chain.forks:
                seq.forks = tuple(self.sequences[index] for index in chain.forks)
        self.prompt = self.sequences[0]
        self.remaining = len(self.sequences)

    def scores(self) -> list[ScoreOutput]:
        return [self._score(tokens, path) for tokens, path in zip(self.continuations, self.plan.paths)]

    def _score(self, tokens: list[int], path: tuple[Spot, ...]) -> ScoreOutput:
        logprobs = [self.sequences[index].logprobs[k][j] for index, k, j in path]
        greedy = all(self.sequences[index].greedy[k][j] for index, k, j in path)
        return ScoreOutput(math.fsum(logprobs), greedy, list(tokens), logprobs)


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
                seq.logprobs[k] = tuple([value[0] for value in chunk])
                seq.greedy[k] = tuple([value[1] == 1.0 for value in chunk])
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

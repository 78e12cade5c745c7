"""One request's state as the scheduler sees it: its tokens, how many have K/V in the cache, and its blocks."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the scheduler reads max_tokens only
    from tokenmill.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """`token_ids` holds the prompt followed by the generated tokens.

    `num_computed_tokens` counts the leading tokens whose K/V are in the cache (computed or found in the
    prefix cache); the rest still has to go through the model, in as many chunks as the budget demands.
    After preemption it drops to 0 and the sequence recomputes prompt and outputs alike.

    A scoring sequence (`num_scored_tokens > 0`) is prefilled and never decodes: it samples nothing, and the
    logits of its last `num_scored_tokens` positions are read (to score the tokens the engine holds for them).
    Those positions are always computed (never served from the prefix cache); it ends once all are computed.
    A pooling sequence (`pooling` set: "last", "mean" or "cls") is a scoring sequence whose read positions give their
    final hidden states instead of logits (the engine pools them into an embedding): the last one, or all of them.

    `num_forks` counts the sequences still to be forked from this one once it is computed (and from those in turn):
    the scheduler keeps that many running slots free for them while it runs (`Scheduler.fork`).

    `share` names whose work it is (a tenant, a run; None: work of no share, a share of its own): the scheduler admits
    waiting sequences in fair shares (`WaitingQueue`).
    """

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    seq_id: int = field(default_factory=lambda: next(_ids))
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_scored_tokens: int = 0
    pooling: str | None = None
    num_forks: int = 0
    share: str | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

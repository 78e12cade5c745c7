"""The engine loop's one step: schedule, run the model, sample, finish what is done, release its blocks."""

from __future__ import annotations

import collections.abc
import random
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from itertools import compress
from typing import Any

import torch

from tokenmill.engine import sampler as sampler_module
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.detokenize import text_decoder, token_texts
from tokenmill.engine.loader import load
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.engine.pooling import (NO_SAMPLING, CheckpointPooling, PooledSequence, PoolingParams,
                                     checkpoint_pooling, embeddings)
from tokenmill.engine.prompt_limits import check_prompt_chars, max_prompt_chars
from tokenmill.engine.sampler import SampleResult, SamplingRow
from tokenmill.engine.scoring import ScoredSequence, ScoreGroup, ScoreOutput, normalise
from tokenmill.engine.structured import Constraint, GrammarCache, GrammarSpec, advance, check_completion
from tokenmill.engine.transfer import Feed, PendingRead
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from tokenmill.scheduler.sequence import Sequence


@dataclass
class RequestOutput:
    """A finished request. `finish_reason` is "stop" (EOS, stop token or stop string), "length", "error"
    for a request rejected at admission or failed on its own while running (then `error` is
    "<field>: <message>", the text of the `InvalidRequestError` naming what is wrong), or the reason given
    to `cancel_request` ("cancelled", "deadline") for one stopped early with what it had generated.

    A `choice_probabilities` request samples nothing: `choice_probabilities` maps each distinct choice to its
    probability given the prompt, normalised over the choices (they sum to 1); `choice_logprobs` holds each choice's
    total log-probability (the sum over its tokens of the model's log-softmax, before normalising); `text` and
    `token_ids` are the most probable choice (the first among equals), so the output is deterministic, and
    `constraint_satisfied` is True. `scores` holds each continuation's `ScoreOutput`, in order: the distinct choices
    of such a request, or the continuations of `add_score_request`.

    An embedding request (`add_request(..., pooling=PoolingParams(...))`) samples nothing either: `embedding` holds its
    vector, `token_ids` and `text` are empty and `finish_reason` is "stop"."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[dict] | None = None
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float = 0.0
    error: str | None = None
    # Structured outputs: whether the text matches the request's grammar (None: no constraint; False:
    # cut by max_tokens or a stop string), and the JSON value for json_schema/json_object when it does.
    constraint_satisfied: bool | None = None
    parsed: Any = None
    # Why a complete-looking output failed the final check against its constraint ("<field>: <keyword> at
    # <schema pointer> ..."); then constraint_satisfied is False and parsed None.
    constraint_error: str | None = None
    constraint_backend: str | None = None  # the grammar backend that enforced the constraint ("xgrammar", "llguidance")
    choice_probabilities: dict[str, float] | None = None
    choice_logprobs: dict[str, float] | None = None
    scores: list[ScoreOutput] | None = None
    embedding: list[float] | None = None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_prompt_tokens: int
    num_generated_tokens: int
    num_prefix_hit_tokens: int
    num_preemptions: int
    num_steps: int


@dataclass(eq=False)
class _Request(Sequence):
    """A request as the engine holds it: the sequence the scheduler plans (so that a step's sequences are its
    requests, found without a lookup) with what sampling and finishing it need."""

    seed: int = 0
    stop_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.time)
    first_token_time: float | None = None
    logprobs: list[dict] = field(default_factory=list)
    text: str | None = None  # set when a stop string cut the text short
    stops: StopMatcher | None = None  # the request's stop strings, matched step by step
    constraint: Constraint | None = None  # the grammar of a structured-output request
    row: SamplingRow | None = None  # built once, updated each step it samples (see `row_changes`)
    # Whether the row changes from step to step: its output position seeds the noise of a sampled request,
    # and min_tokens lifts its suppressed ids. A greedy row without min_tokens is the same every step.
    row_changes: bool = True
    # A request with no stop strings, grammar or min_tokens can only finish on a stop token or at this
    # length (max_tokens or max_model_len): the step checks just that before asking `_finish_reason`.
    end_len: int = 0
    plain: bool = False


PLACEHOLDER = -1  # a sampled token not yet read back from the device (`async_scheduling`); never a vocabulary id


@dataclass
class _InFlight:
    """A launched step whose tokens are not yet read back (`async_scheduling`). Each request in `rows` holds a
    `PLACEHOLDER` as its last token, for the device's `tokens[rows[request]]`; `retired` are those of them that reached
    their length with it: already finished in the scheduler (blocks and slot freed), their output waits for it."""

    tokens: PendingRead
    rows: dict[_Request, int]
    retired: list[_Request]


@dataclass
class _Pending:
    """A structured request waiting, outside the scheduler, for its grammar to compile."""

    token_ids: list[int]
    params: SamplingParams
    spec: GrammarSpec
    future: Future
    deadline: float
    arrival_time: float = field(default_factory=time.time)
    share: str | None = None


class LLMEngine:
    """Not thread-safe: one thread owns an engine and calls `add_request`/`step` in turn."""

    def __init__(self, model: str = "builtin:tiny", **options: object) -> None:
        self.config = EngineConfig.from_kwargs(model, **options)
        loaded = load(self.config)
        self.tokenizer = loaded.tokenizer
        self.detokenize = text_decoder(self.tokenizer)  # (ids, skip_special_tokens) -> text, as the tokenizer decodes
        self.hf_config = loaded.hf_config
        self.max_model_len = self._max_model_len()
        #: text prompts longer than this are refused before tokenizing (None: the tokenizer gives no bound)
        self.max_prompt_chars = max_prompt_chars(self.tokenizer, self.max_model_len)
        self.runner = ModelRunner(loaded, self.config, self.max_model_len)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            block_size=self.config.block_size,
            num_blocks=self.runner.num_blocks,
            enable_prefix_caching=self.config.enable_prefix_caching,
        ))
        self.eos_ids = self._eos_ids()
        self.requests: dict[str, _Request] = {}
        # How many of `requests` have a row that changes (`_Request.row_changes`) and a grammar: a step whose
        # requests have neither skips the passes over them that would find none (see `_end`).
        self._num_changing_rows = 0
        self._num_constrained = 0
        self._seed_source = random.Random(self.config.seed)
        self._totals = {"prompt": 0, "generated": 0, "preempted": 0, "steps": 0}
        self._grammars: GrammarCache | None = None  # built on the first structured request
        self._pending: dict[str, _Pending] = {}  # requests whose grammar is compiling
        self._choice_tokens: dict[tuple[str, ...], tuple[int, str]] = {}  # choices -> (longest in tokens, that choice)
        self._groups: dict[str, ScoreGroup] = {}  # requests that score continuations (`scoring.py`)
        self._choice_ids: dict[tuple[str, ...], list[list[int]]] = {}  # distinct choices -> their token ids
        self._pooled: dict[str, PooledSequence] = {}  # embedding requests (`pooling.py`)
        self._checkpoint_pooling: CheckpointPooling | None = None  # read on the first embedding request
        self._in_flight: _InFlight | None = None  # the launched step not yet read back (`async_scheduling`)
        self._landed: list[RequestOutput] = []  # outputs read back outside `step` (a cancel landed them), for its next

    def _max_model_len(self) -> int:
        """The configured length, capped by the model's positions and any sliding window (beyond which our
        full attention would differ from the model's)."""
        limits = [getattr(self.hf_config, "max_position_embeddings", None), getattr(self.hf_config, "sliding_window", None)]
        model_limit = min((x for x in limits if x), default=None)
        if self.config.max_model_len is None:
            return model_limit or 4096
        if model_limit and self.config.max_model_len > model_limit:
            raise ValueError(f"max_model_len: {self.config.max_model_len} exceeds the model's limit {model_limit}")
        return self.config.max_model_len

    def _eos_ids(self) -> frozenset[int]:
        ids = self.hf_config.eos_token_id
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        generation_config = getattr(self.runner.model, "generation_config", None)
        extra = getattr(generation_config, "eos_token_id", None)
        ids += [extra] if isinstance(extra, int) else list(extra or [])
        return frozenset(ids)

    # -- requests ---------------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            check_prompt_chars(prompt, self.max_prompt_chars, self.max_model_len)
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if not isinstance(prompt, collections.abc.Sequence):
            raise InvalidRequestError("prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}")
        return list(prompt)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages", "must be a non-empty list of {role, content} dicts")
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
                raise InvalidRequestError(f"messages[{index}]", "must be a dict with a string 'role' and a 'content'")
        if self.tokenizer.chat_template is None:
            raise InvalidRequestError("messages", f"model {self.config.model} has no chat template")
        rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        check_prompt_chars(rendered, self.max_prompt_chars, self.max_model_len)
        return self.tokenizer.encode(rendered, add_special_tokens=False)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None, *,
                    pooling: PoolingParams | None = None, share: str | None = None) -> None:
        """Queue a request, or raise InvalidRequestError naming the field if it can never be served. With `pooling`,
        an embedding request: its prompt is prefilled, nothing is sampled, and its output's `embedding` is the pooled
        vector (`pooling.py`); it takes no `params`. `share`: whose work it is (a tenant, a run); waiting requests are
        admitted in fair shares (`scheduler.WaitingQueue`), None being a share of its own."""
        if pooling is not None:
            self._add_pooled(request_id, prompt, pooling, params, share)
            return
        params = params or SamplingParams()
        self._check_new_id(request_id)
        token_ids = self.tokenize(prompt)
        self._check_prompt(token_ids)
        if params.choice_probabilities:
            labels = list(dict.fromkeys(params.choice))  # type: ignore[arg-type]  # checked: a choice is given
            self._add_group(ScoreGroup(request_id, token_ids, self._choice_token_ids(labels), labels, time.time(),
                                       share))
            return
        self.check_choice_budget(params)
        outside = next((token for token in params.stop_token_ids if not 0 <= token < self.runner.vocab_size), None)
        if outside is not None:
            raise InvalidRequestError("stop_token_ids", f"token {outside} is outside the vocabulary "
                                      f"[0, {self.runner.vocab_size})")
        spec = GrammarSpec.from_params(params)
        if spec is not None and not self._grammar_cache(spec).is_ready(spec):
            future = self._grammar_cache(spec).compile_async(spec)
            deadline = time.time() + self.config.grammar_compile_timeout
            self._pending[request_id] = _Pending(token_ids, params, spec, future, deadline, share=share)
            return
        self._admit(request_id, token_ids, params, spec=spec, share=share)

    def add_score_request(self, request_id: str, prompt: str | list[int], continuations: list[str | list[int]], *,
                          share: str | None = None) -> None:
        """Queue a request that scores each continuation given the prompt (see `ScoreOutput`); its output's `scores`
        hold them in order, and nothing is sampled. A text continuation is tokenized alone, as a `choice` is (see
        `_choice_token_ids`); token ids are taken as they are. Raises InvalidRequestError naming the field. `share`: as
        for `add_request`."""
        self._check_new_id(request_id)
        token_ids = self.tokenize(prompt)
        self._check_prompt(token_ids)
        if not isinstance(continuations, list | tuple) or not continuations:
            raise InvalidRequestError("continuations", "must be a non-empty list of strings or token id lists")
        tokens = [self._continuation_ids(c, f"continuations[{i}]") for i, c in enumerate(continuations)]
        self._add_group(ScoreGroup(request_id, token_ids, tokens, None, time.time(), share))

    def _add_pooled(self, request_id: str, prompt: str | list[int], pooling: PoolingParams,
                    params: SamplingParams | None, share: str | None) -> None:
        """Queue an embedding request: a pooling sequence (`pooling.PooledSequence`), with the checkpoint's pooling
        where the request leaves it open."""
        if params is not None:
            raise InvalidRequestError("pooling", "an embedding request samples nothing: give it no SamplingParams")
        self._check_new_id(request_id)
        token_ids = self.tokenize(prompt)
        self._check_prompt(token_ids)
        if self._checkpoint_pooling is None:
            self._checkpoint_pooling = checkpoint_pooling(self.config.model)
        hidden_size = getattr(self.hf_config, "hidden_size", None)
        mode, normalize, dimensions = self._checkpoint_pooling.resolve(pooling, hidden_size)
        seq = PooledSequence(request_id, token_ids, NO_SAMPLING, pooling=mode, normalize=normalize,
                             dimensions=dimensions, arrival_time=time.time(), share=share)
        self.scheduler.add(seq)
        self._pooled[request_id] = seq
        self._totals["prompt"] += len(token_ids)

    def _check_new_id(self, request_id: str) -> None:
        if (request_id in self.requests or request_id in self._pending or request_id in self._groups
                or request_id in self._pooled or request_id in self._unreturned()):
            raise InvalidRequestError("request_id", f"{request_id!r} is already in flight")

    def _unreturned(self) -> set[str]:
        """Requests finished but not yet returned (`async_scheduling`): retired by the step in flight, or read back
        by a cancel for the next step to return."""
        retired = self._in_flight.retired if self._in_flight is not None else []
        if not retired and not self._landed:
            return set()
        return {r.request_id for r in retired} | {o.request_id for o in self._landed}

    def _continuation_ids(self, continuation: str | list[int], field: str) -> list[int]:
        if isinstance(continuation, str) and continuation:
            tokens = self.tokenizer.encode(continuation, add_special_tokens=False)
            if not tokens:
                raise InvalidRequestError(field, f"{continuation!r} encodes to no token")
            return tokens
        if not isinstance(continuation, list | tuple) or not continuation:
            raise InvalidRequestError(field, f"must be a non-empty string or list of token ids, got {continuation!r}")
        try:
            self._check_prompt(list(continuation))
        except InvalidRequestError as exc:
            raise InvalidRequestError(field, exc.message) from None
        return list(continuation)

    def _choice_token_ids(self, choices: list[str]) -> list[list[int]]:
        """Each choice tokenized alone, `tokenizer.encode(choice, add_special_tokens=False)`, as `check_choice_budget`
        counts it: the spelling the model's own tokenizer gives the choice, appended to the prompt's token ids as they
        are, so every choice shares the prompt's tokens (and its cached blocks) exactly. Whitespace is the choice's:
        where a word follows the prompt after a space, write the space in the choice (" yes"), as lm-eval-harness
        moves it there, since BPE vocabularies attach it to the word after it."""
        key = tuple(choices)
        ids = self._choice_ids.get(key)
        if ids is None:
            ids = [self.tokenizer.encode(choice, add_special_tokens=False) for choice in choices]
            for index, tokens in enumerate(ids):
                if not tokens:
                    raise InvalidRequestError(f"choice[{index}]", f"{choices[index]!r} encodes to no token")
            if len(self._choice_ids) >= 256:
                self._choice_ids.clear()
            self._choice_ids[key] = ids
        return ids

    def _add_group(self, group: ScoreGroup) -> None:
        """Queue a scoring request's first sequence (`scoring.py`); the others are checked now and start from the
        K/V of the one they fork from when it is computed (`_fork`)."""
        for seq in group.sequences:
            self.scheduler.check(seq)
        self.scheduler.add(group.prompt)
        group.prompt.started = True
        self._groups[group.request_id] = group
        self._totals["prompt"] += sum(seq.num_tokens for seq in group.sequences)

    def _fork(self, seq: ScoredSequence) -> None:
        """Start the forks of a scoring sequence now computed, from its K/V (`Scheduler.fork`)."""
        pairs = self.scheduler.fork(seq, seq.forks, [fork.fork_at for fork in seq.forks])  # type: ignore[arg-type]
        self.runner.copy_blocks(pairs)
        for fork in seq.forks:
            fork.started = True

    def _admit(self, request_id: str, token_ids: list[int], params: SamplingParams, arrival: float | None = None,
               spec: GrammarSpec | None = None, share: str | None = None) -> None:
        """Into the scheduler: the request's grammar (`spec`, built once in `add_request`), if any, is compiled by now."""
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        constraint = self._constraint(spec, stop_ids)
        request = _Request(request_id, token_ids, params, stop_ids=stop_ids, constraint=constraint, share=share)
        self.scheduler.add(request)
        request.seed = seed = params.seed if params.seed is not None else self._seed_source.getrandbits(63)
        banned = constraint.banned_ids if constraint is not None else []
        suppressed = (sorted(stop_ids) if params.min_tokens > 0 else []) + banned
        request.row = SamplingRow(params, seed, 0, request.token_ids, suppressed, constraint=constraint)
        request.stops = StopMatcher(params.stop) if params.stop else None
        request.end_len = min(len(token_ids) + params.max_tokens, self.max_model_len)
        request.plain = request.stops is None and constraint is None and params.min_tokens == 0
        request.row_changes = not params.greedy or params.min_tokens > 0
        self.requests[request_id] = request
        self._num_changing_rows += request.row_changes
        self._num_constrained += constraint is not None
        if arrival is not None:
            request.arrival_time = arrival
        self._totals["prompt"] += len(token_ids)

    def check_choice_budget(self, params: SamplingParams) -> None:
        """A `choice` request whose `max_tokens` cannot hold its longest choice as this tokenizer writes it is refused
        (`InvalidRequestError` on max_tokens, naming that count), rather than failed as incomplete after the work. A
        `choice_probabilities` request generates nothing: any `max_tokens` serves it."""
        if not params.choice or params.choice_probabilities:
            return
        key = tuple(params.choice)
        needed = self._choice_tokens.get(key)
        if needed is None:
            needed = max((len(self.tokenizer.encode(c, add_special_tokens=False)), c) for c in params.choice)
            if len(self._choice_tokens) >= 256:
                self._choice_tokens.clear()
            self._choice_tokens[key] = needed
        if params.max_tokens < needed[0]:
            raise InvalidRequestError("max_tokens", f"{params.max_tokens} is fewer than the {needed[0]} tokens of the "
                                      f"longest choice {needed[1]!r}: raise it, or leave it unset to size it from the "
                                      "choices")

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidRequestError("prompt", "is empty")
        for index, token in enumerate(token_ids):
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.runner.vocab_size:
                raise InvalidRequestError(
                    "prompt_token_ids", f"token {token!r} at index {index} is outside the vocabulary [0, {self.runner.vocab_size})"
                )

    def _constraint(self, spec: GrammarSpec | None, stop_ids: frozenset[int]) -> Constraint | None:
        """The request's grammar matcher (compiled once per distinct grammar), or None for free text."""
        if spec is None:
            return None
        return self._grammar_cache(spec).constraint(spec, sorted(stop_ids))

    def _grammar_cache(self, spec: GrammarSpec) -> GrammarCache:
        if self._grammars is None:
            try:
                self._grammars = GrammarCache(self.tokenizer, self.runner.vocab_size, self.eos_ids,
                                              limit_bytes=self.config.grammar_cache_bytes,
                                              backend=self.config.constraint_backend)
            except ImportError as exc:
                raise InvalidRequestError(spec.field, f"structured outputs need the xgrammar package ({exc})") from None
        return self._grammars

    def _admit_compiled(self) -> list[RequestOutput]:
        """Admit the waiting requests whose grammar is ready; fail those whose grammar does not compile or
        took longer than `grammar_compile_timeout`. With nothing else to run, wait a little for one."""
        if not self._pending:
            return []
        if not self.scheduler.has_unfinished() and self._in_flight is None:
            wait([p.future for p in self._pending.values()], timeout=0.01, return_when=FIRST_COMPLETED)
        failed, now = [], time.time()
        for request_id, pending in list(self._pending.items()):
            if not pending.future.done() and now < pending.deadline:
                continue
            del self._pending[request_id]
            try:
                if not pending.future.done():
                    raise InvalidRequestError(pending.spec.field, f"compiling its grammar took longer than "
                                              f"grammar_compile_timeout ({self.config.grammar_compile_timeout:g} s)")
                self._admit(request_id, pending.token_ids, pending.params, pending.arrival_time, pending.spec,
                            pending.share)
            except InvalidRequestError as exc:
                failed.append(RequestOutput(request_id, pending.token_ids, [], "", "error", arrival_time=pending.arrival_time,
                                            finished_time=now, error=str(exc)))
        return failed

    def abort_request(self, request_id: str) -> None:
        self._land_now(request_id)
        self._pending.pop(request_id, None)
        self._end_group(request_id, "abort")
        self._end_pooled(request_id, "abort")
        self._end(request_id, "abort")

    def cancel_request(self, request_id: str, reason: str) -> RequestOutput | None:
        """Finish a request now with `finish_reason=reason` ("cancelled", "deadline"): its blocks and batch slot
        are freed at once and what it generated so far comes back (nothing, for one whose grammar was still
        compiling: it never ran, and now never will). None for a request that is not here. A request that the step in
        flight finished comes back as it finished."""
        landed = self._land_now(request_id)
        if landed is not None:
            return landed
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            return RequestOutput(request_id, pending.token_ids, [], "", reason, arrival_time=pending.arrival_time,
                                 finished_time=time.time(), constraint_satisfied=False)
        group = self._end_group(request_id, reason)
        if group is not None:
            return RequestOutput(request_id, group.prompt_token_ids, [], "", reason, arrival_time=group.arrival_time,
                                 finished_time=time.time(), constraint_satisfied=False if group.labels else None)
        pooled = self._end_pooled(request_id, reason)
        if pooled is not None:
            return RequestOutput(request_id, pooled.prompt_token_ids, [], "", reason, arrival_time=pooled.arrival_time,
                                 finished_time=time.time())
        request = self._end(request_id, reason)
        if request is None:
            return None
        try:
            return self._output(request, time.time(), reason)
        except Exception:  # the partial tokens cannot be decoded: the tokens still are the output
            return RequestOutput(request_id, request.prompt_token_ids, request.output_token_ids, "", reason,
                                 arrival_time=request.arrival_time, first_token_time=request.first_token_time,
                                 finished_time=time.time())

    def _end_group(self, request_id: str, reason: str) -> ScoreGroup | None:
        """Take a scoring request out of `_groups` and finish its sequences in the scheduler."""
        group = self._groups.pop(request_id, None)
        if group is not None:
            for seq in group.sequences:
                if seq.started and not seq.is_finished:
                    self._end_scored(seq, reason)
        return group

    def _end_pooled(self, request_id: str, reason: str) -> PooledSequence | None:
        """Take an embedding request out of `_pooled` and finish its sequence (its blocks freed at once)."""
        seq = self._pooled.pop(request_id, None)
        if seq is not None:
            seq.pooled = None
            self._end_scored(seq, reason)  # type: ignore[arg-type]  # a pooling sequence is a scoring one
        return seq

    def _end_scored(self, seq: ScoredSequence, reason: str) -> None:
        """Finish one scoring sequence (its blocks freed at once) and forget its block-table row."""
        self.runner.release(seq)
        self.scheduler.finish(seq, reason)

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_unfinished() or bool(self._pending) or self._in_flight is not None
                or bool(self._landed))

    # -- the step ---------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling step and forward pass. Returns the requests that finished in it; with `async_scheduling`,
        a step that overlaps returns those the step before it finished (read back while this one runs).

        A failure that belongs to one request (its sampling, decoding its text, matching its stop strings)
        finishes that request with `finish_reason="error"`; the others go on. Anything else (the model's
        forward pass, out of memory, a device error) is the engine's and is raised.
        """
        admitted = self._admit_compiled() + self._landed
        self._landed = []
        batch = self.scheduler.schedule()
        self._totals["preempted"] += batch.num_preempted
        if not batch.seqs:
            return admitted + self._land()
        # The scheduler's sampling sequences are this engine's requests: `_admit` adds only `_Request`s (and
        # `_add_group` only scoring sequences, which never sample).
        sampling: list[_Request] = list(compress(batch.seqs, batch.sample_mask))  # type: ignore[arg-type]
        if self.config.async_scheduling and self._overlaps(batch, sampling):
            tokens = self.runner.launch(batch, self._feed(batch))
            landed = self._land()  # the step before, while this one runs
            if landed:
                _remove_finished(batch)
            self._start(batch, sampling, tokens, bool(landed))
            return admitted + landed
        result, failed = self._execute(batch, sampling)
        landed = self._land()  # a step in flight, read after this one (which took its tokens on the device) ran
        if landed:
            admitted += landed
            failing = {seq for seq, _ in failed}
            result = self._drop_finished(batch, [r for r in sampling if r not in failing], result)
        self._totals["steps"] += 1
        grown = self.scheduler.update(batch, result.token_ids)
        self._totals["generated"] += len(grown)
        requests: list[_Request] = grown if failed or landed else sampling  # type: ignore[assignment]
        self._advance_grammars(requests)
        now = time.time()
        finished = admitted + [self._fail(seq, error, now) for seq, error in failed if not seq.is_finished]
        if batch.scoring:
            finished += self._finish_scored(batch.scoring, now)
        if batch.pooling:
            finished += self._finish_pooled(batch.pooling, now)  # type: ignore[arg-type]  # `_add_pooled` adds them
        for request in self._note_tokens(requests, result, now):
            output = self._settle(request, now)
            if output is not None:
                finished.append(output)
        return finished

    def _settle(self, request: _Request, now: float, reason: str | None = None) -> RequestOutput | None:
        """The output of `request` if it finishes now (with `reason`, else as `_finish_reason` says), which it leaves
        the engine with; a failure that belongs to it (the tokenizer cannot decode its tokens) fails it alone."""
        try:
            reason = reason or self._finish_reason(request)
            output = None if reason is None else self._output(request, now, reason)
        except Exception as exc:  # the tokenizer cannot decode this request's tokens: its failure only
            error = InvalidRequestError("stop" if request.params.stop else "token_ids",
                                        f"decoding the output failed: {exc!r}")
            return self._fail(request, error, now)
        if output is not None:
            self._end(request.request_id, output.finish_reason)
        return output

    # -- steps that overlap (`async_scheduling`) ----------------------------------------------------------
    # A step is planned and launched before the tokens of the one before it are read back: each request of that step
    # holds a placeholder as its last token, which the scheduler counts as any token, and the new step's input takes
    # the token from the device. Only requests whose finish needs no more than the token and the length take part
    # (`_overlaps`), so what the host waits for is the tokens alone; any other step runs whole, fed the same way, and
    # reads the one in flight after it.

    def _overlaps(self, batch: ScheduledBatch, sampling: list[_Request]) -> bool:
        """Whether the step may run while its tokens are read later: it neither scores nor pools, and every request
        that samples takes its argmax and finishes on a stop token or its length only."""
        return not batch.scoring and not batch.pooling and all([r.plain and r.row.argmax_only for r in sampling])

    def _feed(self, batch: ScheduledBatch) -> Feed | None:
        """Where the step's inputs take a token of the step in flight: each of its requests whose chunk ends at its
        placeholder (a decode, or a prompt computed again after preemption)."""
        flight = self._in_flight
        if flight is None:
            return None
        head, get = batch.num_decodes, flight.rows.get
        pairs = [(row, pick) for row, pick in enumerate(map(get, batch.seqs[:head])) if pick is not None]  # decodes
        offset = head
        for seq, count in zip(batch.seqs[head:], batch.num_new_tokens[head:]):
            pick = get(seq)  # type: ignore[call-overload]  # a request's sequence is the request
            if pick is not None and seq.num_computed_tokens + count == len(seq.token_ids):
                pairs.append((offset + count - 1, pick))
            offset += count
        return Feed(flight.tokens.tensor, [row for row, _ in pairs], [pick for _, pick in pairs])

    def _start(self, batch: ScheduledBatch, launched: list[_Request], tokens: PendingRead, landed: bool) -> None:
        """Account for the launched step with placeholders (`launched`: its sampling requests, in the order of its
        tokens; those that the step read meanwhile finished are out of `batch`: they ran, their tokens are dropped);
        those that now reach their length leave the scheduler at once, their output waiting for the token. `landed`:
        whether the step read meanwhile returned any output (else none of `launched` finished)."""
        if landed:
            rows = {request: i for i, request in enumerate(launched) if not request.is_finished}
        else:
            rows = dict(zip(launched, range(len(launched))))
        grown: list[_Request] = self.scheduler.update(batch, [PLACEHOLDER] * len(rows))  # type: ignore[assignment]
        self._totals["steps"] += 1
        retired = [request for request in grown if len(request.token_ids) >= request.end_len]
        for request in retired:
            self._end(request.request_id, "length")
        # With every request of the step finished by the one before, nothing waits for its tokens.
        self._in_flight = _InFlight(tokens, rows, retired) if rows else None

    def _land(self) -> list[RequestOutput]:
        """Read back the step in flight: its tokens replace their placeholders; the outputs of the requests it
        finished (a stop token, or their length)."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return []
        tokens, now = flight.tokens.wait(), time.time()
        rows, retired = flight.rows, set(flight.retired)
        for request, row in rows.items():
            request.token_ids[-1] = tokens[row]
        for request in [r for r in rows if r.first_token_time is None]:
            request.first_token_time = now
        self._totals["generated"] += len(rows)
        # The retired ones finished at the launch (their outputs last); the others, on a stop token only.
        stopped = [r for r, row in rows.items() if tokens[row] in r.stop_ids and r not in retired]
        finished = [self._settle(r, now, "stop") for r in stopped]
        # A block that a token completes was registered with the placeholder: registered again with the token.
        block_size, register = self.config.block_size, self.scheduler.block_manager.register_last_block
        for request in [r for r in rows if len(r.token_ids) % block_size == 0 and not r.is_finished]:
            register(request)
        return finished + [self._settle(r, now) for r in flight.retired]  # a stop token, else their length

    def _drop_finished(self, batch: ScheduledBatch, sampled: list[_Request], result: SampleResult) -> SampleResult:
        """Take out of `batch`, which ran, the requests that the step read after it finished, and their rows out of
        `result` (a token per request of `sampled`, in order): the step computed their K/V, not their tokens."""
        keep = [i for i, request in enumerate(sampled) if not request.is_finished]
        _remove_finished(batch)
        return SampleResult([result.token_ids[i] for i in keep], [result.logprobs[i] for i in keep], result.scores)

    def _land_now(self, request_id: str) -> RequestOutput | None:
        """Read back the step in flight before a request is taken out: its outputs wait for the next `step`, but
        `request_id`'s, which is returned."""
        self._landed += self._land()
        mine = [output for output in self._landed if output.request_id == request_id]
        if mine:
            self._landed.remove(mine[0])
            return mine[0]
        return None

    def _finish_scored(self, scoring: list[Sequence], now: float) -> list[RequestOutput]:
        """Finish the step's scoring sequences that are now computed whole (each forks its `forks` first);
        the outputs of the requests that have none left."""
        outputs = []
        for seq in scoring:
            if seq.num_computed_tokens < seq.num_tokens:
                continue
            group = seq.group  # type: ignore[attr-defined]  # `_add_group` adds only `ScoredSequence`s
            if seq.forks:  # type: ignore[attr-defined]
                self._fork(seq)  # type: ignore[arg-type]
            self._end_scored(seq, "stop")  # type: ignore[arg-type]
            group.remaining -= 1
            if group.remaining == 0:
                del self._groups[group.request_id]
                outputs.append(self._group_output(group, now))
        return outputs

    def _finish_pooled(self, seqs: list[PooledSequence], now: float) -> list[RequestOutput]:
        """The outputs of the step's embedding requests whose prompt is now computed whole, finished (their blocks
        freed at once); their vectors are read back together."""
        done = [seq for seq in seqs if seq.num_computed_tokens == seq.num_tokens]
        outputs = []
        for seq, vector in zip(done, embeddings(done) if done else []):
            self._end_pooled(seq.request_id, "stop")
            outputs.append(RequestOutput(seq.request_id, seq.prompt_token_ids, [], "", "stop",
                                         num_cached_tokens=seq.num_cached_tokens, arrival_time=seq.arrival_time,
                                         first_token_time=now, finished_time=now, embedding=vector))
        return outputs

    def _group_output(self, group: ScoreGroup, now: float) -> RequestOutput:
        """A scoring request's output; for choices, their probabilities and the most probable as the text."""
        scores = group.scores()
        output = RequestOutput(group.request_id, group.prompt_token_ids, [], "", "stop",
                               num_cached_tokens=sum(seq.num_cached_tokens for seq in group.sequences),
                               arrival_time=group.arrival_time, first_token_time=now, finished_time=now, scores=scores)
        if group.labels is not None:
            logprobs = [score.logprob for score in scores]
            best = logprobs.index(max(logprobs))
            output.text, output.token_ids = group.labels[best], list(scores[best].token_ids)
            output.choice_logprobs = dict(zip(group.labels, logprobs))
            output.choice_probabilities = dict(zip(group.labels, normalise(logprobs)))
            output.constraint_satisfied = True
        return output

    def _end(self, request_id: str, reason: str) -> _Request | None:
        """Take a request out of `requests` and finish it with `reason` (its blocks freed at once); the engine's
        counts and the runner's row follow. None if it is not there. The only caller of `scheduler.finish` for a
        `_Request` (`_end_scored` finishes scoring sequences): a request still in `requests` is never finished."""
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.runner.release(request)
            self._num_changing_rows -= request.row_changes
            self._num_constrained -= request.constraint is not None
            self.scheduler.finish(request, reason)
        return request

    def _note_tokens(self, requests: list[_Request], result: SampleResult, now: float) -> list[_Request]:
        """Record the step's first-token times and logprobs; return the requests that may have finished
        (see `_Request.plain`: only these need `_finish_reason`)."""
        if result.logprobs.count(None) != len(result.logprobs):
            for request, logprobs in zip(requests, result.logprobs):
                if logprobs is not None:
                    request.logprobs.append(logprobs)
        for request in [r for r in requests if r.first_token_time is None]:
            request.first_token_time = now
        return [r for r, token in zip(requests, result.token_ids)
                if not r.plain or token in r.stop_ids or len(r.token_ids) >= r.end_len]

    def _execute(self, batch: ScheduledBatch,
                 sampling: list[_Request]) -> tuple[SampleResult, list[tuple[Sequence, InvalidRequestError]]]:
        """Run the batch (`sampling`: the requests of its sampling sequences, in order); if sampling fails,
        find the requests it fails for by running each one alone.

        Rerunning is safe: nothing was updated yet. Returns the result for the batch without the failed
        requests, and those requests.
        """
        rows = self._sampling_rows(sampling)
        try:
            return self.runner.execute(batch, rows, self._feed(batch)), []
        except Exception as exc:
            if not _raised_in_sampler(exc):
                raise
        # Each request alone: a request samples the same token alone as in any batch, and its forward pass
        # writes the same K/V to the same slots, so the results of the ones that pass are this step's.
        failed, tokens, logprobs = [], [], []
        for seq, count, samples in list(zip(batch.seqs, batch.num_new_tokens, batch.sample_mask)):
            alone = ScheduledBatch(count)
            alone.add(seq, count)
            try:
                result = self.runner.execute(alone, self._sampling_rows([seq] if samples else []), self._feed(alone))
            except Exception as exc:
                if not _raised_in_sampler(exc):
                    raise
                failed.append((seq, InvalidRequestError("sampling", f"sampling failed for this request: {exc!r}")))
                continue
            tokens += result.token_ids
            logprobs += result.logprobs
        for seq, _ in failed:
            batch.remove(seq)
        return SampleResult(tokens, logprobs), failed

    def _fail(self, request: _Request, error: InvalidRequestError, now: float) -> RequestOutput:
        """Finish one request with `finish_reason="error"`, releasing its blocks."""
        self._end(request.request_id, "error")
        return RequestOutput(request.request_id, request.prompt_token_ids, request.output_token_ids, "", "error",
                             arrival_time=request.arrival_time, finished_time=now, error=str(error))

    def _advance_grammars(self, grown: list[_Request]) -> None:
        if not self._num_constrained:
            return
        constrained = [r for r in grown if r.constraint is not None]
        if constrained:
            advance([r.constraint for r in constrained], [r.token_ids[-1] for r in constrained])

    def _sampling_rows(self, requests: list[_Request]) -> list[SamplingRow]:
        """The requests' rows, built at admission (each shares its request's `token_ids`), brought to this step."""
        if self._num_changing_rows:
            for request in [r for r in requests if r.row_changes]:
                row = request.row
                row.num_output_tokens = len(request.token_ids) - request.num_prompt_tokens
                if request.params.min_tokens and row.num_output_tokens >= request.params.min_tokens:
                    row.suppress(request.constraint.banned_ids if request.constraint is not None else [])
        return [request.row for request in requests]

    def _finish_reason(self, request: _Request) -> str | None:
        params = request.params
        num_output_tokens = len(request.token_ids) - request.num_prompt_tokens
        # A complete grammar after which only a stop token could follow ends the sequence, min_tokens or not.
        grammar_done = request.constraint is not None and request.constraint.done
        if num_output_tokens < params.min_tokens and not grammar_done:
            return None
        if request.token_ids[-1] in request.stop_ids:
            return "stop"
        if request.stops is not None:
            text = self._decode(request)
            cut = request.stops.first_hit(text)
            if cut is not None:
                request.text = text[:cut]
                return "stop"
        if grammar_done:
            return "error" if request.constraint.error() else "stop"  # type: ignore[union-attr]
        if num_output_tokens >= params.max_tokens or len(request.token_ids) >= self.max_model_len:
            return "length"
        return None

    def _decode(self, seq: Sequence) -> str:
        return self.detokenize(seq.output_token_ids, seq.params.skip_special_tokens)

    def _output(self, request: _Request, now: float, reason: str) -> RequestOutput:
        constraint = request.constraint
        text = request.text if request.text is not None else self._decode(request)
        # an output cut by max_tokens or a stop string is not satisfied even where its text so far matches (`\d+`
        # cut at "17"): the grammar could have gone on, so the value may be a truncated one
        satisfied = None if constraint is None else constraint.completed and request.text is None and reason != "length"
        parsed, constraint_error = self._check(request) if satisfied else (None, None)
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=request.output_token_ids,
            text=text,
            finish_reason=reason,
            logprobs=self._with_tokens(request.logprobs) if request.params.logprobs is not None else None,
            num_cached_tokens=request.num_cached_tokens,
            arrival_time=request.arrival_time,
            first_token_time=request.first_token_time,
            finished_time=now,
            error=constraint.error() if constraint is not None else None,
            constraint_satisfied=satisfied and constraint_error is None,
            parsed=parsed,
            constraint_error=constraint_error,
            constraint_backend=constraint.backend if constraint is not None else None,
        )

    def _with_tokens(self, positions: list[dict]) -> list[dict]:
        """The sampler's logprobs with each token's text and bytes (`detokenize.token_texts`), so that no reader needs
        the tokenizer: `token` and `bytes` of the chosen token, and `top_tokens`, a `[token, bytes]` pair per
        `top_logprobs` entry."""
        ids = list(dict.fromkeys(i for p in positions for i in (p["token_id"], *(t for t, _ in p["top_logprobs"]))))
        texts = token_texts(self.tokenizer, self.detokenize, ids)
        return [{**p, "token": texts[p["token_id"]][0], "bytes": texts[p["token_id"]][1],
                 "top_tokens": [texts[t] for t, _ in p["top_logprobs"]]} for p in positions]

    def _check(self, request: _Request) -> tuple[Any, str | None]:
        """The final check of a grammar-complete output: its text without a trailing stop token (which
        `skip_special_tokens=False` would show), against the request's constraint in full."""
        tokens = request.output_token_ids
        if tokens and tokens[-1] in request.stop_ids:
            tokens = tokens[:-1]
        text = self.detokenize(tokens, request.params.skip_special_tokens)
        return check_completion(request.params.structured, text)  # type: ignore[arg-type]

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self._pending),  # grammar compiling counts as waiting
            kv_cache_usage=self.scheduler.block_manager.usage(),
            num_prompt_tokens=self._totals["prompt"],
            num_generated_tokens=self._totals["generated"],
            num_prefix_hit_tokens=self.scheduler.num_prefix_hit_tokens,
            num_preemptions=self._totals["preempted"],
            num_steps=self._totals["steps"],
        )


class StopMatcher:
    """Finds the earliest stop string in a request's text as it grows, searching only what is new.

    The text is decoded whole each step (a decoder may rewrite its last characters: an incomplete UTF-8
    sequence shows as U+FFFD until its next byte arrives, a clean-up may drop a space before punctuation),
    but searched only from where a stop string could start that was not there at the last search: none
    occurred in the text searched then, so a new occurrence must end past the part both texts share, i.e.
    start at most `longest - 1` characters before it. The shared part is confirmed (one C-level compare)
    before it is skipped; if the decoder rewrote more, the whole text is searched again. The result is the
    same position a search of the whole text for every stop string gives, at a cost per step of the new
    characters, not the text length times the number of stop strings.
    """

    _UNSTABLE_TAIL = 1  # characters before the trailing U+FFFDs that a decoder might still rewrite

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.longest = max(len(stop) for stop in stops)
        self.searched = ""  # the text of the last search, which holds no stop string

    def first_hit(self, text: str) -> int | None:
        """Where the earliest stop string starts in `text`, or None (then `text` becomes the searched text)."""
        stable = max(0, len(self.searched.rstrip("\ufffd")) - self._UNSTABLE_TAIL)
        start = max(0, stable - self.longest + 1) if text.startswith(self.searched[:stable]) else 0
        hits = [i for i in (text.find(stop, start) for stop in self.stops) if i >= 0]
        if hits:
            return min(hits)
        self.searched = text
        return None


def _remove_finished(batch: ScheduledBatch) -> None:
    """Take out of a batch that ran (or was launched) the sequences finished since it was planned."""
    for seq in [s for s in batch.seqs if s.is_finished]:
        batch.remove(seq)


def _raised_in_sampler(exc: BaseException) -> bool:
    """Whether `exc` came out of the sampler (a request's parameters), not the model or the device.

    Out-of-memory and device errors are the engine's wherever they surface.
    """
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError, getattr(torch, "AcceleratorError", MemoryError))):
        return False
    return any(frame.f_code.co_filename == sampler_module.__file__ for frame, _ in traceback.walk_tb(exc.__traceback__))

"""The offline API: hand it prompts, get completions. `stream` yields each one the moment it finishes."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import closing

from tqdm.auto import tqdm

from tokenmill.engine.llm_engine import LLMEngine, RequestOutput
from tokenmill.engine.pooling import EmbeddingOutput, PoolingParams
from tokenmill.engine.scoring import ScoreOutput
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams

Prompt = str | list[int]
Continuation = str | list[int]
_calls = itertools.count()


class LLM:
    """`LLM("builtin:tiny")`, a local directory written by `save_pretrained`, or a hub id; keyword options
    are `EngineConfig` fields (dtype, max_num_batched_tokens, load_format, attention_backend, ...)."""

    def __init__(self, model: str = "builtin:tiny", **options: object) -> None:
        self.engine = LLMEngine(model, **options)

    @property
    def tokenizer(self):  # noqa: ANN201 - a transformers tokenizer
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Completions in input order. A rejected prompt yields an output with finish_reason "error"."""
        prompts = _as_list(prompts)
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        for index, output in self._run(prompts, params, use_tqdm):
            outputs[index] = output
        return outputs  # type: ignore[return-value]

    def stream(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
               use_tqdm: bool = False) -> Iterator[RequestOutput]:
        """Each completion as soon as it finishes (so in finishing order; `request_id` is the input index)."""
        for _, output in self._run(_as_list(prompts), params, use_tqdm):
            yield output

    def chat(self, conversations: list[list[dict[str, str]]] | list[dict[str, str]],
             params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts: list[Prompt | InvalidRequestError] = []
        for messages in conversations:
            try:
                prompts.append(self.engine.apply_chat_template(messages))  # type: ignore[arg-type]
            except InvalidRequestError as error:
                prompts.append(error)
        return self.generate(prompts, params, use_tqdm)  # type: ignore[arg-type]

    def score(self, prompt: Prompt, continuations: Sequence[Continuation]) -> list[ScoreOutput]:
        """Each continuation's log-probability given `prompt` and whether it is the greedy one (lm-eval-harness's
        `loglikelihood`), in order, computed in one engine pass that computes the prompt once (nothing is sampled).
        A text continuation is tokenized alone (`tokenizer.encode(text, add_special_tokens=False)`) and appended to
        the prompt's tokens: put the separating space in the continuation (" Paris"), not at the prompt's end.
        Raises InvalidRequestError naming the field."""
        output = self.score_batch([(prompt, continuations)], use_tqdm=False)[0]
        if output.finish_reason == "error":
            field, _, message = (output.error or "request: failed").partition(": ")
            raise InvalidRequestError(field, message)
        return output.scores  # type: ignore[return-value]

    def score_batch(self, requests: Sequence[tuple[Prompt, Sequence[Continuation]]],
                    use_tqdm: bool = True) -> list[RequestOutput]:
        """`score` for many (prompt, continuations) pairs in one run, in input order: each output's `scores`, or
        `finish_reason == "error"` with `error` naming the field for a request that cannot be served."""
        requests = list(requests)
        prompts = [prompt for prompt, _ in requests]

        def add(request_id: str, index: int, prompt: Prompt) -> None:
            self.engine.add_score_request(request_id, prompt, list(requests[index][1]))

        outputs: list[RequestOutput | None] = [None] * len(requests)
        for index, output in self._drive(prompts, add, use_tqdm, "score"):
            outputs[index] = output
        return outputs  # type: ignore[return-value]

    def embed(self, prompts: Prompt | Sequence[Prompt], *, dimensions: int | None = None, normalize: bool | None = None,
              pooling: str | None = None, use_tqdm: bool = False) -> list[EmbeddingOutput]:
        """One embedding per prompt, in input order: each prompt prefilled (batched with the others by the token
        budget, chunked when long), nothing generated, its final hidden states (after the model's final norm) pooled.

        `pooling` ("last", "mean" or "cls") and `normalize` (L2) default to the checkpoint's sentence-transformers
        files (`modules.json`, `1_Pooling/config.json`, a Normalize module), else to last-token pooling, normalised,
        as decoder embedding models (Qwen3-Embedding, gte-Qwen2, e5-mistral) do. `dimensions` keeps the first values
        (Matryoshka, as OpenAI's `dimensions`), normalised after the cut. Raises InvalidRequestError naming the field
        (a prompt that cannot be served: "prompt", with its index)."""
        params = PoolingParams(pooling, normalize, dimensions)
        prompts = _as_list(prompts)

        def add(request_id: str, index: int, prompt: Prompt) -> None:
            self.engine.add_request(request_id, prompt, pooling=params)

        outputs: list[EmbeddingOutput | None] = [None] * len(prompts)
        with closing(self._drive(prompts, add, use_tqdm, "embed")) as finished:  # closed: the others are aborted
            for index, output in finished:
                if output.finish_reason == "error":
                    field, _, message = (output.error or "request: failed").partition(": ")
                    raise InvalidRequestError(field, f"{message} (prompt {index})")
                outputs[index] = EmbeddingOutput(output.embedding or [], output.prompt_token_ids)
        return outputs  # type: ignore[return-value]

    def _run(self, prompts: list[Prompt], params: SamplingParams | Sequence[SamplingParams] | None,
             use_tqdm: bool) -> Iterator[tuple[int, RequestOutput]]:
        params_list = _per_prompt(params, len(prompts))

        def add(request_id: str, index: int, prompt: Prompt) -> None:
            self.engine.add_request(request_id, prompt, params_list[index])

        return self._drive(prompts, add, use_tqdm, "generate")

    def _drive(self, prompts: list[Prompt], add: Callable[[str, int, Prompt], None], use_tqdm: bool,
               desc: str) -> Iterator[tuple[int, RequestOutput]]:
        """Submit each prompt with `add(request_id, index, prompt)`, step the engine until all finish, and yield
        (index, output) as each does; a prompt `add` refuses yields its error output at once."""
        prefix = f"llm{next(_calls)}-"
        index_of: dict[str, int] = {}
        for index, prompt in enumerate(prompts):
            request_id = f"{prefix}{index}"
            try:
                if isinstance(prompt, InvalidRequestError):
                    raise prompt
                add(request_id, index, prompt)
                index_of[request_id] = index
            except InvalidRequestError as error:
                try:
                    yield index, _rejected(str(index), prompt, str(error))
                except GeneratorExit:  # a consumer that stops here must not leave the requests added so far running
                    for added in index_of:
                        self.engine.abort_request(added)
                    raise
        bar = tqdm(total=len(prompts), initial=len(prompts) - len(index_of), disable=not use_tqdm,
                   desc=desc, unit="req", dynamic_ncols=True)
        start, generated = time.perf_counter(), 0
        try:
            while index_of:
                for output in self.engine.step():
                    index = index_of.pop(output.request_id)
                    output.request_id = str(index)
                    generated += len(output.token_ids)
                    bar.update(1)
                    bar.set_postfix_str(f"{generated / (time.perf_counter() - start):.1f} gen tok/s", refresh=False)
                    yield index, output
        finally:
            for request_id in index_of:  # a consumer that stops early must not leave requests running
                self.engine.abort_request(request_id)
            bar.close()


def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    return prompts


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    if not isinstance(params, Iterable) or isinstance(params, str | Mapping):
        raise TypeError(f"params: must be a SamplingParams or a list of them, one per prompt; got "
                        f"{type(params).__name__} (a dict of fields: SamplingParams(**fields))")
    params = list(params)
    if len(params) != count:
        raise ValueError(f"params: got {len(params)} SamplingParams for {count} prompts")
    wrong = next((p for p in params if not isinstance(p, SamplingParams)), None)
    if wrong is not None:
        raise TypeError(f"params: each must be a SamplingParams; got {type(wrong).__name__}")
    return params


def _rejected(request_id: str, prompt: Prompt | InvalidRequestError, error: str) -> RequestOutput:
    prompt_ids = prompt if isinstance(prompt, list) else []
    now = time.time()
    return RequestOutput(request_id, list(prompt_ids), [], "", "error", arrival_time=now, finished_time=now, error=error)

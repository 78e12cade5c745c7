"""Embeddings: a prompt prefilled, never decoded, its final hidden states pooled into one vector.

An embedding request runs as a pooling sequence (`Sequence.pooling`): a scoring sequence whose read positions yield
their final hidden states (after the model's final norm, before its head) instead of logits. Its prompt goes through
the scheduler as any other (token budget, chunked prefill, the ragged batch beside generating sequences), samples
nothing, and finishes, its blocks freed, in the step that computes its last token. The runner asks the model for the
hidden states of the step's pooled rows only (`PoolRows`): the last prompt token ("last"), every prompt token ("mean",
summed in float32 across the prompt's chunks) or the first ("cls"). "mean" and "cls" read every position, so they take
nothing from the prefix cache. A finished vector is averaged, cut to `dimensions` and L2-normalised as asked; the
step's finished vectors come back in one read.

Pooling and normalisation follow the checkpoint's sentence-transformers files (`checkpoint_pooling`), else last-token
pooling, normalised: the recipe of decoder embedding models (Qwen3-Embedding, gte-Qwen2, e5-mistral).
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from tokenmill.engine.tiny import TINY_NAME
from tokenmill.engine.transfer import read_back, to_device
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.scheduler import ScheduledBatch
from tokenmill.scheduler.sequence import Sequence

POOLING_MODES = ("last", "mean", "cls")
#: sentence-transformers' Pooling config keys for the modes above
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_ST_MODULES = "sentence_transformers.models."
#: The parameters of every pooling sequence: none is read (a pooling sequence samples nothing).
NO_SAMPLING = SamplingParams(max_tokens=1)


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request (`LLMEngine.add_request(..., pooling=...)`); None leaves the choice to the checkpoint.

    `pooling`: "last" (the last prompt token's final hidden state), "mean" (their average over the prompt) or "cls"
    (the first token's). `normalize`: L2-normalise the vector. `dimensions`: keep its first `dimensions` values
    (Matryoshka, as OpenAI's `dimensions`), normalised after the cut when `normalize`. Raises InvalidRequestError
    naming the field."""

    pooling: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling is not None and self.pooling not in POOLING_MODES:
            raise InvalidRequestError("pooling", f"must be one of {', '.join(POOLING_MODES)}, got {self.pooling!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequestError("normalize", f"must be true or false, got {self.normalize!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise InvalidRequestError("dimensions", f"must be an integer >= 1, got {self.dimensions!r}")


@dataclass(frozen=True)
class CheckpointPooling:
    """What a checkpoint asks of its embeddings: `pooling` (None: a mode of its own we lack, `problem` says which, so
    a request must name one) and `normalize`; `refused`: why no request can follow it (a module we do not run)."""

    pooling: str | None = "last"
    normalize: bool = True
    problem: str | None = None
    refused: str | None = None

    def resolve(self, params: PoolingParams, hidden_size: int | None) -> tuple[str, bool, int | None]:
        """(pooling, normalize, dimensions) of a request: its own choices over the checkpoint's."""
        if self.refused is not None:
            raise InvalidRequestError("model", self.refused)
        pooling = params.pooling or self.pooling
        if pooling is None:
            raise InvalidRequestError("pooling", f"{self.problem}: name one of {', '.join(POOLING_MODES)}")
        if params.dimensions is not None and hidden_size is not None and params.dimensions > hidden_size:
            raise InvalidRequestError("dimensions", f"{params.dimensions} exceeds the model's {hidden_size} dimensions")
        return pooling, self.normalize if params.normalize is None else params.normalize, params.dimensions


def checkpoint_pooling(model: str) -> CheckpointPooling:
    """The pooling of `model`'s sentence-transformers files (`modules.json`, its Pooling module's `config.json`, a
    Normalize module for `normalize`); without them, last-token pooling, normalised."""
    try:
        return _from_modules(model, _read_json(model, "modules.json"))
    except (OSError, ValueError, TypeError, AttributeError) as exc:  # unreadable or not sentence-transformers' shape
        return CheckpointPooling(refused=f"its sentence-transformers config cannot be read ({exc!r})")


def _from_modules(model: str, modules: object) -> CheckpointPooling:
    if modules is None:
        return CheckpointPooling()
    pooling, normalize, problem = None, False, "its sentence-transformers config names no pooling"
    for module in modules:  # type: ignore[attr-defined]
        kind, path = str(module.get("type", "")), str(module.get("path", ""))
        if kind == _ST_MODULES + "Normalize":
            normalize = True
        elif kind == _ST_MODULES + "Pooling":
            config = _read_json(model, f"{path}/config.json") or {}
            chosen = sorted(key for key, value in config.items() if key.startswith("pooling_mode_") and value is True)
            if len(chosen) == 1 and chosen[0] in _ST_MODES:
                pooling, problem = _ST_MODES[chosen[0]], None
            else:
                problem = f"its sentence-transformers pooling ({', '.join(chosen) or 'none'}) is not supported"
        elif kind != _ST_MODULES + "Transformer":
            return CheckpointPooling(refused=f"its sentence-transformers module {path or kind!r} ({kind}) is not "
                                             "supported: embeddings run Transformer, Pooling and Normalize modules")
    return CheckpointPooling(pooling, normalize, problem)


def _read_json(model: str, name: str) -> object:
    """A JSON file of the checkpoint (a local directory, or a hub id as transformers finds its files), or None if it
    has none."""
    if model == TINY_NAME:
        return None
    if os.path.isdir(model):
        path = os.path.join(model, name)
    else:
        from transformers.utils import cached_file

        try:
            path = cached_file(model, name, _raise_exceptions_for_missing_entries=False,
                               _raise_exceptions_for_connection_errors=False)
        except OSError:
            path = None
    if path is None or not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as file:
        return json.load(file)


@dataclass(eq=False)
class PooledSequence(Sequence):
    """An embedding request as the engine holds it: `pooled`, the sum of its pooled rows' hidden states so far
    (float32, on the device), filled in as the steps that compute them run."""

    normalize: bool = True
    dimensions: int | None = None
    arrival_time: float = 0.0
    pooled: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.num_scored_tokens = 1 if self.pooling == "last" else self.num_tokens  # the positions it must compute

    def vector(self) -> torch.Tensor:
        """The finished embedding on the device (no sync): averaged for "mean", cut to `dimensions`, normalised."""
        vector = self.pooled / self.num_tokens if self.pooling == "mean" else self.pooled
        if self.dimensions is not None:
            vector = vector[: self.dimensions]
        return F.normalize(vector, dim=0) if self.normalize else vector


@dataclass
class PoolRows:
    """The pooled positions a step computes: `rows` (their flat batch rows), `segments` (per row, the index in
    `parts` of its sequence), and `parts`: per sequence, whether its rows start its sum anew (else they add to it)."""

    rows: list[int] = field(default_factory=list)
    segments: list[int] = field(default_factory=list)
    parts: list[tuple[PooledSequence, bool]] = field(default_factory=list)

    def record(self, hidden: torch.Tensor) -> None:
        """Add each sequence's rows of `hidden` (`[len(rows), hidden]`, the model's) into its `pooled`; no sync."""
        sums = hidden.float()
        if len(self.rows) > len(self.parts):  # some sequence pools several rows ("mean")
            index = to_device(self.segments, torch.int64, sums.device)
            sums = sums.new_zeros(len(self.parts), sums.shape[1]).index_add_(0, index, sums)
        for i, (seq, fresh) in enumerate(self.parts):
            seq.pooled = sums[i] if fresh else seq.pooled + sums[i]


def pool_rows(batch: ScheduledBatch) -> PoolRows:
    """The pooled positions of `batch` (planned, not yet run); a preempted "mean" sequence restarts at position 0,
    where its sum starts anew. Decodes lead the batch and never pool, so the walk starts after them."""
    out = PoolRows()
    offset = head = batch.num_decodes
    for seq, count in zip(batch.seqs[head:], batch.num_new_tokens[head:]):
        if seq.pooling is not None:
            start, end = seq.num_computed_tokens, offset + count
            if seq.pooling == "mean":
                rows = range(offset, end)
            elif seq.pooling == "last":
                rows = range(end - 1, end) if start + count == seq.num_tokens else range(0)
            else:
                rows = range(offset, offset + 1) if start == 0 else range(0)
            if rows:
                out.segments += [len(out.parts)] * len(rows)
                out.rows += rows
                out.parts.append((seq, seq.pooling != "mean" or start == 0))  # type: ignore[arg-type]  # the engine's
        offset += count
    return out


def embeddings(seqs: list[PooledSequence]) -> list[list[float]]:
    """The finished vectors of `seqs` (each computed whole), in order, in one read from the device."""
    vectors = [seq.vector() for seq in seqs]
    flat = read_back(torch.cat(vectors))
    out, at = [], 0
    for vector in vectors:
        out.append(flat[at : at + len(vector)])
        at += len(vector)
    return out


def encode_base64(vector: list[float] | np.ndarray | torch.Tensor) -> str:
    """`vector` as OpenAI's `encoding_format="base64"` sends it: little-endian float32 bytes, base64."""
    if isinstance(vector, torch.Tensor):
        vector = vector.detach().cpu().numpy()
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


@dataclass
class EmbeddingOutput:
    """One prompt's embedding (`LLM.embed`): `embedding`, its vector; `prompt_token_ids`, the tokens it pooled."""

    embedding: list[float]
    prompt_token_ids: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

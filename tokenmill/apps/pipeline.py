"""The part `annotate` and `batch` share: compute what the checkpoint lacks, with progress and a summary.

A run makes two streaming passes over its input. Pass 1 turns each row into units, skips the units whose key
is in the checkpoint (`reused`) or already computed or in flight in this run (`deduplicated`), and feeds the
rest to a runner; every outcome goes into the checkpoint as it arrives. Pass 2 (in `annotate`/`batch`) reads
the input again and writes the output from the checkpoint, in input order. Neither pass holds more than a
window of rows, so memory does not grow with the dataset.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from tokenmill.apps.options import RunOptions
from tokenmill.apps.runners import Unit
from tokenmill.apps.store import INTERRUPTED, Checkpoint, Outcome
from tokenmill.sampling_params import CONSTRAINT_CODES


@dataclass
class Summary:
    """What a run did. `failed` rows have their error in the output; `failed_ids` shows the first few."""

    rows: int = 0
    ok: int = 0
    failed: int = 0
    incomplete: int = 0  # of the failed: constrained outputs cut inside their constraint (or failing its check)
    reused: int = 0
    deduplicated: int = 0
    computed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefix_hit_rate: float | None = None
    wall_s: float = 0.0
    output: str = ""
    errors_output: str | None = None
    failed_ids: list[str] = field(default_factory=list)

    def count_row(self, row_id: Any, error: str | None) -> None:
        self.rows += 1
        if error is None:
            self.ok += 1
        else:
            self.failed += 1
            self.incomplete += error.startswith(CONSTRAINT_CODES)
            if len(self.failed_ids) < 5:
                self.failed_ids.append(f"{row_id}: {error[:120]}")

    def table(self) -> Any:
        """The summary as a rich table. Row ids, error texts and the output name are data, not rich markup:
        escaped, so an id like `[/nope]` is shown as written instead of breaking the table."""
        from rich.markup import escape
        from rich.table import Table

        table = Table(title=f"tokenmill: {escape(self.output)}", show_header=False)
        rate = (f"{self.prefix_hit_rate:.1%}" if self.prefix_hit_rate is not None else "n/a (nothing computed)"
                if not self.computed else "n/a (see the workers' metrics)")
        for name, value in [
            ("rows ok", self.ok), ("rows failed", self.failed),
            ("of them cut inside their constraint (raise --max-tokens)", self.incomplete),
            ("reused from checkpoint", self.reused),
            ("deduplicated (computed once)", self.deduplicated), ("computed now", self.computed),
            ("prompt tokens (computed now)", self.prompt_tokens), ("completion tokens (computed now)", self.completion_tokens),
            ("prefix-cache hit rate", rate), ("wall time", f"{self.wall_s:.2f} s"),
            ("throughput", f"{self.rows / max(self.wall_s, 1e-9):.1f} rows/s, "
                           f"{self.completion_tokens / max(self.wall_s, 1e-9):.1f} generated tok/s"),
        ]:
            table.add_row(name, str(value))
        for line in self.failed_ids:
            table.add_row("failed", escape(line))
        return table

    def print(self) -> None:
        from rich.console import Console

        Console(file=sys.stderr).print(self.table())

    def finish(self, started: float, quiet: bool) -> Summary:
        """This run's summary, with its wall time since `started` (`time.perf_counter()`); printed unless `quiet`."""
        self.wall_s = time.perf_counter() - started
        if not quiet:
            self.print()
        return self


class Progress:
    """A live bar: rows done / total, generated tokens per second, ETA (tqdm's). Off with `quiet`."""

    def __init__(self, total: int, what: str, quiet: bool) -> None:
        self.bar = tqdm(total=total, desc=what, unit="row", disable=quiet, dynamic_ncols=True, file=sys.stderr)
        self.start = time.perf_counter()
        self.tokens = 0
        self.rows = 0.0  # a unit may be a share of a row (an OpenAI request with n > 1): the bar moves by whole rows

    def advance(self, rows: float, tokens: int = 0) -> None:
        self.tokens += tokens
        whole = int(self.rows + rows + 1e-9) - int(self.rows + 1e-9)
        self.rows += rows
        if whole:
            self.bar.update(whole)
        if tokens:
            self.bar.set_postfix_str(f"{self.tokens / (time.perf_counter() - self.start):.1f} gen tok/s", refresh=False)

    def close(self) -> None:
        self.bar.close()


def compute(rows: Iterable[list[Unit]], checkpoint: Checkpoint, runner: Any, progress: Progress, summary: Summary,
            retry_failed: bool, retry_cancelled: bool = False) -> None:
    """Pass 1. Each item of `rows` is one row's units (empty when the row failed before any unit, e.g. its
    template did not render); `Unit.weight` is the share of a row a unit stands for.

    On Ctrl-C every unit in flight is marked interrupted in the checkpoint (the same command computes it again, under
    a new job id), then the runner is asked what became of them (`interrupted`: a queue run cancels them, unless
    detached): those that finished meanwhile are checkpointed as finished, before the interrupt goes on."""
    inflight: set[str] = set()

    def record(unit: Unit, outcome: Outcome) -> None:
        checkpoint.put(unit.key, outcome)
        inflight.discard(unit.key)
        summary.computed += 1
        summary.prompt_tokens += outcome.prompt_tokens
        summary.completion_tokens += outcome.completion_tokens
        progress.advance(unit.weight, outcome.completion_tokens)

    fresh = _fresh_units(rows, checkpoint, inflight, progress, summary, retry_failed, retry_cancelled)
    try:
        for unit, outcome in runner.run(fresh):
            record(unit, outcome)
    except KeyboardInterrupt:
        if not getattr(runner, "detach", False):  # detached, they go on running: the next run collects them
            for key in inflight:
                checkpoint.put(key, Outcome.failed(INTERRUPTED))
            print(f"tokenmill: interrupted with {len(inflight)} rows in flight: the same command computes them again "
                  "and the rows not reached, and reuses every finished one", file=sys.stderr)
        for unit, outcome in getattr(runner, "interrupted", tuple)():
            if not outcome.cancelled:  # finished before the cancel reached it
                record(unit, outcome)
        raise
    finally:
        checkpoint.flush()


def default_state_dir(output: str) -> str:
    """Next to a local output; for an S3 output, under ~/.cache/tokenmill (one directory per output URI)."""
    if output.startswith("s3://"):
        name = hashlib.sha256(output.encode()).hexdigest()[:16]
        return os.path.join(os.path.expanduser("~/.cache/tokenmill/state"), name)
    return os.path.abspath(output) + ".tokenmill-state"


def open_checkpoint(options: RunOptions, output: str) -> Checkpoint:
    """The checkpoint of the run writing `output`: in `options.state_dir`, else `default_state_dir(output)`."""
    return Checkpoint(os.path.join(options.state_dir or default_state_dir(output), "checkpoint.sqlite"),
                      options.checkpoint_interval)


def compute_all(what: str, total: int, rows: Iterable[list[Unit]], checkpoint: Checkpoint, runner: Any,
                summary: Summary, options: RunOptions) -> None:
    """Pass 1 (`compute`) of `total` rows under a progress bar named `what` (none with `options.quiet`), retrying
    as `options` say; then the runner's prefix-cache hit rate into `summary`."""
    progress = Progress(total, what, options.quiet)
    try:
        compute(rows, checkpoint, runner, progress, summary, options.retry_failed, options.retry_cancelled)
    finally:
        progress.close()
    summary.prefix_hit_rate = runner.prefix_hit_rate()


def _retried(outcome: Outcome, retry_failed: bool, retry_cancelled: bool) -> bool:
    if outcome.ok:
        return False
    if outcome.interrupted:
        return True
    return retry_cancelled if outcome.cancelled else retry_failed


def _fresh_units(rows: Iterable[list[Unit]], checkpoint: Checkpoint, inflight: set[str], progress: Progress,
                 summary: Summary, retry_failed: bool, retry_cancelled: bool) -> Iterator[Unit]:
    for units in rows:
        if not units:
            progress.advance(1)
        for unit in units:
            if unit.key in inflight:
                summary.deduplicated += 1
                progress.advance(unit.weight)
                continue
            found = checkpoint.get(unit.key)
            retry = found is not None and found[1] and _retried(found[0], retry_failed, retry_cancelled)
            if found is not None and not retry:
                if found[1]:
                    summary.reused += 1
                else:
                    summary.deduplicated += 1
                progress.advance(unit.weight)
                continue
            # a retried job needs a new queue id: the failed result stays stored under the old one
            unit.job_id = f"{unit.key}.{checkpoint.run[:8]}" if retry else unit.key
            inflight.add(unit.key)
            yield unit


def stored(checkpoint: Checkpoint, key: str) -> Outcome:
    """A unit's outcome for pass 2 (always there after pass 1, unless the checkpoint was tampered with)."""
    found = checkpoint.get(key)
    return found[0] if found is not None else Outcome.failed("internal: no result in the checkpoint for this row")

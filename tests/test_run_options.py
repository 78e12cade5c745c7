"""`RunOptions`: the one value `annotate`, `batch` and their CLI build from the options they share, and what reaches
the runner. The runner is replaced by one that records its options and stops the run (no model loads)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.apps import annotate as annotate_module
from tokenmill.apps import batch as batch_module
from tokenmill.apps.annotate import annotate
from tokenmill.apps.batch import batch
from tokenmill.apps.cli import EXIT_INTERRUPTED, options_from
from tokenmill.apps.datasets import MAX_ROW_BYTES
from tokenmill.apps.options import RunOptions, flag_fields, require_model
from tokenmill.apps.runners import make_runner
from tokenmill.cli import build_parser, main
from tokenmill.errors import InvalidRequestError

#: Every run option away from its default (but `llm`: a loaded engine).
OPTIONS = dict(model="builtin:tiny", queue="q", engine_options={"max_num_seqs": 2}, checkpoint_interval=0.5,
               retry_failed=True, retry_cancelled=True, detach=True, s3_endpoint_url="http://127.0.0.1:1", window=8,
               rows_per_message=4, max_row_bytes=4096, input_compression="none", quiet=True)
FLAGS = ["--model", "builtin:tiny", "--queue", "q", "--max-num-seqs", "2", "--checkpoint-interval", "0.5",
         "--retry-failed", "--retry-cancelled", "--detach", "--s3-endpoint-url", "http://127.0.0.1:1", "--window", "8",
         "--rows-per-message", "4", "--max-row-bytes", "4096", "--input-compression", "none", "--quiet"]


class Stop(Exception):
    """Raised by the recording runner: the run stops once its options are known."""


@pytest.fixture
def reached(monkeypatch: pytest.MonkeyPatch) -> list[RunOptions]:
    """The options each run hands `make_runner`, in order; the run then stops with `Stop`."""
    seen: list[RunOptions] = []

    def record(options: RunOptions, run: str) -> None:
        seen.append(options)
        raise Stop

    for module in (annotate_module, batch_module):
        monkeypatch.setattr(module, "make_runner", record)
    return seen


@pytest.fixture
def inputs(tmp_path: Path) -> tuple[str, str]:
    """A dataset for annotate and a batch input file, one row each."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"text": "hello"}) + "\n")
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                    "body": {"prompt": "hello", "max_tokens": 2}}) + "\n")
    return str(rows), str(requests)


def test_annotate_and_batch_given_the_same_keywords_hand_the_runner_equal_options(
        reached: list[RunOptions], inputs: tuple[str, str], tmp_path: Path) -> None:
    state = {"state_dir": str(tmp_path / "state")}
    with pytest.raises(Stop):
        annotate(inputs[0], str(tmp_path / "out.jsonl"), "{{ text }}", **OPTIONS, **state)
    with pytest.raises(Stop):
        batch(inputs[1], str(tmp_path / "results.jsonl"), **OPTIONS, **state)
    assert reached == [RunOptions(**OPTIONS, **state)] * 2


def test_options_given_as_one_value_reach_the_runner_as_given(
        reached: list[RunOptions], inputs: tuple[str, str], tmp_path: Path) -> None:
    options = RunOptions(**OPTIONS, state_dir=str(tmp_path / "state"))
    with pytest.raises(Stop):
        annotate(inputs[0], str(tmp_path / "out.jsonl"), "{{ text }}", options=options)
    with pytest.raises(Stop):
        batch(inputs[1], str(tmp_path / "results.jsonl"), options=options)
    assert reached[0] is options and reached[1] is options


def test_options_and_run_keywords_at_once_are_refused(reached: list[RunOptions], inputs: tuple[str, str],
                                                      tmp_path: Path) -> None:
    for run in (lambda: annotate(inputs[0], str(tmp_path / "out.jsonl"), "{{ text }}", options=RunOptions(),
                                 window=8),
                lambda: batch(inputs[1], str(tmp_path / "results.jsonl"), options=RunOptions(), quiet=True)):
        with pytest.raises(InvalidRequestError) as caught:
            run()
        assert caught.value.field == "options"
    assert reached == []


def test_a_run_with_no_model_and_no_broker_is_refused_up_front_in_one_message(
        reached: list[RunOptions], inputs: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's options, `annotate`, `batch` and `make_runner` refuse it alike (`require_model`): field "model", one
    message naming the fix, before a checkpoint is opened or a runner made. A broker, or a loaded `llm`, needs none."""
    monkeypatch.delenv("TOKENMILL_MODEL", raising=False)
    state = tmp_path / "state"
    flags = build_parser().parse_args(["batch", "-i", inputs[1], "-o", str(tmp_path / "results.jsonl")])
    refused = []
    for attempt in (lambda: options_from(flags),
                    lambda: annotate(inputs[0], str(tmp_path / "out.jsonl"), "{{ text }}", state_dir=str(state)),
                    lambda: batch(inputs[1], str(tmp_path / "results.jsonl"), state_dir=str(state)),
                    lambda: make_runner(RunOptions(), "run")):
        with pytest.raises(InvalidRequestError) as caught:
            attempt()
        refused.append((caught.value.field, caught.value.message))
    assert refused == [refused[0]] * 4 and refused[0][0] == "model", refused
    assert "--model" in refused[0][1] and "--broker" in refused[0][1]
    assert reached == [] and not state.exists()
    require_model(RunOptions(broker="redis://127.0.0.1:1/0"))  # the workers' model runs
    require_model(RunOptions(llm=object()))


def test_the_keywords_default_as_run_options_do() -> None:
    """`annotate` and `batch` keep their run keywords for callers; their defaults are `RunOptions`' own."""
    defaults = {spec.name: spec.default for spec in dataclasses.fields(RunOptions)}
    assert defaults["max_row_bytes"] == MAX_ROW_BYTES  # options.py stays free of pyarrow, so it spells it out
    for function in (annotate, batch):
        parameters = inspect.signature(function).parameters
        assert {name: parameters[name].default for name in defaults} == defaults, function.__name__


def test_both_commands_build_the_same_options_from_the_same_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENMILL_MODEL", raising=False)
    parser = build_parser()
    annotated = options_from(parser.parse_args(["annotate", "in.jsonl", "-o", "out.jsonl", "--template", "t", *FLAGS]))
    batched = options_from(parser.parse_args(["batch", "-i", "in.jsonl", "-o", "out.jsonl", *FLAGS]))
    assert annotated == batched == RunOptions(**OPTIONS)
    plain = options_from(parser.parse_args(["batch", "-i", "in.jsonl", "-o", "out.jsonl", "--model", "m"]))
    assert plain == RunOptions(model="m", engine_options={})  # every flag left out is the field's default
    assert {spec.name for spec in flag_fields()} == {spec.name for spec in dataclasses.fields(RunOptions)} - {
        "llm", "engine_options"}


def test_the_cli_hands_the_runner_the_options_of_its_flags(reached: list[RunOptions], inputs: tuple[str, str],
                                                           tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both subcommands, run: one `RunOptions` from the flags reaches the runner (a Ctrl-C there exits 130)."""
    monkeypatch.delenv("TOKENMILL_MODEL", raising=False)

    def interrupt(options: RunOptions, run: str) -> None:
        reached.append(options)
        raise KeyboardInterrupt

    for module in (annotate_module, batch_module):
        monkeypatch.setattr(module, "make_runner", interrupt)
    state = ["--state-dir", str(tmp_path / "state")]
    assert main(["annotate", inputs[0], "-o", str(tmp_path / "out.jsonl"), "--template", "{{ text }}", *FLAGS,
                 *state]) == EXIT_INTERRUPTED
    assert main(["batch", "-i", inputs[1], "-o", str(tmp_path / "results.jsonl"), *FLAGS, *state]) == EXIT_INTERRUPTED
    assert reached == [RunOptions(**OPTIONS, state_dir=str(tmp_path / "state"))] * 2


def test_the_parser_builds_without_the_annotate_extra() -> None:
    """The CLI reads `RunOptions` while building every subcommand's parser (`tokenmill worker`'s too): no pyarrow."""
    code = ("import sys\nsys.modules['pyarrow'] = None\nfrom tokenmill.cli import build_parser\nbuild_parser()\n"
            "import tokenmill.apps.options\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]

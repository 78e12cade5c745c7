"""Outputs and options an `annotate` or `batch` run cannot use are refused before any work, in one line with exit
status 2, and nothing is written or replaced: each case here once lost data, wrote something else than asked or
ended in a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from annotate_helpers import write_jsonl

from tokenmill.cli import main

TEMPLATE = ["--template", "Say: {{ text }}", "--model", "builtin:tiny", "--quiet"]


def _refused(capsys: pytest.CaptureFixture, *args: str) -> str:
    code = main(list(args))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, (code, err)
    return err


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}, {"text": "b"}])


@pytest.mark.parametrize(("flags", "said"), [
    (["--column", "error"], "--column: 'error' is the name of another result column"),
    (["--column", "logprobs", "--logprobs", "2"], "--column: 'logprobs' is the name of another result column"),
    (["--broker", "localhost:6379"], "--broker: must be a Redis URL such as redis://localhost:6379/0"),
    (["--window", "-5"], "--window: must be an integer >= 1, got -5"),
    (["--window", "0"], "--window: must be an integer >= 1, got 0"),
    (["--rows-per-message", "0"], "--rows-per-message: must be an integer >= 1"),
    (["--checkpoint-interval", "-1"], "--checkpoint-interval: must be a number of seconds >= 0"),
])
def test_annotate_options_that_cannot_work(tmp_path: Path, src: Path, capsys: pytest.CaptureFixture, flags: list[str],
                                           said: str) -> None:
    err = _refused(capsys, "annotate", str(src), "-o", str(tmp_path / "out.jsonl"), *TEMPLATE, *flags)
    assert said in err
    assert not (tmp_path / "out.jsonl").exists()


def test_annotate_outputs_that_cannot_be_written_as_named(tmp_path: Path, src: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    before = src.read_bytes()
    assert "is the input" in _refused(capsys, "annotate", str(src), "-o", str(src), *TEMPLATE)
    assert src.read_bytes() == before
    assert "outputs are written uncompressed; name it without .gz" in _refused(
        capsys, "annotate", str(src), "-o", str(tmp_path / "out.jsonl.gz"), *TEMPLATE)
    (tmp_path / "adir.jsonl").mkdir()
    assert "is a directory" in _refused(capsys, "annotate", str(src), "-o", str(tmp_path / "adir.jsonl"), *TEMPLATE)
    (tmp_path / "afile").write_text("x")
    assert "afile is a file, not a directory" in _refused(
        capsys, "annotate", str(src), "-o", str(tmp_path / "afile" / "sub" / "out.jsonl"), *TEMPLATE)
    assert "checkpoint" in _refused(capsys, "annotate", str(src), "-o", str(tmp_path / "out.jsonl"), "--state-dir",
                                    str(tmp_path / "afile"), *TEMPLATE)
    assert (tmp_path / "afile").read_text() == "x"
    assert not any(path.name.startswith("out") for path in tmp_path.iterdir())


def test_batch_outputs_that_cannot_be_written_as_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps(line) + "\n")
    run = ["batch", "-i", str(requests), "--model", "builtin:tiny", "--quiet"]
    assert "errors" in _refused(capsys, *run, "-o", str(tmp_path / "r.jsonl"), "--errors", str(tmp_path / "r.jsonl"))
    assert "batch results are JSONL" in _refused(capsys, *run, "-o", str(tmp_path / "r.parquet"))
    assert "outputs are written uncompressed" in _refused(capsys, *run, "-o", str(tmp_path / "r.jsonl.gz"))
    assert "is the input" in _refused(capsys, *run, "-o", str(requests))
    assert [path.name for path in tmp_path.iterdir()] == ["requests.jsonl"]


@pytest.mark.parametrize(("flags", "said"), [
    (["--choice", ",a"], "tokenmill annotate: --choice (choice[0]): must be a non-empty string"),
    (["--probabilities"], "tokenmill annotate: --probabilities (choice_probabilities): requires choice"),
    (["--input-compression", "zip"], "tokenmill annotate: argument --input-compression: invalid choice: 'zip'"),
    (["--bogus", "1"], "tokenmill annotate: unrecognized arguments: --bogus 1 (see tokenmill annotate --help)"),
])
def test_a_refused_flag_is_named_in_one_line(tmp_path: Path, src: Path, capsys: pytest.CaptureFixture,
                                             flags: list[str], said: str) -> None:
    """argparse printed its whole usage first (some 40 lines), and an option's error named the request field."""
    try:
        err = _refused(capsys, "annotate", str(src), "-o", str(tmp_path / "out.jsonl"), *TEMPLATE, *flags)
    except SystemExit as exit:  # argparse's own refusals exit
        err = capsys.readouterr().err
        assert exit.code == 2 and err.count("\n") == 1, err
    assert err.startswith(said), err

"""`tokenmill annotate` in embedded mode: real files in tmp dirs, the built-in tiny model, real subprocesses
for kill -9 and the CLI. (Distributed mode and S3: tests/service/test_annotate_distributed.py.)"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from annotate_helpers import ENGINE, REPO, checkpointed, cli, read_jsonl, wait_until, write_jsonl

from tokenmill.apps.annotate import annotate
from tokenmill.apps.datasets import DatasetError
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams

STRUCTURED = {f.name for f in dataclasses.fields(SamplingParams)} >= {"json_schema", "choice", "regex"}


@pytest.fixture(scope="module")
def llm():
    import torch

    torch.set_num_threads(1)
    from tokenmill import LLM

    return LLM("builtin:tiny", **ENGINE)


def rows(count: int, distinct: int | None = None) -> list[dict]:
    distinct = distinct or count
    return [{"id": f"r{i}", "text": f"item number {i % distinct}", "n": i} for i in range(count)]


def run(llm, src: Path, out: Path, template: str = "Say: {{ text }}", **kw):
    kw.setdefault("max_tokens", 6)
    return annotate(str(src), str(out), template, llm=llm, quiet=True, **kw)


def test_jsonl_rows_keep_order_and_columns_and_duplicates_are_computed_once(llm, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", rows(40, distinct=10))
    summary = run(llm, src, tmp_path / "out.jsonl")
    out = read_jsonl(tmp_path / "out.jsonl")
    assert [r["id"] for r in out] == [f"r{i}" for i in range(40)]
    assert all(r["text"] == f"item number {i % 10}" and r["n"] == i for i, r in enumerate(out))
    assert set(out[0]) == {"id", "text", "n", "annotation", "parsed", "finish_reason", "prompt_tokens", "completion_tokens", "error"}
    assert all(r["error"] is None and r["finish_reason"] in ("stop", "length") and r["prompt_tokens"] > 0 for r in out)
    assert (summary.rows, summary.ok, summary.failed, summary.computed, summary.deduplicated) == (40, 40, 0, 10, 30)
    for i in range(10, 40):  # duplicates share the one completion
        assert out[i]["annotation"] == out[i % 10]["annotation"]
    direct = llm.generate([f"Say: item number {i}" for i in range(10)], SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    assert [r["annotation"] for r in out[:10]] == [o.text for o in direct]
    assert summary.completion_tokens == sum(len(o.token_ids) for o in direct)


def test_parquet_shards_and_csv_inputs_give_the_same_parquet_output(llm, tmp_path: Path) -> None:
    table = pa.Table.from_pylist(rows(12))
    shards = tmp_path / "shards"
    shards.mkdir()
    pq.write_table(table.slice(0, 5), shards / "part-0.parquet")
    pq.write_table(table.slice(5), shards / "part-1.parquet")
    pacsv.write_csv(table, tmp_path / "in.csv")
    run(llm, shards, tmp_path / "a.parquet")
    run(llm, tmp_path / "in.csv", tmp_path / "b.parquet", state_dir=str(tmp_path / "state-b"))
    run(llm, str(shards / "*.parquet"), tmp_path / "c.parquet", state_dir=str(tmp_path / "state-c"))
    a, b, c = (pq.read_table(tmp_path / f"{x}.parquet") for x in "abc")
    assert a.column("id").to_pylist() == [f"r{i}" for i in range(12)]
    assert a.equals(c)
    as_text = a.set_column(a.schema.get_field_index("n"), "n", a.column("n").cast(pa.string()))
    assert as_text.equals(b)  # the same rows and completions; a CSV cell is its text
    assert a.column("annotation").null_count == 0


def test_parquet_schema_is_the_same_whether_rows_fail_or_not(llm, tmp_path: Path) -> None:
    data = [{"id": "a", "text": "fine"}, {"id": "b", "text": None}, {"id": "c", "text": "x" * 5000}]
    src = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(data), src)
    pq.write_table(pa.Table.from_pylist(data[:1]), tmp_path / "ok.parquet")
    mixed = run(llm, src, tmp_path / "mixed.parquet")
    run(llm, tmp_path / "ok.parquet", tmp_path / "allok.parquet")
    run(llm, tmp_path / "ok.parquet", tmp_path / "allbad.parquet", template="{{ text.nope }}")  # every row fails
    schemas = [pq.read_schema(tmp_path / f"{name}.parquet") for name in ("mixed", "allok", "allbad")]
    assert schemas[0] == schemas[1] == schemas[2]
    assert schemas[0].field("error").type == pa.string() and schemas[0].field("error").nullable
    assert schemas[0].field("prompt_tokens").type == pa.int64()
    out = pq.read_table(tmp_path / "mixed.parquet").to_pylist()
    assert out[0]["error"] is None and out[0]["annotation"]
    assert "column 'text' is undefined" in out[1]["error"] and out[1]["annotation"] is None
    assert "max_model_len" in out[2]["error"] or "long" in out[2]["error"], out[2]["error"]  # prompt over the model's length
    assert (mixed.ok, mixed.failed) == (1, 2)


def test_missing_column_fails_only_that_row_and_sets_the_exit_status(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    from tokenmill.cli import main

    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}, {"other": "b"}, {"text": "c"}])
    status = main(["annotate", str(src), "-o", str(tmp_path / "out.jsonl"), "--template", "T: {{ text }}", "--max-tokens", "3",
                   "--model", "builtin:tiny", "--num-kv-blocks", "64"])
    stderr = capfd.readouterr().err
    assert status == 1, stderr
    out = read_jsonl(tmp_path / "out.jsonl")
    assert [r["error"] is None for r in out] == [True, False, True]
    assert "column 'text' is undefined" in out[1]["error"] and out[1]["other"] == "b"
    assert "rows failed" in stderr and "rows ok" in stderr  # the summary table
    assert main(["annotate", str(tmp_path / "none.csv"), "-o", str(tmp_path / "x.jsonl"), "--template", "{{ a }}",
                 "--model", "builtin:tiny"]) == 2
    assert "no such file" in capfd.readouterr().err


@pytest.mark.parametrize("case", ["bad_template", "missing_file", "wrong_extension", "corrupt_parquet", "bad_json_line",
                                  "unknown_id_column", "bad_sampling"])
def test_unusable_input_is_refused_up_front_with_a_clear_error(llm, tmp_path: Path, case: str) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", rows(3))
    template, options, expected = "{{ text }}", {}, None
    if case == "bad_template":
        template, expected = "{{ text ", (InvalidRequestError, "template: line 1")
    elif case == "missing_file":
        src, expected = tmp_path / "nope.jsonl", (DatasetError, "no such file")
    elif case == "wrong_extension":
        src = tmp_path / "in.txt"
        src.write_text('{"text": "a"}\n')
        expected = (DatasetError, "--input-format")
    elif case == "corrupt_parquet":
        src = tmp_path / "in.parquet"
        src.write_bytes(b"PAR1 this is not a parquet file at all")
        expected = (DatasetError, "in.parquet")
    elif case == "bad_json_line":
        src.write_text('{"text": "a"}\n{"text": oops}\n')
        expected = (DatasetError, "cannot be read")
    elif case == "unknown_id_column":
        options, expected = {"id_column": "nope"}, (InvalidRequestError, "id_column")
    elif case == "bad_sampling":
        options, expected = {"top_p": 7.0}, (InvalidRequestError, "top_p")
    with pytest.raises(expected[0], match=expected[1].replace("-", "\\-")):
        run(llm, src, tmp_path / "out.jsonl", template=template, **options)
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("where", ["template", "system", "template_file"])
def test_templates_cannot_run_code_and_the_row_error_names_the_line(llm, tmp_path: Path, where: str) -> None:
    """A template reaching for Python internals (`cycler.__init__.__globals__.os`) is refused by the sandbox:
    the command never runs, each row's error names the template and its line; a row value holding template
    syntax is rendered as text, never as code."""
    from tokenmill.apps.cli import text_or_file

    marker = tmp_path / "ran"
    exploit = f"Say: {{{{ text }}}}\n{{{{ cycler.__init__.__globals__.os.system('touch {marker}') }}}}"
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}, {"text": "b"}])
    if where == "system":
        summary = run(llm, src, tmp_path / "out.jsonl", system=exploit)
    elif where == "template":
        summary = run(llm, src, tmp_path / "out.jsonl", template=exploit)
    else:
        (tmp_path / "t.jinja").write_text(exploit)
        summary = run(llm, src, tmp_path / "out.jsonl", template=text_or_file(str(tmp_path / "t.jinja")))
    assert not marker.exists(), "the template ran a shell command"
    assert summary.failed == 2
    for row in read_jsonl(tmp_path / "out.jsonl"):
        assert row["error"].startswith(f"{'system' if where == 'system' else 'template'}: line 2: SecurityError: "), row["error"]
        assert "unsafe" in row["error"] and row["annotation"] is None
    literal = "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}"
    write_jsonl(src, [{"text": literal}])
    summary = run(llm, src, tmp_path / "values.jsonl", template="{{ text }}", max_tokens=1)
    assert summary.failed == 0 and not marker.exists()
    assert read_jsonl(tmp_path / "values.jsonl")[0]["prompt_tokens"] == len(llm.engine.tokenize(literal))  # verbatim


def test_row_ids_and_errors_in_the_summary_are_shown_as_written_not_as_rich_markup(
        llm, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ids like `[/nope]` (a closing tag rich cannot match) used to crash the summary after the output was written."""
    monkeypatch.setenv("COLUMNS", "500")  # rich's width: no wrapped cells
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "[/nope]"}, {"id": "[bold red]loud[/]", "text": "[/x] fine"}])
    summary = annotate(str(src), str(tmp_path / "out[/o].jsonl"), "{{ text }} [/t]", llm=llm, id_column="id", max_tokens=2)
    assert (summary.ok, summary.failed) == (1, 1)
    err = capsys.readouterr().err
    assert "[/nope]: template: column 'text' is undefined" in err and "out[/o].jsonl" in err


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_a_planted_partial_symlink_is_removed_not_followed(llm, tmp_path: Path, suffix: str) -> None:
    """`ln -s victim out.jsonl.partial` used to make the run overwrite `victim`: the link is unlinked and the
    temporary file created fresh (O_EXCL | O_NOFOLLOW)."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    out = tmp_path / f"out.{suffix}"
    Path(f"{out}.partial").symlink_to(victim)
    summary = run(llm, write_jsonl(tmp_path / "in.jsonl", rows(3)), out)
    assert summary.ok == 3 and victim.read_text() == "precious"
    assert not out.is_symlink() and not Path(f"{out}.partial").exists()
    assert len(read_jsonl(out) if suffix == "jsonl" else pq.read_table(out).to_pylist()) == 3


def test_checkpoint_files_are_readable_by_their_owner_only(llm, tmp_path: Path) -> None:
    """The checkpoint holds every prompt and completion: the database, its WAL and shared-memory files (also
    ones left by an earlier run) are 0600 and the state directory 0700, under the usual umask 022."""
    import os
    import stat

    from tokenmill.apps.store import Checkpoint, Outcome

    def modes(directory: Path) -> dict[str, int]:
        return {p.name: stat.S_IMODE(p.stat().st_mode) for p in directory.iterdir()}

    old_umask = os.umask(0o022)
    try:
        state = tmp_path / "state"
        run(llm, write_jsonl(tmp_path / "in.jsonl", rows(3)), tmp_path / "out.jsonl", state_dir=str(state))
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        assert modes(state)["checkpoint.sqlite"] == 0o600
        checkpoint = Checkpoint(str(state / "checkpoint.sqlite"), flush_interval=0)
        checkpoint.put("k", Outcome(text="secret completion"))  # committed: the WAL and -shm files exist now
        assert {"checkpoint.sqlite", "checkpoint.sqlite-wal", "checkpoint.sqlite-shm"} <= set(modes(state))
        assert set(modes(state).values()) == {0o600}, modes(state)
        checkpoint.close()
        old = tmp_path / "old"  # an earlier version's world-readable checkpoint and a stale journal
        old.mkdir()
        for name in ("checkpoint.sqlite", "checkpoint.sqlite-journal"):
            (old / name).touch(mode=0o644)
        Checkpoint(str(old / "checkpoint.sqlite")).close()
        assert set(modes(old).values()) == {0o600}, modes(old)
    finally:
        os.umask(old_umask)


def test_template_edit_and_appended_rows_recompute_only_what_changed(llm, tmp_path: Path) -> None:
    data = [{"kind": "a" if i % 3 == 0 else "b", "text": f"t{i}"} for i in range(30)]
    src = write_jsonl(tmp_path / "in.jsonl", data)
    first = "{% if kind == 'a' %}A: {{ text }}{% else %}B: {{ text }}{% endif %}"
    assert run(llm, src, tmp_path / "out.jsonl", template=first).computed == 30
    edited = "{% if kind == 'a' %}Changed A: {{ text }}{% else %}B: {{ text }}{% endif %}"
    summary = run(llm, src, tmp_path / "out.jsonl", template=edited)
    assert (summary.computed, summary.reused) == (10, 20)
    write_jsonl(src, data + [{"kind": "b", "text": f"new{i}"} for i in range(5)])
    summary = run(llm, src, tmp_path / "out.jsonl", template=edited)
    assert (summary.computed, summary.reused, summary.rows) == (5, 30, 35)
    fresh = run(llm, src, tmp_path / "fresh.jsonl", template=edited)  # from scratch: the same output
    assert fresh.computed == 35
    assert read_jsonl(tmp_path / "out.jsonl") == read_jsonl(tmp_path / "fresh.jsonl")


def test_retry_failed_recomputes_only_failed_rows(llm, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "short"}, {"text": "y" * 5000}])
    assert run(llm, src, tmp_path / "out.jsonl").failed == 1
    again = run(llm, src, tmp_path / "out.jsonl")
    assert (again.computed, again.reused) == (0, 2)
    retried = run(llm, src, tmp_path / "out.jsonl", retry_failed=True)
    assert (retried.computed, retried.reused, retried.failed) == (1, 1, 1)


def test_chat_mode_renders_system_and_template_as_messages(llm, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", rows(3))
    run(llm, src, tmp_path / "plain.jsonl")
    run(llm, src, tmp_path / "chat.jsonl", chat=True, system="You label {{ id }}.")
    plain, chat = read_jsonl(tmp_path / "plain.jsonl"), read_jsonl(tmp_path / "chat.jsonl")
    expected = llm.chat([[{"role": "system", "content": f"You label r{i}."}, {"role": "user", "content": f"Say: item number {i}"}]
                         for i in range(3)], SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    assert [r["annotation"] for r in chat] == [o.text for o in expected]
    assert [r["prompt_tokens"] for r in chat] == [len(o.prompt_token_ids) for o in expected]
    assert all(c["prompt_tokens"] > p["prompt_tokens"] for c, p in zip(chat, plain))


def test_structured_output_options(llm, tmp_path: Path) -> None:
    """Active once structured outputs (SamplingParams.json_schema/choice/regex) are merged; before, the option
    is refused up front naming the field."""
    src = write_jsonl(tmp_path / "in.jsonl", rows(4))
    schema = {"type": "object", "properties": {"label": {"type": "string", "enum": ["pos", "neg"]}}, "required": ["label"]}
    if not STRUCTURED:
        with pytest.raises(InvalidRequestError, match="json_schema"):
            run(llm, src, tmp_path / "out.jsonl", json_schema=schema)
        return
    run(llm, src, tmp_path / "out.jsonl", json_schema=schema, max_tokens=32)
    for row in read_jsonl(tmp_path / "out.jsonl"):
        assert row["error"] is None, row["error"]
        assert row["parsed"]["label"] in ("pos", "neg") and json.loads(row["annotation"]) == row["parsed"]
    run(llm, src, tmp_path / "choice.parquet", choice=["yes", "no"], max_tokens=8)
    table = pq.read_table(tmp_path / "choice.parquet")
    assert set(table.column("annotation").to_pylist()) <= {"yes", "no"}


def test_a_label_cut_short_is_a_failed_row_never_a_label(llm, tmp_path: Path) -> None:
    """`--choice positive,negative --max-tokens 4` once wrote "nega" as a valid label. Now a `max_tokens` that cannot
    hold the longest choice is refused before any row runs, naming its token count; left unset it is sized from the
    choices; and a label cut short anyway (here by a stop string) fails its row with the reason, its label column
    empty, counted apart in the summary, and the run's exit status says so."""
    src = write_jsonl(tmp_path / "in.jsonl", rows(3))
    needed = len(llm.engine.tokenizer.encode("positive", add_special_tokens=False))
    with pytest.raises(InvalidRequestError, match=f"4 is fewer than the {needed} tokens of the longest choice 'positive'"):
        run(llm, src, tmp_path / "refused.jsonl", choice=["positive", "negative"], max_tokens=4)
    assert not (tmp_path / "refused.jsonl").exists()
    sized = run(llm, src, tmp_path / "sized.jsonl", choice=["positive", "negative"], max_tokens=None)
    assert (sized.ok, sized.failed) == (3, 0)
    assert {r["annotation"] for r in read_jsonl(tmp_path / "sized.jsonl")} <= {"positive", "negative"}
    summary = run(llm, src, tmp_path / "out.jsonl", choice=["positive", "negative"], max_tokens=None, stop=["t"])
    assert (summary.ok, summary.failed, summary.incomplete) == (0, 3, 3)
    for row in read_jsonl(tmp_path / "out.jsonl"):
        assert row["annotation"] is None and row["finish_reason"] == "stop"
        assert row["error"] == ("constraint_incomplete: a stop string or stop token ended the output inside the choice "
                                "(field: stop)")
    schema = {"type": "object", "properties": {"label": {"type": "string"}}, "required": ["label"]}
    cut = run(llm, src, tmp_path / "schema.jsonl", json_schema=schema, max_tokens=3)
    assert (cut.failed, cut.incomplete) == (3, 3)
    assert all(r["error"].startswith("constraint_incomplete: max_tokens 3 reached inside the JSON schema")
               for r in read_jsonl(tmp_path / "schema.jsonl"))
    done = cli("annotate", str(src), "-o", str(tmp_path / "cli.jsonl"), "--template", "Say: {{ text }}", "--choice",
               "positive,negative", "--max-tokens", "4", "--num-kv-blocks", str(ENGINE["num_kv_blocks"]),
               "--model", "builtin:tiny", "--quiet")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert f"--max-tokens: 4 is fewer than the {needed} tokens of the longest choice 'positive'" in done.stderr
    cut_cli = cli("annotate", str(src), "-o", str(tmp_path / "cli.jsonl"), "--template", "Say: {{ text }}", "--choice",
                  "positive,negative", "--stop", "t", "--num-kv-blocks", str(ENGINE["num_kv_blocks"]),
                  "--model", "builtin:tiny", "--quiet")
    assert cut_cli.returncode == 1, cut_cli.stderr


def test_ctrl_c_then_the_same_command_finishes_every_row(llm, tmp_path: Path) -> None:
    """Embedded: the rows in flight at Ctrl-C are marked interrupted and computed by the next run of the same command,
    which writes what an uninterrupted run writes."""
    src = write_jsonl(tmp_path / "in.jsonl", rows(120))
    out, state = tmp_path / "out.jsonl", tmp_path / "state"
    args = ["annotate", str(src), "-o", str(out), "--template", "Say: {{ text }}", "--max-tokens", "24", "--window", "8",
            "--state-dir", str(state), "--checkpoint-interval", "0", "--num-kv-blocks", str(ENGINE["num_kv_blocks"]),
            "--model", "builtin:tiny", "--quiet"]
    code = ("import signal, sys\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "from tokenmill.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-c", code, *args], env=env, stdin=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: checkpointed(state) >= 8 or process.poll() is not None, 300, "some results checkpointed")
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, stderr
    assert "rows in flight: the same command computes them again" in stderr
    done = cli(*args)
    assert done.returncode == 0, done.stderr
    whole = run(llm, src, tmp_path / "whole.jsonl", max_tokens=24)
    assert whole.ok == 120 and read_jsonl(out) == read_jsonl(tmp_path / "whole.jsonl")


def test_kill_9_mid_run_then_rerun_gives_the_uninterrupted_output(llm, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", rows(400))
    out, state = tmp_path / "out.jsonl", tmp_path / "state"
    args = ["annotate", str(src), "-o", str(out), "--template", "Say: {{ text }}", "--max-tokens", "24", "--window", "8",
            "--state-dir", str(state), "--checkpoint-interval", "0", "--num-kv-blocks", str(ENGINE["num_kv_blocks"]),
            "--model", "builtin:tiny", "--quiet"]
    process = cli(*args, wait=False)
    try:
        wait_until(lambda: checkpointed(state) >= 16 or process.poll() is not None, 300, "some results checkpointed")
        process.send_signal(signal.SIGKILL)
        process.wait(10)
    finally:
        if process.poll() is None:
            process.kill()
    done_before = checkpointed(state)
    assert 16 <= done_before < 400, f"the run was not killed mid-way ({done_before} rows done)"
    assert not out.exists()
    resumed = run(llm, src, out, max_tokens=24, window=8, state_dir=str(state))
    assert resumed.reused == done_before and resumed.computed == 400 - done_before
    reference = run(llm, src, tmp_path / "reference.jsonl", max_tokens=24, window=8)
    assert reference.computed == 400
    assert out.read_text() == (tmp_path / "reference.jsonl").read_text()


def test_import_tokenmill_stays_torch_free_with_annotate() -> None:
    code = "import sys, tokenmill; tokenmill.annotate; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": str(REPO)}, timeout=120)
    assert done.stdout.strip() == "False", done.stderr


#: Peak RSS of the annotate run itself: the model load's own peak varies from run to run by ~100 MiB (allocator
#: timing), so the high-water mark (VmHWM) is reset after loading (`5 > /proc/self/clear_refs`, Linux).
_MEMORY_SCRIPT = """
import gc, sys, torch
torch.set_num_threads(1)
import tokenmill
from tokenmill import LLM
llm = LLM("builtin:tiny", num_kv_blocks=256)
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
summary = tokenmill.annotate(sys.argv[1], sys.argv[2], "Label: {{ text }}", llm=llm, max_tokens=1, quiet=True)
assert summary.rows == int(sys.argv[3]) and summary.failed == 0, summary
status = open("/proc/self/status").read()
print(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="resets the peak RSS through /proc (Linux)")
def test_memory_does_not_grow_with_the_input(tmp_path: Path) -> None:
    """Peak RSS over 20,000 and 200,000 rows (generated, 1,000 distinct prompts, max_tokens 1) within 32 MiB."""
    peaks = {}
    for count in (20_000, 200_000):
        src = tmp_path / f"in{count}.parquet"
        table = pa.table({"id": list(range(count)), "text": [f"item {i % 1000}" for i in range(count)],
                          "payload": [f"{i:08d}" * 16 for i in range(count)]})
        pq.write_table(table, src, row_group_size=8192)
        del table
        done = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, str(src), str(tmp_path / f"out{count}.parquet"), str(count)],
                              capture_output=True, text=True, env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        peaks[count] = int(done.stdout.split()[-1]) / 1024  # VmHWM is in kB
        assert pq.read_metadata(tmp_path / f"out{count}.parquet").num_rows == count
    print(f"peak RSS (MiB): {peaks}")
    assert abs(peaks[200_000] - peaks[20_000]) < 32, peaks


def test_a_shared_instruction_is_served_from_the_prefix_cache(llm, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", rows(16))
    instruction = "You are a careful annotator. Read the item and answer with one word only. " * 4
    summary = run(llm, src, tmp_path / "out.jsonl", template=instruction + "Item: {{ text }}")
    assert summary.prefix_hit_rate is not None and summary.prefix_hit_rate > 0.6, summary.prefix_hit_rate


def test_the_cli_takes_the_template_from_a_file(tmp_path: Path) -> None:
    """`--template FILE` renders the file's text (as `--json-schema FILE` reads its file): same output as inline."""
    src = write_jsonl(tmp_path / "in.jsonl", rows(12))  # texts of two lengths
    template = "Review: {{ text }}\nSentiment:"
    (tmp_path / "t.jinja").write_text(template)
    common = ["--max-tokens", "4", "--num-kv-blocks", str(ENGINE["num_kv_blocks"]), "--model", "builtin:tiny", "--quiet"]
    from_file = cli("annotate", str(src), "-o", str(tmp_path / "file.jsonl"), "--template", str(tmp_path / "t.jinja"), *common)
    inline = cli("annotate", str(src), "-o", str(tmp_path / "inline.jsonl"), "--template", template, *common)
    assert from_file.returncode == inline.returncode == 0, from_file.stderr + inline.stderr
    by_file, by_text = read_jsonl(tmp_path / "file.jsonl"), read_jsonl(tmp_path / "inline.jsonl")
    assert by_file == by_text and len({r["prompt_tokens"] for r in by_file}) > 1


def test_the_progress_bar_counts_whole_rows() -> None:
    """It showed `1.0/200` (a unit may be a share of a row); now whole rows, however the shares add up."""
    from tokenmill.apps.pipeline import Progress

    progress = Progress(3, "rows", quiet=False)
    for share in (0.5, 0.5, 1.0, 1 / 3, 1 / 3, 1 / 3):
        progress.advance(share)
    assert progress.bar.n == 3 and isinstance(progress.bar.n, int)
    progress.close()


def test_dry_run_shows_prompts_and_plan_without_loading_a_model(tmp_path: Path) -> None:
    """`--dry-run` renders the first prompts and the plan and stops: the model named does not even exist, nothing is
    written, and the same command without it would run those rows."""
    src = write_jsonl(tmp_path / "in.jsonl", rows(5))
    out = tmp_path / "out.jsonl"
    done = cli("annotate", str(src), "-o", str(out), "--template", "Say: {{ text }}", "--model",
               str(tmp_path / "no-such-model"), "--max-tokens", "7", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "--- row 0:\nSay: item number 0" in done.stdout and "Say: item number 2" in done.stdout
    assert "item number 3" not in done.stdout  # the first three prompts only
    assert "rows: 5 to run, 0 failing" in done.stdout and "at most 35 completion (max_tokens 7 x 5 rows)" in done.stdout
    assert not out.exists() and not (tmp_path / "out.jsonl.tokenmill-state").exists()


def test_a_template_naming_a_column_the_input_lacks_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", rows(2))
    done = cli("annotate", str(src), "-o", str(tmp_path / "out.jsonl"), "--template", "Say: {{ txt }} {{ range(2) }}",
               "--model", str(tmp_path / "no-such-model"))  # loading it would fail with another message
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "--template: names column(s) 'txt' that the input does not have (columns: id, text, n)" in done.stderr


def test_limit_runs_and_writes_the_first_rows_only(llm, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", rows(10))
    summary = run(llm, src, tmp_path / "out.jsonl", limit=4, id_column="id")
    assert (summary.rows, summary.ok) == (4, 4)
    assert [r["id"] for r in read_jsonl(tmp_path / "out.jsonl")] == ["r0", "r1", "r2", "r3"]
    with pytest.raises(InvalidRequestError, match="limit"):
        run(llm, src, tmp_path / "none.jsonl", limit=0)


def test_annotate_and_batch_need_a_model_without_a_broker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forgotten --model once labelled a whole dataset with builtin:tiny's gibberish."""
    src = write_jsonl(tmp_path / "in.jsonl", rows(2))
    monkeypatch.delenv("TOKENMILL_MODEL", raising=False)
    for args in (["annotate", str(src), "-o", str(tmp_path / "out.jsonl"), "--template", "{{ text }}"],
                 ["batch", "-i", str(src), "-o", str(tmp_path / "out.jsonl")]):
        done = cli(*args)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert f"tokenmill {args[0]}: --model: required without --broker" in done.stderr
    assert not (tmp_path / "out.jsonl").exists()
    with pytest.raises(InvalidRequestError, match="model"):
        annotate(str(src), str(tmp_path / "api.jsonl"), "{{ text }}", quiet=True)


def test_probabilities_give_each_choice_s_probability_and_the_most_probable_label(llm, tmp_path: Path) -> None:
    """`--probabilities`: a column of each choice's probability (a struct of floats in Parquet), summing to 1, the
    label the most probable choice; the same numbers as the engine gives the same prompt."""
    src = write_jsonl(tmp_path / "in.jsonl", rows(4))
    choices = ["positive", "negative", "neutral"]
    run(llm, src, tmp_path / "out.jsonl", choice=choices, choice_probabilities=True, max_tokens=None)
    run(llm, src, tmp_path / "out.parquet", choice=choices, choice_probabilities=True, max_tokens=None)
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.schema.field("probabilities").type == pa.struct([(c, pa.float64()) for c in choices])
    direct = llm.generate([f"Say: {r['text']}" for r in rows(4)], SamplingParams(choice=choices,
                                                                                choice_probabilities=True))
    for row, parquet_row, expected in zip(read_jsonl(tmp_path / "out.jsonl"), table.to_pylist(), direct):
        assert row["probabilities"] == pytest.approx(expected.choice_probabilities, rel=1e-5)  # batched otherwise
        assert parquet_row["probabilities"] == pytest.approx(expected.choice_probabilities, rel=1e-5)
        assert sum(row["probabilities"].values()) == pytest.approx(1.0)
        assert row["annotation"] == max(choices, key=row["probabilities"].get)


def test_logprobs_column_holds_each_generated_token_with_its_alternatives(llm, tmp_path: Path) -> None:
    """`--logprobs N`: a column of the generated tokens, each with its logprob and N alternatives (a typed list of
    structs in Parquet), the engine's own numbers; `--logprobs 0` the chosen tokens alone."""
    src = write_jsonl(tmp_path / "in.jsonl", rows(3))
    run(llm, src, tmp_path / "out.jsonl", logprobs=2)
    run(llm, src, tmp_path / "out.parquet", logprobs=2)
    table = pq.read_table(tmp_path / "out.parquet")
    entry = pa.struct([("token", pa.string()), ("logprob", pa.float64())])
    assert table.schema.field("logprobs").type == pa.list_(pa.struct([*entry, ("top_logprobs", pa.list_(entry))]))
    direct = llm.generate([f"Say: {r['text']}" for r in rows(3)],
                          SamplingParams(max_tokens=6, temperature=0.0, logprobs=2), use_tqdm=False)
    decode = llm.tokenizer.decode
    jsonl_rows = read_jsonl(tmp_path / "out.jsonl")
    for row, parquet_row, expected in zip(jsonl_rows, table.to_pylist(), direct, strict=True):
        for tokens in (row["logprobs"], parquet_row["logprobs"]):  # two runs: the same tokens, logprobs to rounding
            assert [e["token"] for e in tokens] == [decode([i]) for i in expected.token_ids]
            assert [e["logprob"] for e in tokens] == pytest.approx([p["logprob"] for p in expected.logprobs], abs=1e-4)
            for got, position in zip(tokens, expected.logprobs, strict=True):
                assert [t["token"] for t in got["top_logprobs"]] == [decode([i]) for i, _ in position["top_logprobs"]]
                assert [t["logprob"] for t in got["top_logprobs"]] == \
                    pytest.approx([lp for _, lp in position["top_logprobs"]], abs=1e-4)
    done = cli("annotate", str(src), "-o", str(tmp_path / "cli.jsonl"), "--template", "Say: {{ text }}", "--model",
               "builtin:tiny", "--max-tokens", "6", "--logprobs", "0", "--quiet")
    assert done.returncode == 0, done.stderr
    for row, chosen in zip(read_jsonl(tmp_path / "cli.jsonl"), jsonl_rows, strict=True):
        assert [(e["token"], e["top_logprobs"]) for e in row["logprobs"]] == [(e["token"], []) for e in chosen["logprobs"]]


def test_a_checkpoint_from_before_a_new_result_field_still_resumes(tmp_path: Path) -> None:
    import sqlite3

    from tokenmill.apps.store import Checkpoint

    path = tmp_path / "checkpoint.sqlite"
    with sqlite3.connect(path) as db:  # the results table as written before `choice_probabilities` existed
        db.execute("CREATE TABLE results (key TEXT PRIMARY KEY, run TEXT, text TEXT, parsed TEXT, finish_reason TEXT, "
                   "prompt_tokens INTEGER, completion_tokens INTEGER, error TEXT, logprobs TEXT, created INTEGER)")
        db.execute("INSERT INTO results VALUES ('k', 'old', 'yes', NULL, 'stop', 3, 1, NULL, NULL, 5)")
    checkpoint = Checkpoint(str(path), 0)
    try:
        outcome, earlier = checkpoint.get("k")
        assert (outcome.text, outcome.choice_probabilities, earlier) == ("yes", None, True)
    finally:
        checkpoint.close()


def test_embed_writes_each_row_s_vector_in_an_embedding_column(llm, tmp_path: Path) -> None:
    """`--embed`: each rendered prompt's vector (`LLM.embed`'s, to 1e-5) in an `embedding` column (JSONL: a list of
    floats; Parquet: list<float32>) beside `prompt_tokens` and `error`; `--dimensions` cuts it; a row that fails has
    nulls and its error; a sampling option or `--dimensions` alone is refused before any row runs."""
    import numpy as np

    data = rows(4) + [{"id": "long", "text": "z" * 5000, "n": 9}]
    src = write_jsonl(tmp_path / "in.jsonl", data)
    for out in ("out.jsonl", "out.parquet"):
        summary = annotate(str(src), str(tmp_path / out), "Say: {{ text }}", llm=llm, quiet=True, embed=True)
        assert (summary.ok, summary.failed) == (4, 1)
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.schema.field("embedding").type == pa.list_(pa.float32())
    assert table.column_names == ["id", "text", "n", "embedding", "prompt_tokens", "error"]
    expected = llm.embed([f"Say: {r['text']}" for r in rows(4)])
    jsonl = read_jsonl(tmp_path / "out.jsonl")
    for got in (jsonl, table.to_pylist()):
        np.testing.assert_allclose([row["embedding"] for row in got[:4]], [o.embedding for o in expected], atol=1e-5)
        assert [row["prompt_tokens"] for row in got[:4]] == [o.num_prompt_tokens for o in expected]
        assert got[4]["embedding"] is None and "max_model_len" in got[4]["error"]
    done = cli("annotate", str(src), "-o", str(tmp_path / "cli.jsonl"), "--template", "Say: {{ text }}", "--model",
               "builtin:tiny", "--embed", "--dimensions", "8", "--limit", "4", "--quiet")
    assert done.returncode == 0, done.stderr
    cut = llm.embed([f"Say: {r['text']}" for r in rows(4)], dimensions=8)
    np.testing.assert_allclose([row["embedding"] for row in read_jsonl(tmp_path / "cli.jsonl")],
                               [o.embedding for o in cut], atol=1e-5)
    for options, field in (({"embed": True, "max_tokens": 5}, "max_tokens"), ({"dimensions": 8}, "dimensions"),
                           ({"embed": True, "dimensions": 0}, "dimensions")):
        with pytest.raises(InvalidRequestError) as refused:
            annotate(str(src), str(tmp_path / "x.jsonl"), "Say: {{ text }}", llm=llm, quiet=True, **options)
        assert refused.value.field == field


def test_score_writes_each_row_s_continuation_scores_in_a_scores_column(llm, tmp_path: Path) -> None:
    """`--score`: each rendered prompt scores the continuations (`LLM.score`'s, to 1e-5), in a `scores` column
    (JSONL: a list of objects; Parquet: list<struct<continuation, logprob, is_greedy, num_tokens>>) beside
    `prompt_tokens` and `error`; spaces in the CLI's list are kept; a row that fails has nulls and its error; a
    sampling option, `embed` or an empty continuation is refused before any row runs."""
    continuations = [" yes", " no", " not at all"]
    data = rows(3) + [{"id": "long", "text": "z" * 5000, "n": 9}]
    src = write_jsonl(tmp_path / "in.jsonl", data)
    for out in ("out.jsonl", "out.parquet"):
        summary = annotate(str(src), str(tmp_path / out), "Say: {{ text }}", llm=llm, quiet=True, score=continuations)
        assert (summary.ok, summary.failed) == (3, 1)
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.column_names == ["id", "text", "n", "scores", "prompt_tokens", "error"]
    assert table.schema.field("scores").type == pa.list_(pa.struct([
        ("continuation", pa.string()), ("logprob", pa.float64()), ("is_greedy", pa.bool_()), ("num_tokens", pa.int64())]))
    expected = [llm.score(f"Say: {r['text']}", continuations) for r in rows(3)]
    for got in (read_jsonl(tmp_path / "out.jsonl"), table.to_pylist()):
        for row, want in zip(got[:3], expected):
            assert [s["continuation"] for s in row["scores"]] == continuations
            assert [(s["num_tokens"], s["is_greedy"]) for s in row["scores"]] == [(len(w.token_ids), w.is_greedy)
                                                                                for w in want]
            assert max(abs(s["logprob"] - w.logprob) for s, w in zip(row["scores"], want)) <= 1e-5
        assert got[3]["scores"] is None and "max_model_len" in got[3]["error"]
    done = cli("annotate", str(src), "-o", str(tmp_path / "cli.jsonl"), "--template", "Say: {{ text }}", "--model",
               "builtin:tiny", "--score", " yes, no", "--limit", "1", "--quiet")
    assert done.returncode == 0, done.stderr
    [row] = read_jsonl(tmp_path / "cli.jsonl")
    assert [s["continuation"] for s in row["scores"]] == [" yes", " no"]
    for options, field in (({"max_tokens": 5}, "max_tokens"), ({"embed": True}, "score"), ({"score": [""]}, "score[0]")):
        with pytest.raises(InvalidRequestError) as refused:
            annotate(str(src), str(tmp_path / "x.jsonl"), "Say: {{ text }}", llm=llm, quiet=True,
                     **{"score": continuations, **options})
        assert refused.value.field == field

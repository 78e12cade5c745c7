"""The `tokenmill` command: offline `generate` (the README's quick start) and `worker` settings."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from service_fixtures import REPO, RedisServer

from tokenmill.cli import DEMO_PROMPTS, build_parser, worker_settings
from tokenmill.engine.config import ENGINE_OPTIONS, EngineConfig
from tokenmill.sampling_params import DEFAULT_MAX_TOKENS
from tokenmill.worker.main import gc_thresholds


def _generate(*args: str) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # a tiny model: torch threads would only contend
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "generate", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_generate_with_no_arguments_completes_the_demo_prompts() -> None:
    lines = _generate()
    assert [line["prompt"] for line in lines] == DEMO_PROMPTS
    for line in lines:
        assert line["finish_reason"] in ("stop", "length")
        limit = DEFAULT_MAX_TOKENS  # the one max_tokens rule of every command
        assert len(line["token_ids"]) == limit if line["finish_reason"] == "length" else len(line["token_ids"]) <= limit


def test_generate_reads_prompts_from_flags_and_jsonl(tmp_path: Path) -> None:
    source = tmp_path / "prompts.jsonl"
    source.write_text(json.dumps("from a file") + "\n" + json.dumps({"prompt": "an object"}) + "\n")
    lines = _generate("--prompt", "from a flag", "--input", str(source), "--max-tokens", "5", "--seed", "3")
    assert [line["prompt"] for line in lines] == ["from a flag", "from a file", "an object"]
    assert all(len(line["token_ids"]) <= 5 for line in lines)


def test_generate_names_a_bad_flag() -> None:
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "generate", "--max-tokens", "0"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--max-tokens" in done.stderr


def test_worker_flags_override_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_BROKER_URL", "redis://from-env:6379/0")
    monkeypatch.setenv("TOKENMILL_QUEUES", "a, b")
    monkeypatch.setenv("TOKENMILL_VISIBILITY_TIMEOUT", "7")
    args = build_parser().parse_args(["worker", "--broker", "redis://from-flag:6379/1", "--max-num-seqs", "8"])
    settings = worker_settings(args)
    assert settings.broker_url == "redis://from-flag:6379/1"
    assert settings.queues == ["a", "b"] and settings.visibility_timeout == 7
    assert settings.max_num_seqs == 8 and settings.in_flight_capacity == 10


@pytest.mark.parametrize(("flags", "take_at_least"), [([], 32), (["--max-num-seqs", "8"], 1), (["--max-num-seqs", "64"], 8),
                                                       (["--concurrency", "256"], 1), (["--concurrency", "356"], 50)])
def test_a_full_worker_refills_half_its_engine_queue_at_once(flags: list[str], take_at_least: int) -> None:
    """`take_at_least`: half of the jobs a worker holds beyond `max_num_seqs` (default 256), at least one."""
    settings = worker_settings(build_parser().parse_args(["worker", "--broker", "redis://x:6379/0", *flags]))
    assert settings.take_at_least == take_at_least


@pytest.mark.parametrize(("flags", "threshold"), [([], 32_000), (["--max-num-seqs", "8"], 20_000),
                                                   (["--max-num-seqs", "1024"], 128_000), (["--concurrency", "2000"], 200_000),
                                                   (["--concurrency", "50000"], 1_000_000)])
def test_the_garbage_collector_does_not_walk_a_full_worker_s_jobs_as_it_fills_up(flags: list[str], threshold: int) -> None:
    """A collection comes every `threshold` net allocations: twice the ~48 objects of each job the worker may hold,
    within bounds."""
    settings = worker_settings(build_parser().parse_args(["worker", "--broker", "redis://x:6379/0", *flags]))
    assert gc_thresholds(settings.in_flight_capacity) == (threshold, 50, 100)
    assert threshold >= 2 * 48 * settings.in_flight_capacity or threshold in (20_000, 1_000_000)


def test_every_engine_option_is_a_worker_flag_and_variable_with_the_engine_s_default(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Derived from `EngineConfig`, not copied: each field has a `tokenmill worker` flag and a `TOKENMILL_<NAME>`
    variable, with the engine's default, its help text in `--help`, and reaches the engine's options."""
    assert {o.name for o in ENGINE_OPTIONS} == {f for f in EngineConfig.__dataclass_fields__} - {"model"}
    defaults = worker_settings(build_parser().parse_args(["worker"]))
    assert defaults.engine_options() == {o.name: o.default for o in ENGINE_OPTIONS}
    worker = next(a for a in build_parser()._actions if a.dest == "command").choices["worker"]
    flags = {flag: action for action in worker._actions for flag in action.option_strings}
    given = {"device": ("cuda:1", "cuda:1"), "gpu_memory_utilization": ("0.5", 0.5), "tokenizer": ("tok", "tok"),
             "load_format": ("dummy", "dummy"), "kv_cache_memory": ("1000000", 1000000),
             "grammar_compile_timeout": ("5", 5.0)}
    for option in ENGINE_OPTIONS:
        flag = f"--{option.name.replace('_', '-')}"
        assert flag in flags and option.help[:30] in flags[flag].help, option.name
    args = [part for name, (text, _) in given.items() for part in (f"--{name.replace('_', '-')}", text)]
    settings = worker_settings(build_parser().parse_args(["worker", *args, "--trust-remote-code",
                                                          "--no-enable-prefix-caching"]))
    options = settings.engine_options()
    assert {name: options[name] for name in given} == {name: value for name, (_, value) in given.items()}
    assert options["trust_remote_code"] is True and options["enable_prefix_caching"] is False
    monkeypatch.setenv("TOKENMILL_GPU_MEMORY_UTILIZATION", "0.25")
    monkeypatch.setenv("TOKENMILL_DEVICE", "cpu")
    from_env = worker_settings(build_parser().parse_args(["worker"])).engine_options()
    assert (from_env["gpu_memory_utilization"], from_env["device"]) == (0.25, "cpu")


def test_a_bad_engine_option_is_one_line_per_problem_before_anything_starts() -> None:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}, "PYTHONPATH": str(REPO)}
    for flags, expected in ((["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization: must be in (0, 1], got 1.5"),
                            (["--max-num-seqs", "0"], "max_num_seqs: must be >= 1, got 0"),
                            (["--model-impl", "jax"], "argument --model-impl: invalid choice: 'jax'")):
        done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "worker", "--model", "builtin:tiny", *flags],
                              env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and expected in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_worker_without_a_model_is_a_configuration_error_in_one_line() -> None:
    """There is no default model: a forgotten --model once served random-weight gibberish from builtin:tiny."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "worker", "--broker", "redis://127.0.0.1:1/0"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 78, done.stderr
    assert done.stderr.count("\n") == 1 and "no model given: pass --model (or set TOKENMILL_MODEL)" in done.stderr


def test_every_option_of_every_command_has_help_and_shows_its_default() -> None:
    from tokenmill.cli import DefaultsHelpFormatter

    def parsers(parser):
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from parsers(sub)

    for parser in parsers(build_parser()):
        assert parser.formatter_class is DefaultsHelpFormatter, parser.prog
        formatter = DefaultsHelpFormatter(parser.prog)
        for action in parser._actions:
            if not action.option_strings or action.dest == "help":
                continue
            assert action.help, f"{parser.prog} {action.option_strings[0]} has no help"
            if action.default not in (None, False, [], argparse.SUPPRESS) and action.default is not True:
                assert "default" in formatter._get_help_string(action), (parser.prog, action.option_strings[0])


def test_generate_prints_each_choice_s_probability() -> None:
    lines = _generate("--prompt", "a", "--choice", "yes,no,maybe", "--choice-probabilities")
    probabilities = lines[0]["choice_probabilities"]
    assert set(probabilities) == {"yes", "no", "maybe"} and abs(sum(probabilities.values()) - 1.0) < 1e-9
    assert lines[0]["text"] == max(probabilities, key=probabilities.get)


def test_generate_structured_outputs(tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"label": {"enum": ["cat", "dog"]}, "n": {"type": "integer", "minimum": 0,
              "maximum": 99}}, "required": ["label", "n"]}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    lines = _generate("--prompt", "a", "--prompt", "b", "--temperature", "1", "--seed", "1", "--max-tokens", "40",
                      "--json-schema", str(tmp_path / "schema.json"))
    assert all(line["constraint_satisfied"] and line["parsed"] == json.loads(line["text"]) for line in lines)
    assert all(line["parsed"]["label"] in ("cat", "dog") and 0 <= line["parsed"]["n"] <= 99 for line in lines)
    for flags, named in ((["--choice", "a,,b"], "--choice"), (["--regex", "(x"], "--regex"),
                         (["--json-schema", '{"type": 5}'], "--json-schema")):
        done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "generate", *flags], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and named in done.stderr, done.stderr


def test_a_model_that_cannot_load_is_one_line_and_a_configuration_exit(tmp_path: Path, redis_server: RedisServer) -> None:
    """A typo in --model is not a crash to restart (the worker exited 70 with a 14-frame traceback): the worker exits
    78 (EX_CONFIG), `generate` and `annotate` 2, each with one line naming the model and the fix."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    missing = str(tmp_path / "no-such-model")
    worker = subprocess.run([sys.executable, "-m", "tokenmill.cli", "worker", "--model", missing, "--broker",
                             redis_server.url, "--metrics-port", "0"], env=env, capture_output=True, text=True, timeout=300)
    assert worker.returncode == 78, worker.stderr[-2000:]
    assert f"tokenmill worker: model: no directory {missing!r}" in worker.stderr and "Traceback" not in worker.stderr
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "x"}\n')
    for command in (["generate", "--model", missing], ["annotate", str(source), "-o", str(tmp_path / "out.jsonl"),
                                                       "--template", "{{ text }}", "--model", missing, "--quiet"]):
        done = subprocess.run([sys.executable, "-m", "tokenmill.cli", *command], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 2, done.stderr[-2000:]
        lines = done.stderr.strip().splitlines()
        assert lines == [f"tokenmill {command[0]}: model: no directory {missing!r}: give a local directory written by "
                         "save_pretrained, a Hugging Face hub id, or builtin:tiny"], done.stderr[-2000:]


@pytest.mark.parametrize(("command", "module", "extra"), [
    (["annotate", "in.jsonl", "-o", "out.jsonl", "--template", "{{ text }}"], "pyarrow", "annotate"),
    (["serve"], "fastapi", "serve"),
    (["generate"], "torch", "worker"),
])
def test_a_missing_extra_is_one_line_naming_the_install(tmp_path: Path, command: list[str], module: str,
                                                        extra: str) -> None:
    """The README's annotate and serve examples failed with a bare ModuleNotFoundError where the quick start had
    installed only the worker extra; here the module is made unimportable in the command's process."""
    (tmp_path / "in.jsonl").write_text('{"text": "x"}\n')
    code = (f"import sys\nsys.modules[{module!r}] = None\nfrom tokenmill.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code, *command], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        f"tokenmill {command[0]}: needs the {extra!r} extra ({module} is not installed): pip install 'tokenmill[{extra}]'"]


def test_annotate_with_the_broker_down_is_one_line_and_exit_2(tmp_path: Path) -> None:
    from service_fixtures import free_port

    (tmp_path / "in.jsonl").write_text('{"text": "x"}\n')
    broker = f"redis://:secret@127.0.0.1:{free_port()}/0"  # nothing listens there
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "annotate", "in.jsonl", "-o", "out.jsonl", "--template",
                           "{{ text }}", "--broker", broker], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "secret" not in done.stderr
    lines = done.stderr.strip().splitlines()  # one line: no run announced, no progress bar for a run that never starts
    assert len(lines) == 1 and lines[0].startswith("tokenmill annotate: cannot use the broker redis://:**@127.0.0.1:")


def test_a_worker_whose_broker_does_not_answer_at_start_exits_69_in_one_line(tmp_path: Path) -> None:
    """It logged "worker ready" and retried for ever; now it waits --broker-wait seconds, before loading the model."""
    from service_fixtures import free_port

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}, "PYTHONPATH": str(REPO)}
    broker = f"redis://:secret@127.0.0.1:{free_port()}/0"
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "worker", "--broker", broker, "--broker-wait", "1",
                           "--model", "builtin:tiny", "--metrics-port", "0"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 69, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "secret" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("tokenmill worker: the broker redis://:**@127.0.0.1:")
    assert "engine process ready" not in done.stderr  # the model was never loaded


def test_version() -> None:
    from importlib.metadata import version

    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "--version"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == f"tokenmill {version('tokenmill')}"

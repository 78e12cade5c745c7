"""Parsing `engine_cpus` and splitting the available CPUs between the engine process and the worker."""

from __future__ import annotations

import pytest

from tokenmill.worker.cpus import format_cpu_list, parse_cpu_list, split_cpus


def test_cpu_lists_read_as_taskset_writes_them() -> None:
    assert parse_cpu_list("3") == {3}
    assert parse_cpu_list("0,2-4, 7") == {0, 2, 3, 4, 7}
    assert format_cpu_list({4, 0, 2}) == "0,2,4"
    for bad in ("", "a", "1-", "-1", "3-1", "1,,2", "1.5"):
        with pytest.raises(ValueError, match="is not a CPU list"):
            parse_cpu_list(bad)


def test_auto_gives_the_engine_the_last_cpu_and_the_worker_the_rest() -> None:
    assert split_cpus("auto", {0, 1, 2, 3}) == ({3}, {0, 1, 2})
    assert split_cpus("AUTO", {2, 5}) == ({5}, {2})
    assert split_cpus("auto", {0}) is None  # one CPU: nothing to split
    assert split_cpus("off", {0, 1}) is None


def test_a_list_gives_the_engine_those_cpus_if_the_worker_keeps_one() -> None:
    assert split_cpus("1-2", {0, 1, 2, 3}) == ({1, 2}, {0, 3})
    with pytest.raises(ValueError, match=r"CPU 4,6 is not available to this process \(available: 0,1\)"):
        split_cpus("4,6", {0, 1})
    with pytest.raises(ValueError, match="leaves no CPU for the worker itself"):
        split_cpus("0-1", {0, 1})


def test_off_asks_nothing_of_the_system_and_a_choice_needs_linux(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from tokenmill.worker.cpus import placement

    monkeypatch.delattr(os, "sched_getaffinity")
    assert placement("off") is None and placement(" Off ") is None
    with pytest.raises(ValueError, match="on Linux only"):
        placement("auto")

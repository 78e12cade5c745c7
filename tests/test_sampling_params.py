"""`SamplingParams.from_dict` remembers values it checked: what it returns must be what checking them again gives."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill import sampling_params
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams


def outcome(values: dict[str, Any]) -> tuple[str, Any]:
    """What `from_dict` gives for `values`: its fields (NaN spelled out, since NaN equals nothing), or the error."""
    try:
        params = SamplingParams.from_dict(values)
    except InvalidRequestError as exc:
        return "refused", (exc.field, exc.message)
    except TypeError as exc:
        return "type error", str(exc)
    fields = dataclasses.asdict(params)
    return "ok", {k: ("nan" if isinstance(v, float) and math.isnan(v) else (type(v), v)) for k, v in fields.items()}


def fresh(values: dict[str, Any]) -> tuple[str, Any]:
    """`outcome` with nothing remembered."""
    sampling_params._CHECKED.clear()
    return outcome(values)


#: Values that look alike in JSON or compare equal in Python, yet are checked differently.
LOOKALIKES = [
    ("seed", None, float("nan")),
    ("logprobs", None, float("inf")),
    ("max_tokens", 1, True),
    ("max_tokens", 1, 1.0),
    ("top_k", 0, False),
    ("ignore_eos", True, 1),
    ("skip_special_tokens", False, 0),
    ("stop_token_ids", [1], [True]),
    ("stop_token_ids", [1], [1.0]),
    ("choice", ["a", "b"], ("a", "b")),
    ("stop", ["x"], "x"),
    ("regex", None, float("nan")),
]


@pytest.mark.parametrize(("name", "first", "second"), LOOKALIKES)
def test_a_lookalike_of_checked_values_is_checked_on_its_own(name: str, first: Any, second: Any) -> None:
    for before, after in ((first, second), (second, first)):
        expected = fresh({name: after})
        sampling_params._CHECKED.clear()
        outcome({name: before})
        assert outcome({name: after}) == expected, (before, after)


def test_remembered_params_are_copies() -> None:
    values = {"max_tokens": 5, "stop": ["x"], "stop_token_ids": [3], "choice": ["a", "b"], "temperature": 0}
    sampling_params._CHECKED.clear()
    first = SamplingParams.from_dict(values)
    second = SamplingParams.from_dict(values)
    assert second == first and second is not first and len(sampling_params._CHECKED) == 1
    assert isinstance(second.temperature, float)  # normalised as the check does
    expected = dataclasses.replace(first, stop=list(first.stop), stop_token_ids=list(first.stop_token_ids),
                                   choice=list(first.choice))
    for params in (first, second):  # the checked one and a remembered one
        params.stop.append("y")
        params.stop_token_ids.append(4)
        params.choice.append("c")
    assert SamplingParams.from_dict(values) == expected


def test_what_is_remembered_is_bounded() -> None:
    sampling_params._CHECKED.clear()
    for n in range(sampling_params.CHECKED_LIMIT + 10):
        SamplingParams.from_dict({"max_tokens": n + 1})
    assert len(sampling_params._CHECKED) <= sampling_params.CHECKED_LIMIT
    assert SamplingParams.from_dict({"max_tokens": 7}).max_tokens == 7


def test_long_values_are_not_remembered() -> None:
    sampling_params._CHECKED.clear()
    long_choices = {"choice": [f"option {i}" for i in range(1000)]}
    assert SamplingParams.from_dict(long_choices).choice == long_choices["choice"]
    assert not sampling_params._CHECKED
    SamplingParams.from_dict({"choice": ["yes", "no"]})
    assert len(sampling_params._CHECKED) == 1


def test_schemas_are_not_remembered() -> None:
    sampling_params._CHECKED.clear()
    SamplingParams.from_dict({"json_schema": {"type": "object"}})
    first = SamplingParams.from_dict({"json_schema": '{"type": "object"}'})
    assert not sampling_params._CHECKED
    assert first.json_schema is not SamplingParams.from_dict({"json_schema": '{"type": "object"}'}).json_schema


scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 2**64), st.floats(), st.text(max_size=3))
values = st.dictionaries(
    st.sampled_from([f.name for f in dataclasses.fields(SamplingParams)] + ["bogus"]),
    st.one_of(scalars, st.lists(scalars, max_size=3), st.tuples(scalars)),
    max_size=6,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(values, min_size=1, max_size=4))
def test_from_dict_gives_what_a_fresh_check_gives(batch: list[dict[str, Any]]) -> None:
    expected = [fresh(v) for v in batch]
    sampling_params._CHECKED.clear()
    assert [outcome(v) for v in batch + batch] == expected + expected


def test_to_dict_gives_the_fields_in_order_and_only_them() -> None:
    names = [f.name for f in dataclasses.fields(SamplingParams)]
    params = SamplingParams.from_dict({"stop": "x", "temperature": 0, "max_tokens": 3})
    assert list(params.to_dict()) == names
    assert params.to_dict() == {name: getattr(params, name) for name in names}
    params.note = "not a field"  # type: ignore[attr-defined]
    assert list(params.to_dict()) == names


@pytest.mark.parametrize(("name", "value"), [("stop", 5), ("stop", {"a": 1}), ("stop_token_ids", 7), ("stop_token_ids", "12")])
def test_stop_fields_that_are_not_lists_are_refused_by_name(name: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(**{name: value})
    assert refused.value.field == name

"""reward_engine/sources/options.py: a bad constructor argument fails naming the source, the key and what it got."""

from __future__ import annotations

from typing import Any

import pytest

from rewardmesh.reward_engine.sources import options

W = "judge source 'j'"


@pytest.mark.parametrize(
    ("check", "value", "message"),
    [
        (lambda v: options.integer(W, "k", v, minimum=1), 0, "'k' must be an integer >= 1, got 0"),
        (lambda v: options.integer(W, "k", v, minimum=0), True, "'k' must be an integer >= 0, got True"),
        (lambda v: options.integer(W, "k", v, minimum=0, note=" (0: no limit)"), 1.5, "(0: no limit), got 1.5"),
        (lambda v: options.positive(W, "k", v), 0, "'k' must be a positive number, got 0"),
        (lambda v: options.positive(W, "k", v), "1", "'k' must be a positive number, got '1'"),
        (lambda v: options.non_negative(W, "k", v, note=" (0 = unlimited)"), -1, ">= 0 (0 = unlimited), got -1"),
        (lambda v: options.number(W, "k", v), False, "'k' must be a number, got False"),
        (lambda v: options.one_of(W, "k", v, ("a", "b")), "c", "'k' must be one of a, b, got 'c'"),
        (lambda v: options.text(W, "k", v), "", "'k' must be a non-empty string, got ''"),
        (lambda v: options.text(W, "k", v, empty=True), None, "'k' must be a string, got None"),
    ],
)
def test_a_bad_value_names_the_source_and_key(check: Any, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=r"^judge source 'j': ") as info:
        check(value)
    assert message in str(info.value)


def test_good_values_pass_through() -> None:
    assert options.integer(W, "k", 0, minimum=0) == 0
    assert options.positive(W, "k", 2) == 2.0
    assert options.non_negative(W, "k", 0.0) == 0.0
    assert options.one_of(W, "k", "a", ("a", "b")) == "a"
    assert options.text(W, "k", "", empty=True) == ""
    assert options.source_where("judge source", "j") == W
    with pytest.raises(ValueError, match=r"^judge source: 'name' must be a non-empty string"):
        options.source_where("judge source", "")

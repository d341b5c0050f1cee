"""Rule registry and built-in rules, checked against verl's gsm8k behaviour and math-verify."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

from rewardmesh.common.errors import InvalidInput, SourceFailed, UnknownReward
from rewardmesh.reward_engine.sources.rules import (
    RULES,
    RuleSource,
    extract_gsm8k_answer,
    get_rule,
    register_rule,
    rule_for_data_source,
)
from rewardmesh.reward_engine.sources.verl_compat import to_output
from rewardmesh.reward_engine.types import RewardOutput
from tests.support.samples import reward_input as sample


def call(rule: str, response: str, ground_truth: str, data_source: str = "openai/gsm8k") -> Any:
    return get_rule(rule)(data_source, response, ground_truth, None)


# ---------------------------------------------------------------------------------------------- gsm8k


@pytest.mark.parametrize(
    ("response", "truth", "score", "fmt"),
    [
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0, 1.0),
        ("48/2 = 24, so 48 + 24 = 71\n#### 71", "72", 0.0, 1.0),
        ("The answer is 72", "72", 0.0, 0.0),  # strict: no #### means no answer, even if right
        ("She earns #### 1,000 dollars", "1000", 1.0, 1.0),  # commas removed
        ("#### -5", "-5", 1.0, 1.0),  # negative
        ("#### 2.5", "2.5", 1.0, 1.0),  # decimals compared as written
        ("#### 2.50", "2.5", 0.0, 1.0),  # ... exactly as written, as verl does
        ("#### 3\n...on second thought\n#### 4", "4", 1.0, 1.0),  # the last #### counts
        ("####72", "72", 0.0, 0.0),  # verl requires the space
        ("#### 72", "Natalia sold 48/2 = 24 clips in May.\n#### 72", 1.0, 1.0),  # raw gsm8k answer as truth
        ("x" * 1000 + "\n#### 72", "72", 1.0, 1.0),  # long rollout: only the end is searched
        ("#### 72" + "x" * 400, "72", 0.0, 0.0),  # ... so an early answer is not seen (verl's clip)
    ],
)
def test_gsm8k_strict(response: str, truth: str, score: float, fmt: float) -> None:
    out = call("gsm8k", response, truth)
    assert out == {"score": score, "acc": score, "format": fmt}


@pytest.mark.parametrize(
    ("response", "truth", "score", "fmt"),
    [
        ("The answer is 72.", "72", 1.0, 0.0),  # the last number, without the full stop
        ("So, she paid 1,000 in total", "1000", 1.0, 0.0),
        ("It is -3, I think.", "-3", 1.0, 0.0),
        ("I got 12 then 15", "12", 0.0, 0.0),  # the last number is the answer
        ("#### 72", "72", 1.0, 1.0),
        ("no digits at all, sorry.", "72", 0.0, 0.0),
        ("The mean is 2.5 kg", "2.5", 1.0, 0.0),
    ],
)
def test_gsm8k_flexible(response: str, truth: str, score: float, fmt: float) -> None:
    out = call("gsm8k_flexible", response, truth)
    assert out == {"score": score, "acc": score, "format": fmt}


def test_gsm8k_extract_matches_verl_quirks() -> None:
    assert extract_gsm8k_answer("#### 72.", "strict") == "72."  # verl keeps the trailing dot
    assert extract_gsm8k_answer("#### $1,234", "strict") is None  # '$' before the digits: no match
    assert extract_gsm8k_answer("nothing", "flexible") is None
    with pytest.raises(ValueError, match="method"):
        extract_gsm8k_answer("#### 1", "loose")


# ----------------------------------------------------------------------------------------------- math


@pytest.mark.parametrize(
    ("response", "truth", "score"),
    [
        (r"Half of it: $\boxed{\frac{1}{2}}$", "0.5", 1.0),
        (r"So the answer is \boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"Expanding, \boxed{x^2 + 2x}", "x(x+2)", 1.0),
        (r"Thus \boxed{\frac{1}{3}}", "0.5", 0.0),
        (r"\boxed{72}", "72", 1.0),
        ("I do not know.", "72", 0.0),
    ],
)
def test_math(response: str, truth: str, score: float) -> None:
    out = call("math", response, truth, data_source="lighteval/MATH")
    assert out["score"] == score
    assert out["acc"] == score


def test_math_reports_whether_an_answer_was_found() -> None:
    assert call("math", "I do not know.", "72")["parsed"] == 0.0
    assert call("math", r"\boxed{71}", "72")["parsed"] == 1.0


def test_math_bad_ground_truth_is_invalid_input() -> None:
    with pytest.raises(InvalidInput, match="ground_truth"):
        call("math", r"\boxed{1}", "   ")


async def test_math_is_thread_safe() -> None:
    """math-verify's default signal.alarm timeouts raise outside the main thread; ours are off."""
    cases = [(r"\boxed{\frac{1}{2}}", "0.5", 1.0), (r"\boxed{\frac{2}{3}}", "0.5", 0.0)] * 4

    def in_worker(response: str, truth: str) -> tuple[bool, float]:
        out = call("math", response, truth)
        return threading.current_thread() is threading.main_thread(), out["score"]

    results = await asyncio.gather(*(asyncio.to_thread(in_worker, r, t) for r, t, _ in cases))
    assert [main for main, _ in results] == [False] * len(cases)
    assert [score for _, score in results] == [expected for _, _, expected in cases]


# ------------------------------------------------------------------------------------ format and more


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("#### 42", 1.0),
        (r"The result is \boxed{42}.", 1.0),
        (r"\boxed{}", 0.0),
        ("The result is 42.", 0.0),
        ("####42", 0.0),
    ],
)
def test_format(response: str, score: float) -> None:
    assert call("format", response, "")["score"] == score


def test_noop_and_length() -> None:
    assert call("noop", "anything at all", "x") == 0.0
    assert call("length", "a" * 250, "") == pytest.approx(-0.25)


@pytest.mark.parametrize(
    ("data_source", "rule"),
    [
        ("openai/gsm8k", "gsm8k"),
        ("gsm8k", "gsm8k"),
        ("lighteval/MATH", "math"),
        ("HuggingFaceH4/MATH-500", "math"),
        ("DigitalLearningGmbH/MATH-lighteval", "math"),
        ("math_dapo", "math"),
        ("aime2024", "math"),
        ("numina_olympiads", "math"),
    ],
)
def test_auto_dispatch(data_source: str, rule: str) -> None:
    assert rule_for_data_source(data_source) == rule


def test_auto_scores_with_the_dispatched_rule() -> None:
    assert call("auto", "#### 72", "72", data_source="openai/gsm8k")["score"] == 1.0
    assert call("auto", "The answer is 72", "72", data_source="openai/gsm8k")["score"] == 0.0  # strict
    assert call("auto", r"\boxed{\frac{1}{2}}", "0.5", data_source="lighteval/MATH")["score"] == 1.0


def test_auto_unknown_data_source_names_it() -> None:
    with pytest.raises(UnknownReward, match="codecontests"):
        call("auto", "print(1)", "1", data_source="codecontests")


# ------------------------------------------------------------------------------------------- registry


def test_registry_lists_known_rules_on_unknown_name() -> None:
    for name in ("gsm8k", "gsm8k_flexible", "math", "format", "noop", "length", "auto"):
        assert name in RULES
    with pytest.raises(UnknownReward, match=r"no_such_rule.*gsm8k"):
        get_rule("no_such_rule")


def test_register_rule_refuses_silent_shadowing() -> None:
    def first(data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None) -> float:
        return 1.0

    def second(data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None) -> float:
        return 2.0

    register_rule("test_rules_tmp")(first)
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_rule("test_rules_tmp")(second)
        assert get_rule("test_rules_tmp")("", "", "", None) == 1.0
        register_rule("test_rules_tmp", replace=True)(second)
        assert get_rule("test_rules_tmp")("", "", "", None) == 2.0
    finally:
        RULES.pop("test_rules_tmp", None)


# -------------------------------------------------------------------------------------------- to_output


def test_to_output_conversions() -> None:
    assert to_output(1) == RewardOutput(1.0, {})
    assert to_output(True) == RewardOutput(1.0, {})
    assert to_output(np.float32(0.25)) == RewardOutput(0.25, {})
    out = to_output({"score": 0.5, "acc": True, "n": 3, "np": np.int64(2), "text": "x", "nested": {"a": 1}})
    assert out == RewardOutput(0.5, {"acc": 1.0, "n": 3.0, "np": 2.0})
    assert all(type(v) is float for v in out.extras.values())
    for bad, message in [
        ("high", "returned str"),
        (None, "returned NoneType"),
        ({"acc": 1.0}, "without a 'score'"),
        ({"score": "1"}, "non-numeric 'score'"),
        (float("nan"), "non-finite"),
    ]:
        with pytest.raises(SourceFailed, match=message):
            to_output(bad, "rule 'x'")


# ------------------------------------------------------------------------------------------ RuleSource


async def test_rule_source_batch_isolates_a_raising_sample() -> None:
    @register_rule("test_rules_picky")
    def picky(data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None) -> Any:
        if solution_str == "bad":
            raise ValueError("cannot grade this")
        if solution_str == "weird":
            return "not a number"
        return {"score": float(len(solution_str)), "flag": True, "label": "dropped"}

    try:
        source = RuleSource(name="picky", rule="test_rules_picky")
        assert (source.name, source.kind, source.target) == ("picky", "rule", "test_rules_picky")
        results = await source.score_batch([sample("ab"), sample("bad"), sample("weird"), sample("abcd")])
        await source.close()
    finally:
        RULES.pop("test_rules_picky", None)
    assert results[0] == RewardOutput(2.0, {"flag": 1.0})
    assert isinstance(results[1], SourceFailed)
    assert str(results[1]) == "rule 'test_rules_picky' raised ValueError: cannot grade this"
    assert isinstance(results[2], SourceFailed) and "returned str" in str(results[2])
    assert results[3] == RewardOutput(4.0, {"flag": 1.0})


async def test_rule_source_auto_mixed_batch() -> None:
    source = RuleSource(name="auto", rule="auto")
    results = await source.score_batch(
        [
            sample("#### 72", "72", "openai/gsm8k"),
            sample(r"\boxed{\frac{1}{2}}", "0.5", "lighteval/MATH"),
            sample("whatever", "1", "mystery_set"),
            sample("#### 7", "72", "openai/gsm8k"),
        ]
    )
    assert results[0] == RewardOutput(1.0, {"acc": 1.0, "format": 1.0})
    assert isinstance(results[1], RewardOutput) and results[1].score == 1.0
    assert isinstance(results[2], UnknownReward) and "mystery_set" in str(results[2])
    assert results[3] == RewardOutput(0.0, {"acc": 0.0, "format": 1.0})


def test_rule_source_bad_config() -> None:
    with pytest.raises(ValueError, match=r"'rule'.*gsm8k"):
        RuleSource(name="x", rule="gsm9k")
    with pytest.raises(ValueError, match="'name'"):
        RuleSource(name="", rule="gsm8k")


@pytest.mark.parametrize(
    ("response", "truth", "score", "acc"),
    [("7", "7", 1.0, 1.0), (" 8 and more", "7", 0.55, 0.0), ("17", "7", 0.1, 0.0), ("x", "7", 0.0, 0.0)],
)
def test_near_number_gives_partial_credit_by_distance(response: str, truth: str, score: float, acc: float) -> None:
    out = RULES["near_number"]("addition", response, truth, None)
    assert isinstance(out, dict)
    assert out["score"] == pytest.approx(score) and out["acc"] == acc


def test_near_number_is_safe_inline_on_a_hostile_response() -> None:
    """It runs inline (no isolation pool): a 100,000-digit answer must neither hang nor raise."""
    assert not RULES["near_number"].isolate  # bounded parsing: it runs inline
    out = RULES["near_number"]("addition", "9" * 100_000, "7", None)
    assert isinstance(out, dict)
    assert out == {"score": 0.1, "acc": 0.0, "format": 1.0}

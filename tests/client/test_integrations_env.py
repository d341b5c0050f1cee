"""The adapters' settings from the environment: unset means the default, anything set must be a number, and a bad
value fails naming the variable (a typo never becomes a default that trains)."""

from __future__ import annotations

import pytest

from rewardmesh.client.integrations.scoring import ERROR_SCORE_ENV, TIMEOUT_ENV, env_error_score, env_timeout_s


def test_the_timeout_is_300_s_unset_and_what_is_set_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert env_timeout_s() == 300.0
    monkeypatch.setenv(TIMEOUT_ENV, "12.5")
    assert env_timeout_s() == 12.5


@pytest.mark.parametrize("value", ["", "abc"])
def test_a_timeout_that_is_not_a_number_fails_naming_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(TIMEOUT_ENV, value)
    with pytest.raises(ValueError, match=f"{TIMEOUT_ENV}='{value}' is not a number"):
        env_timeout_s()


def test_the_error_score_is_off_unset_or_empty_and_a_bad_one_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ERROR_SCORE_ENV, raising=False)
    assert env_error_score() is None
    monkeypatch.setenv(ERROR_SCORE_ENV, "")
    assert env_error_score() is None
    monkeypatch.setenv(ERROR_SCORE_ENV, "-1")
    assert env_error_score() == -1.0
    monkeypatch.setenv(ERROR_SCORE_ENV, "zero")
    with pytest.raises(ValueError, match=f"{ERROR_SCORE_ENV}='zero' is not a number"):
        env_error_score()

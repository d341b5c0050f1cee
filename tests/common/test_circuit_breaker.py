"""The circuit breaker any client of an HTTP service can use: open after consecutive failures, one probe when
half-open, shared per endpoint and settings, forgotten with its last user."""

from __future__ import annotations

import pytest

from rewardmesh.common.circuit_breaker import CircuitBreaker, acquire_breaker, release_breaker


def test_opens_after_consecutive_failures_then_lets_one_probe_through() -> None:
    breaker = CircuitBreaker(failures=2, open_s=30.0)
    breaker.failure("refused")
    assert breaker.allow()  # one failure: still closed
    breaker.success()
    breaker.failure("refused")
    assert breaker.allow()  # consecutive only: the success reset the count
    breaker.failure("timed out")
    assert not breaker.allow() and "circuit open after 2 consecutive failure(s)" in breaker.describe("http://x")
    assert "last error: timed out" in breaker.describe("http://x")
    assert breaker.opened_at is not None
    breaker.opened_at -= 31.0  # its open time is over: half-open
    assert breaker.allow() and not breaker.allow()  # one probe, the others still fail fast
    breaker.failure("refused")  # the probe failed: open again
    assert not breaker.allow()
    breaker.opened_at -= 31.0
    assert breaker.allow()
    breaker.success()  # the probe succeeded: closed
    assert breaker.allow() and breaker.allow()


def test_shared_per_endpoint_and_settings_and_forgotten_with_its_last_user() -> None:
    a = acquire_breaker("http://judge:8000", 5, 10.0)
    b = acquire_breaker("http://judge:8000", 5, 10.0)
    other = acquire_breaker("http://judge:8000", 3, 10.0)
    assert a is b and other is not a
    release_breaker("http://judge:8000", a)
    assert acquire_breaker("http://judge:8000", 5, 10.0) is b  # b still holds it
    release_breaker("http://judge:8000", b)
    release_breaker("http://judge:8000", b)
    fresh = acquire_breaker("http://judge:8000", 5, 10.0)
    assert fresh is not a  # forgotten with its last user: a fresh one
    release_breaker("http://judge:8000", fresh)
    release_breaker("http://judge:8000", other)


@pytest.mark.parametrize(("failures", "open_s"), [(0, 1.0), (1, 0.0)])
def test_bad_settings_are_refused(failures: int, open_s: float) -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(failures, open_s)

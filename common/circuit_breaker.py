"""Failing calls to a service fast while it is down, instead of every caller paying every retry: a circuit
breaker per endpoint, shared by everything in the process that calls that endpoint with the same settings."""

from __future__ import annotations

import time


class CircuitBreaker:
    """Closed: calls go through; ``failures`` consecutive failures open it. Open: calls fail at once for
    ``open_s``. Then half-open: one call goes through as a probe; its success closes the breaker, its failure
    opens it again. The caller decides what a failure is (for an HTTP service: connection errors, timeouts,
    5xx; any other answer means the endpoint is up)."""

    def __init__(self, failures: int, open_s: float) -> None:
        if failures < 1:
            raise ValueError(f"circuit breaker: failures must be >= 1, got {failures}")
        if not open_s > 0:
            raise ValueError(f"circuit breaker: open_s must be > 0, got {open_s}")
        self.threshold = failures
        self.open_s = open_s
        self.consecutive = 0
        self.opened_at: float | None = None
        self.probing = False
        self.last_error = ""

    def allow(self) -> bool:
        """Whether a call may go through now (in the half-open state, True once: that caller is the probe)."""
        if self.opened_at is None:
            return True
        if self.probing or time.monotonic() - self.opened_at < self.open_s:
            return False
        self.probing = True
        return True

    def success(self) -> None:
        self.consecutive, self.opened_at, self.probing = 0, None, False

    def failure(self, error: str) -> None:
        self.consecutive += 1
        self.last_error = error
        if self.probing or self.consecutive >= self.threshold:
            self.opened_at, self.probing = time.monotonic(), False

    def describe(self, endpoint: str) -> str:
        """Why calls to ``endpoint`` fail now, for the error a refused caller gets."""
        return (
            f"{endpoint} is failing: circuit open after {self.consecutive} consecutive failure(s), "
            f"retrying it in at most {self.open_s:g}s; last error: {self.last_error}"
        )


# Keyed by the settings too: callers that configure one endpoint differently do not inherit each other's.
_BREAKERS: dict[tuple[str, int, float], tuple[CircuitBreaker, int]] = {}


def acquire_breaker(endpoint: str, failures: int, open_s: float) -> CircuitBreaker:
    """The endpoint's shared breaker for these settings; pair each acquire with a `release_breaker` when its
    user closes."""
    key = (endpoint, failures, open_s)
    breaker, users = _BREAKERS.get(key) or (CircuitBreaker(failures, open_s), 0)
    _BREAKERS[key] = (breaker, users + 1)
    return breaker


def release_breaker(endpoint: str, breaker: CircuitBreaker) -> None:
    """Forget the breaker with its last user, so a later service at the same address starts closed."""
    key = (endpoint, breaker.threshold, breaker.open_s)
    held, users = _BREAKERS.get(key, (None, 0))
    if held is breaker:
        if users > 1:
            _BREAKERS[key] = (breaker, users - 1)
        else:
            del _BREAKERS[key]

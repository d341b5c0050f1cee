"""The rate limiter any client of an HTTP service can use (the LLM judge's, and a scheduler's pacing)."""

from __future__ import annotations

import asyncio

from rewardmesh.common.rate_limit import RateLimiter


async def test_starts_are_spaced_even_for_concurrent_callers() -> None:
    limiter = RateLimiter(requests_per_minute=1200)  # 50 ms apart
    loop = asyncio.get_running_loop()
    starts: list[float] = []

    async def one() -> None:
        await limiter.acquire()
        starts.append(loop.time())

    t0 = loop.time()
    await asyncio.gather(*(one() for _ in range(6)))
    # Lower bounds only: a loaded machine may wake a caller late, but never before its reserved slot.
    for i, start in enumerate(sorted(starts)):
        assert start - t0 >= i * 0.05 - 0.002, (i, start - t0)
    assert RateLimiter(0).interval == 0


async def test_delay_says_when_the_next_start_is_allowed_and_reserves_nothing() -> None:
    limiter = RateLimiter(requests_per_minute=60)  # 1 s apart
    assert limiter.delay() == 0.0  # nothing started yet: now
    await limiter.acquire()  # the first start goes at once, the next is a second away
    first = limiter.delay()
    assert 0.5 < first <= 1.0
    assert limiter.delay() <= first  # asking again reserved nothing: the wait only shrinks
    assert RateLimiter(0).delay() == 0.0

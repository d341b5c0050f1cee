"""Spacing requests to a service out in time: at most so many starts per minute, for any client of an HTTP (or
other) service that must not be sent more than it accepts."""

from __future__ import annotations

import asyncio


class RateLimiter:
    """Spaces request starts at least 60/requests_per_minute seconds apart (0 = unlimited).

    Each caller reserves the next free start time before awaiting, with no await between reading
    and advancing it, so concurrent callers on one event loop can never share a slot. Spacing
    rather than a token bucket: no burst at start-up for a service that is already loaded.
    """

    def __init__(self, requests_per_minute: float) -> None:
        self.interval = 60.0 / requests_per_minute if requests_per_minute > 0 else 0.0
        self._next_start = 0.0

    def delay(self) -> float:
        """Seconds until a start would be allowed, reserving nothing (0: now). A scheduler asks before it hands
        work over, so work waits in its own queue rather than in this limiter's."""
        if self.interval <= 0:
            return 0.0
        return max(0.0, self._next_start - asyncio.get_running_loop().time())

    async def acquire(self) -> None:
        """Reserve the next free start time and wait for it."""
        if self.interval <= 0:
            return
        now = asyncio.get_running_loop().time()
        start = max(now, self._next_start)
        self._next_start = start + self.interval
        if start > now:
            await asyncio.sleep(start - now)

"""Waiting for an eventual condition with a generous deadline, never sleeping a fixed time and hoping: the
test machine may be loaded many times over, so a fixed sleep that suffices on an idle one proves nothing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def eventually(
    condition: Callable[[], object],
    what: str,
    timeout_s: float = 60.0,
    *,
    poke: Callable[[], object] | None = None,
    every_s: float = 0.01,
) -> None:
    """Poll `condition` on the event loop until it holds; fail naming `what` after `timeout_s`. `poke`, when
    given, runs before each check: what the condition needs driven (a pick that starts a server's join)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if poke is not None:
            poke()
        if condition():
            return
        assert time.monotonic() < deadline, f"not within {timeout_s:g}s: {what}"
        await asyncio.sleep(every_s)


def wait_until(condition: Callable[[], object], what: str, timeout_s: float = 60.0) -> None:
    """`eventually` for synchronous tests (a condition another process or thread settles)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s:g}s: {what}"
        time.sleep(0.02)


async def holds_for(condition: Callable[[], object], what: str, seconds: float = 0.2) -> None:
    """Check that `condition` keeps holding for `seconds` (something that must NOT happen has no moment to wait
    for, so the test watches a window); fail naming `what` the moment it breaks."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert condition(), f"stopped holding within {seconds:g}s: {what}"
        await asyncio.sleep(0.01)
    assert condition(), f"stopped holding within {seconds:g}s: {what}"

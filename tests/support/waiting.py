"""Waiting for an eventual condition with a generous deadline, never sleeping a fixed time and hoping: the
test machine may be loaded many times over, so a fixed sleep that suffices on an idle one proves nothing.

A condition is evaluated, never taken on trust: `eventually` and `holds_for` await a condition that returns an
awaitable (an `async def` condition, a lambda calling one), and `wait_until`, which cannot await, refuses one
with a TypeError. A coroutine object is truthy, so taking it for the answer would pass without checking
anything."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable


def _refuse_awaitable(value: object, what: str, helper: str) -> None:
    if inspect.isawaitable(value):
        if inspect.iscoroutine(value):
            value.close()  # refused here, loudly: no "never awaited" warning on top
        raise TypeError(
            f"{helper}: the condition for {what!r} returned {type(value).__name__}, an awaitable it cannot "
            "evaluate; use `await eventually(...)` (or `holds_for`) in an async test"
        )


async def _evaluate(condition: Callable[[], object], what: str, helper: str) -> object:
    """The condition's value: awaited if it is awaitable, refused if what that gives is awaitable again."""
    value = condition()
    if inspect.isawaitable(value):
        value = await value
        _refuse_awaitable(value, what, helper)
    return value


async def eventually(
    condition: Callable[[], object],
    what: str,
    timeout_s: float = 60.0,
    *,
    poke: Callable[[], object] | None = None,
    every_s: float = 0.01,
) -> None:
    """Poll `condition` (sync or async) on the event loop until it holds; fail naming `what` after `timeout_s`.
    `poke`, when given, runs (and is awaited, if async) before each check: what the condition needs driven (a
    pick that starts a server's join)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if poke is not None:
            await _evaluate(poke, f"poke for {what}", "eventually")
        if await _evaluate(condition, what, "eventually"):
            return
        assert time.monotonic() < deadline, f"not within {timeout_s:g}s: {what}"
        await asyncio.sleep(every_s)


def wait_until(condition: Callable[[], object], what: str, timeout_s: float = 60.0) -> None:
    """`eventually` for synchronous tests (a condition another process or thread settles); a condition that
    returns an awaitable is a TypeError."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        _refuse_awaitable(value, what, "wait_until")
        if value:
            return
        assert time.monotonic() < deadline, f"not within {timeout_s:g}s: {what}"
        time.sleep(0.02)


async def holds_for(condition: Callable[[], object], what: str, seconds: float = 0.2) -> None:
    """Check that `condition` (sync or async) keeps holding for `seconds` (something that must NOT happen has no
    moment to wait for, so the test watches a window); fail naming `what` the moment it breaks."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert await _evaluate(condition, what, "holds_for"), f"stopped holding within {seconds:g}s: {what}"
        await asyncio.sleep(0.01)
    assert await _evaluate(condition, what, "holds_for"), f"stopped holding within {seconds:g}s: {what}"

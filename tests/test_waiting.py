"""The waiting helpers evaluate every condition they are given: an async one is awaited, and one they cannot
evaluate is a TypeError, so a test cannot pass by waiting on a coroutine object (which is always truthy)."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.waiting import eventually, holds_for, wait_until


async def test_eventually_awaits_an_async_condition_until_it_holds() -> None:
    checks: list[int] = []

    async def third_time() -> bool:
        await asyncio.sleep(0)
        checks.append(1)
        return len(checks) >= 3

    await eventually(third_time, "the third check holds", every_s=0)
    assert len(checks) == 3


async def test_eventually_fails_on_an_async_condition_that_never_holds() -> None:
    async def never() -> bool:
        return False

    with pytest.raises(AssertionError, match=r"not within 0\.05s: never"):
        await eventually(never, "never", timeout_s=0.05)


async def test_eventually_awaits_a_coroutine_returned_by_a_lambda_and_an_async_poke() -> None:
    pokes: list[int] = []

    async def poke() -> None:
        pokes.append(1)

    async def enough() -> bool:
        return len(pokes) >= 2

    await eventually(lambda: enough(), "two pokes", poke=poke, every_s=0)
    assert len(pokes) == 2


async def test_holds_for_awaits_an_async_condition_and_fails_when_it_breaks() -> None:
    state = {"up": True}

    async def up() -> bool:
        return state["up"]

    await holds_for(up, "up", seconds=0.03)
    state["up"] = False
    with pytest.raises(AssertionError, match="stopped holding"):
        await holds_for(up, "up", seconds=0.03)


async def test_a_condition_whose_awaited_value_is_awaitable_again_is_refused() -> None:
    async def inner() -> bool:
        return True

    async def outer() -> object:
        return inner()

    with pytest.raises(TypeError, match="cannot evaluate"):
        await eventually(outer, "nested")


def test_wait_until_refuses_an_async_condition_instead_of_taking_it_as_true() -> None:
    async def never() -> bool:
        return False

    with pytest.raises(TypeError, match="wait_until: the condition for 'never' returned coroutine"):
        wait_until(never, "never", timeout_s=5)


def test_wait_until_refuses_a_future() -> None:
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(TypeError, match="returned Future"):
            wait_until(loop.create_future, "a future")
    finally:
        loop.close()

"""Reading out a client stream that the server has already answered.

A server that answers while its client is still writing makes the client's next write fail, and grpc.aio then
reports that failed write (INTERNAL "Failed execute_batch SendMessageOperation") instead of the server's status:
the refusal of a bad tensor, or of a wrong token. Reading the rest of the stream first lets the status through."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

DRAIN_S = 5.0  # how long an answered client stream is read on, so its client hears why


async def drain(requests: AsyncIterator[Any], limit_s: float) -> None:
    """Read (and drop) what the client still sends. Bounded in time (and by the caller's message limits), so a
    client that never stops sending is cut off all the same."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(limit_s):
            async for _ in requests:
                pass

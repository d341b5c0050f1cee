"""A scriptable OpenAI-compatible chat-completions server for judge tests (aiohttp on 127.0.0.1:0).

``reply`` maps each request's JSON body to the judge's text, or to a Reply for HTTP errors,
garbage bodies and slow answers. The server records every request, its arrival time and the peak
number in flight, so tests assert on what the client really sent; a long-running load (a benchmark's judge)
turns the records off (``record=False``): a heap that grows with every request makes the collector's full
scans stall the server for longer and longer.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from aiohttp import web


@dataclass
class Reply:
    content: str = "Score: 5"
    status: int = 200
    raw_body: str | None = None  # sent verbatim instead of a chat-completion JSON
    delay_s: float = 0.0


ReplyFn = Callable[[dict[str, Any]], "str | Reply | Awaitable[str | Reply]"]


@dataclass
class Recorded:
    body: dict[str, Any]
    headers: dict[str, str]
    arrived: float  # time.monotonic()
    path: str
    connection: int  # the client's port: requests on one connection share it

    @property
    def user_message(self) -> str:
        return str(self.body["messages"][-1]["content"])


@dataclass
class FakeOpenAI:
    reply: ReplyFn | str | Reply = "Score: 5"
    requests: list[Recorded] = field(default_factory=list)
    record: bool = True  # keep each request in `requests` (False: only the counts)
    served: int = 0  # requests taken, recorded or not
    in_flight: int = 0
    peak_in_flight: int = 0
    dropped: int = 0  # requests whose client hung up before the reply: the server stopped working on them
    port: int = 0

    def __post_init__(self) -> None:
        self._stopping = asyncio.Event()
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _reply_for(self, body: dict[str, Any]) -> Reply:
        script = self.reply
        result: Any = script(body) if callable(script) else script
        if inspect.isawaitable(result):
            result = await result
        return result if isinstance(result, Reply) else Reply(content=str(result))

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.served += 1
        if self.record:
            peer = request.transport.get_extra_info("peername") if request.transport is not None else None
            port = int(peer[1]) if peer else 0
            self.requests.append(Recorded(body, dict(request.headers), time.monotonic(), request.path, port))
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            reply = await self._reply_for(body)
            if reply.delay_s > 0:
                # Ends early when the server stops, so a test's "hung judge" never delays teardown.
                try:
                    await asyncio.wait_for(self._stopping.wait(), reply.delay_s)
                except TimeoutError:
                    pass
            if reply.raw_body is not None:
                return web.Response(status=reply.status, text=reply.raw_body)
            payload = {
                "id": f"chatcmpl-{self.served}",
                "object": "chat.completion",
                "model": body.get("model", ""),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": reply.content},
                        "finish_reason": "stop",
                    }
                ],
            }
            return web.Response(status=reply.status, text=json.dumps(payload), content_type="application/json")
        except asyncio.CancelledError:
            self.dropped += 1
            raise
        finally:
            self.in_flight -= 1

    async def __aenter__(self) -> FakeOpenAI:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stopping.set()
        if self._runner is not None:
            await self._runner.cleanup()


class DroppingServer:
    """Accepts TCP connections and closes them at once: a connection error the client may retry,
    and unlike a closed port the server can count the attempts."""

    def __init__(self) -> None:
        self.connections = 0
        self.port = 0
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        writer.close()

    async def __aenter__(self) -> DroppingServer:
        self._server = await asyncio.start_server(self._on_connect, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

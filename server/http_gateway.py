"""HTTP gateway on the reward server: OpenRLHF's and slime's JSON, scored by the same RewardEngine as gRPC.

OpenRLHF (`--reward.remote_url http://HOST:PORT/get_reward`) posts `{"query": [...], "prompts": [...],
"labels": [...]}` and reads `{"rewards", "scores", "extra_logs"}`; slime (`--rm-type remote_rm --rm-url
http://HOST:PORT/score/PIPELINE`) posts `{"prompt", "response", "label"}` and keeps the JSON reply as the
reward (`--reward-key score`). Both retry on any HTTP error, so overload answers 503 with Retry-After.
A sample's error is reported as gRPC reports it: the status code name and a message naming the field.
The gateway calls the engine directly (no gRPC hop) and bypasses the servicer: it is a second front door.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import ssl
import time
from dataclasses import dataclass
from typing import Any

import grpc
from aiohttp import web

from rewardmesh.common.channels import read_token
from rewardmesh.reward_engine.engine import RewardEngine
from rewardmesh.reward_engine.errors import InvalidInput, QueueFull, RewardError, Unavailable
from rewardmesh.reward_engine.types import RewardInput
from rewardmesh.server.limits import DEFAULT_LIMITS, Limits, check, depth
from rewardmesh.server.status import SAMPLE_ERRORS, status_of

log = logging.getLogger(__name__)

TOKEN_ENV = "REWARDMESH_HTTP_TOKEN"
_C = grpc.StatusCode
# The HTTP status of every gRPC code (a test checks that none is missing), as HTTP clients read them; mostly
# the usual gRPC<->HTTP mapping. Deviations: RESOURCE_EXHAUSTED is 503, not 429, and FAILED_PRECONDITION
# (here only ever a failed dependency such as a judge endpoint, never the caller's fault) is 502 Bad Gateway.
_HTTP: dict[grpc.StatusCode, int] = {
    _C.OK: 200,
    _C.CANCELLED: 499,  # client closed request
    _C.UNKNOWN: 500,
    _C.INVALID_ARGUMENT: 400,
    _C.DEADLINE_EXCEEDED: 504,
    _C.NOT_FOUND: 404,
    _C.ALREADY_EXISTS: 409,
    _C.PERMISSION_DENIED: 403,
    _C.RESOURCE_EXHAUSTED: 503,
    _C.FAILED_PRECONDITION: 502,
    _C.ABORTED: 409,
    _C.OUT_OF_RANGE: 400,
    _C.UNIMPLEMENTED: 501,
    _C.INTERNAL: 500,
    _C.UNAVAILABLE: 503,
    _C.DATA_LOSS: 500,
    _C.UNAUTHENTICATED: 401,
}
# Errors that mean "busy or going away, retry the same request later or elsewhere": a request holding one is
# answered 503 with Retry-After as a whole, so OpenRLHF's and slime's retries apply and nothing is kept from
# it. Decided by the error, not its code: a sample over its memory budget is RESOURCE_EXHAUSTED too, but a
# retry would fail it again, so it stays that sample's error.
_BUSY = (QueueFull, Unavailable)
_MAX_BODY_BYTES = 64 * 1024 * 1024


def load_token(path: str = "", env: str = TOKEN_ENV) -> str | None:
    """The shared secret: the file's content (stripped) if a path is given, else the variable `env`, else None."""
    return read_token(path, env, "http_token_file")


def server_ssl_context(cert: str, key: str, ca: str = "") -> ssl.SSLContext | None:
    """TLS from the server's PEM files (the same ones gRPC uses); with a CA, clients must present a certificate."""
    if not (cert or key):
        return None
    if not (cert and key):
        raise ValueError("TLS needs both tls_cert and tls_key")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert, key)
        if ca:
            ctx.load_verify_locations(ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load the TLS files for the HTTP gateway: {exc}") from None
    return ctx


class _HttpError(Exception):
    """A whole-request failure, answered with this gRPC code's HTTP status."""

    def __init__(self, code: grpc.StatusCode, message: str, *, busy: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.busy = busy


@dataclass
class _Outcome:
    score: float | None = None
    extras: dict[str, float] | None = None
    code: grpc.StatusCode = grpc.StatusCode.OK
    message: str = ""
    busy: bool = False  # a _BUSY error: the whole request is answered 503 + Retry-After

    def error(self) -> dict[str, str] | None:
        return None if self.code == grpc.StatusCode.OK else {"code": self.code.name, "message": self.message}


def _error_response(code: grpc.StatusCode, message: str, *, busy: bool = False) -> web.Response:
    headers = {"Retry-After": "1"} if busy else None
    return web.json_response({"error": {"code": code.name, "message": message}}, status=_HTTP[code], headers=headers)


def _label_fields(label: Any, where: str) -> tuple[str, str, dict[str, Any]]:
    """(ground_truth, data_source, extra_info) from a label: a plain string, or a JSON object carrying them."""
    if label is None:
        return "", "", {}
    if isinstance(label, str):
        stripped = label.strip()
        if not stripped.startswith("{"):
            return label, "", {}
        try:
            label = json.loads(stripped)
        except json.JSONDecodeError:
            return label, "", {}
    if isinstance(label, dict):
        extra = label.get("extra_info") or {}
        if not isinstance(extra, dict):
            raise InvalidInput(f"{where}.extra_info must be an object, got {type(extra).__name__}")
        truth = label.get("ground_truth", label.get("label", ""))
        return str(truth if truth is not None else ""), str(label.get("data_source") or ""), extra
    if isinstance(label, int | float):
        return str(label), "", {}
    raise InvalidInput(f"{where} must be a string or an object, got {type(label).__name__}")


def _prompt_text(prompt: Any) -> str:
    """slime's prompt is a string or chat messages; rules and judges read the last user turn's text."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        if users and isinstance(users[-1], str):
            return users[-1]
    raise InvalidInput(f"prompt: expected a string or chat messages, got {type(prompt).__name__}")


def strip_prompt(query: str, prompt: str) -> str:
    """OpenRLHF sends prompt + response as one decoded string: the response is what follows the prompt."""
    if not prompt:
        return query
    if query.startswith(prompt):
        return query[len(prompt) :]
    at = query.find(prompt)  # a decoded BOS or chat-template prefix may stand before it
    return query[at + len(prompt) :] if at >= 0 else query


class HttpGateway:
    """aiohttp server beside the gRPC one, sharing its engine; `stop()` refuses new requests, then drains."""

    def __init__(
        self,
        engine: RewardEngine,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        default_pipeline: str = "",
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        timeout_s: float | None = None,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        self.engine = engine
        self.limits = limits  # the gRPC side's limits, applied here too: a second front door, not a way round them
        self.host = host
        self.requested_port = port
        self.default_pipeline = default_pipeline
        self.token = token
        self.ssl_context = ssl_context
        self.timeout_s = timeout_s
        self.port = 0
        self._ids = itertools.count()
        self._draining = False
        self._in_flight = 0
        app = web.Application(middlewares=[self._guard], client_max_size=_MAX_BODY_BYTES)
        app.router.add_post("/get_reward", self._openrlhf)
        app.router.add_post("/score/{pipeline}", self._slime)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, access_log=None)

    @property
    def url(self) -> str:
        scheme = "https" if self.ssl_context else "http"
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"{scheme}://{host}:{self.port}"

    async def start(self) -> int:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.requested_port, ssl_context=self.ssl_context)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        log.info("HTTP gateway (OpenRLHF /get_reward, slime /score/{pipeline}) on %s", self.url)
        return self.port

    async def stop(self, grace: float = 5.0) -> None:
        self._draining = True
        deadline = time.monotonic() + grace
        while self._in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await self._runner.cleanup()

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Bearer-token check, drain refusal, and whole-request errors as JSON."""
        if self.token is not None and request.path != "/health":  # probes need no secret, as gRPC health
            auth = request.headers.get("Authorization", "")
            given = auth[7:] if auth.startswith("Bearer ") else ""
            if not hmac.compare_digest(given.encode(), self.token.encode()):
                reason = "invalid bearer token" if given else "missing 'Authorization: Bearer <token>' header"
                return _error_response(grpc.StatusCode.UNAUTHENTICATED, reason)
        if self._draining and request.path != "/health":
            message = "reward server is draining; retry on another one"
            return _error_response(grpc.StatusCode.UNAVAILABLE, message, busy=True)
        self._in_flight += 1
        try:
            response: web.StreamResponse = await handler(request)
            return response
        except _HttpError as exc:
            return _error_response(exc.code, str(exc), busy=exc.busy)
        except web.HTTPException:  # aiohttp's own answers (no such route, body too large)
            raise
        except Exception as exc:  # a bug: still JSON with the exception named, like gRPC's INTERNAL
            return _error_response(*status_of(exc))
        finally:
            self._in_flight -= 1

    async def _health(self, request: web.Request) -> web.Response:
        if self._draining:
            return _error_response(grpc.StatusCode.UNAVAILABLE, "draining", busy=True)
        if self.token is not None:  # open to probes: the status only, not what the server offers
            return web.json_response({"status": "SERVING"})
        return web.json_response({"status": "SERVING", "pipelines": sorted(self.engine.pipelines)})

    async def _json(self, request: web.Request) -> Any:
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise _HttpError(grpc.StatusCode.INVALID_ARGUMENT, f"body: not valid JSON: {exc}") from None

    def _input(
        self, prompt: str, response: str, label: Any, where: str, names: tuple[str, str] = ("", "")
    ) -> RewardInput:
        """One input, within the server's size limits; `names` are the prompt's and response's JSON fields."""
        import numpy as np

        truth, source, extra = _label_fields(label, f"{where}.label")
        lim = self.limits
        texts = (
            (names[0] or "prompt", prompt),
            (names[1] or "response", response),
            (where, truth),
            ("data_source", source),
        )
        for name, text in texts:
            check(len(text), lim.max_text_chars, f"{name} length", "max_text_chars")
        if extra:
            size = len(json.dumps(extra, default=str))
            check(size, lim.max_extra_info_bytes, f"{where}.extra_info size", "max_extra_info_bytes")
            nested = depth(extra, lim.max_extra_info_depth)
            check(nested, lim.max_extra_info_depth, f"{where}.extra_info nesting depth", "max_extra_info_depth")
        empty = np.zeros(0, dtype=np.int32)
        return RewardInput(
            sample_id=f"http-{next(self._ids)}",
            prompt_ids=empty,
            response_ids=empty,
            prompt_text=prompt,
            response_text=response,
            data_source=source,
            ground_truth=truth,
            extra_info=extra,
        )

    async def _score(self, pipeline_name: str, inputs: list[RewardInput | _Outcome]) -> list[_Outcome]:
        """Score every input at once on the named pipeline; inputs that failed to parse pass through."""
        try:
            pipeline = self.engine.get(pipeline_name)
        except RewardError as exc:
            raise _HttpError(*status_of(exc)) from None
        deadline = time.monotonic() + self.timeout_s if self.timeout_s else None

        async def one(inp: RewardInput | _Outcome) -> _Outcome:
            if isinstance(inp, _Outcome):
                return inp
            try:
                scored = await pipeline.score(inp, deadline=deadline)
            except SAMPLE_ERRORS as exc:  # any failure is this sample's error (an unexpected one: INTERNAL)
                code, message = status_of(exc)
                return _Outcome(code=code, message=message, busy=isinstance(exc, _BUSY))
            return _Outcome(score=scored.output.score, extras=dict(scored.output.extras))

        outcomes = list(await asyncio.gather(*(one(i) for i in inputs)))
        busy = next((o for o in outcomes if o.busy), None)
        if busy is not None:  # the client retries the request; nothing it would keep was lost
            raise _HttpError(busy.code, busy.message, busy=True)
        return outcomes

    def _parse(self, where: str, make: Any, *args: Any) -> RewardInput | _Outcome:
        """`make(*args)`'s input; a malformed sample is that sample's INVALID_ARGUMENT, never the whole request's."""
        try:
            result: RewardInput = make(*args)
            return result
        except (InvalidInput, ValueError) as exc:
            code, message = status_of(exc)
            return _Outcome(code=code, message=f"{where}{message}")

    async def _openrlhf(self, request: web.Request) -> web.Response:
        """OpenRLHF's remote reward: a batch of prompt+response strings, prompts, and labels."""
        body = await self._json(request)
        if not isinstance(body, dict):
            raise _HttpError(grpc.StatusCode.INVALID_ARGUMENT, "body: expected a JSON object with 'query'")
        queries = body.get("query")
        if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
            raise _HttpError(grpc.StatusCode.INVALID_ARGUMENT, "query: expected a list of strings (prompt + response)")
        n = len(queries)
        check(n, self.limits.max_samples_per_request, "query: number of items", "max_samples_per_request")
        prompts: Any = body.get("prompts") if body.get("prompts") is not None else [""] * n
        labels: Any = body.get("labels") if body.get("labels") is not None else [None] * n
        for name, values in (("prompts", prompts), ("labels", labels)):
            if not isinstance(values, list) or len(values) != n:
                got = len(values) if isinstance(values, list) else type(values).__name__
                raise _HttpError(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: expected a list of {n} items, got {got}")
        pipeline = request.query.get("pipeline") or str(body.get("pipeline") or "") or self.default_pipeline

        def make(i: int) -> RewardInput:
            prompt = prompts[i]
            if not isinstance(prompt, str):
                raise InvalidInput(f"prompts[{i}] must be a string, got {type(prompt).__name__}")
            response = strip_prompt(queries[i], prompt)
            return self._input(prompt, response, labels[i], f"labels[{i}]", (f"prompts[{i}]", f"query[{i}]"))

        inputs = [self._parse("", make, i) for i in range(n)]
        outcomes = await self._score(pipeline, inputs)
        keys = sorted({k for o in outcomes for k in (o.extras or {})})
        rewards = [o.score for o in outcomes]
        return web.json_response(
            {
                "rewards": rewards,
                "scores": rewards,
                "extra_logs": {k: [(o.extras or {}).get(k) for o in outcomes] for k in keys},
                "errors": [o.error() for o in outcomes],
            }
        )

    async def _slime(self, request: web.Request) -> web.Response:
        """slime's remote_rm: one {prompt, response, label} (or a list of them); the reply is kept as the reward."""
        body = await self._json(request)
        single = isinstance(body, dict)
        items = [body] if single else body
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            raise _HttpError(
                grpc.StatusCode.INVALID_ARGUMENT, "body: expected {prompt, response, label} or a list of them"
            )
        check(len(items), self.limits.max_samples_per_request, "body: number of items", "max_samples_per_request")

        def make(item: dict[str, Any]) -> RewardInput:
            response = item.get("response")
            if not isinstance(response, str):
                raise InvalidInput(f"response: expected a string, got {type(response).__name__}")
            label: Any = item.get("label")
            extra = item.get("extra_info") or item.get("metadata")
            if item.get("data_source") or extra:
                truth, _, _ = _label_fields(label, "label")
                label = {"ground_truth": truth, "data_source": item.get("data_source", ""), "extra_info": extra or {}}
            return self._input(_prompt_text(item.get("prompt", "")), response, label, "label")

        inputs = [self._parse("" if single else f"[{i}].", make, item) for i, item in enumerate(items)]
        outcomes = await self._score(request.match_info["pipeline"], inputs)
        replies: list[dict[str, Any]] = []
        for o in outcomes:
            if o.code != grpc.StatusCode.OK:
                if single:
                    return _error_response(o.code, o.message, busy=o.busy)
                replies.append({"score": None, "error": o.error()})
            else:
                replies.append({**(o.extras or {}), "score": o.score})
        return web.json_response(replies[0] if single else replies)

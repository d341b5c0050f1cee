"""HTTP gateway on the reward server: OpenRLHF's and slime's JSON, scored by the same RewardEngine as gRPC.

OpenRLHF (`--reward.remote_url http://HOST:PORT/get_reward`) posts `{"query": [...], "prompts": [...],
"labels": [...]}` and reads `{"rewards", "scores", "extra_logs"}`; slime (`--rm-type remote_rm --rm-url
http://HOST:PORT/score/PIPELINE`) posts `{"prompt", "response", "label"}` and keeps the JSON reply as the
reward (`--reward-key score`). A sample's error is reported as gRPC reports it: the status code name and a
message naming the field, also in the HTTP reason phrase (what both frameworks log).

Both frameworks retry every failed request, so the status is chosen for clients that retry only what another
try can fix: busy or draining is 503 with Retry-After; a sample that cannot be scored (bad input, a failing
reward function) is 4xx, at once. Neither framework can take a null reward, so a failed sample is never one
in their shapes: the request fails, or, with `?error_score=X` in the URL, the sample scores X and is flagged
by `rewardmesh_error`. Extras in OpenRLHF's `extra_logs` are the pipeline's announced keys (ListRewards),
NaN where a sample has none, so every request carries the same keys.

Auth is the gRPC server's policy (a gateway token, else the gRPC token: never open while gRPC is closed),
from an `Authorization: Bearer` header or, for clients that can send only a URL, from the path
(`/t/TOKEN/get_reward`). The gateway calls the engine directly (no gRPC hop): it is a second front door.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import math
import ssl
import time
from dataclasses import dataclass
from typing import Any

import grpc
from aiohttp import web

from rewardmesh.client.integrations.scoring import ERROR_KEY, label_fields
from rewardmesh.common.channels import auth_token, read_token
from rewardmesh.common.errors import InvalidInput, QueueFull, RewardError, Unavailable
from rewardmesh.reward_engine.engine import RewardEngine
from rewardmesh.reward_engine.ticket import Ticket
from rewardmesh.reward_engine.types import RewardInput
from rewardmesh.server.limits import DEFAULT_LIMITS, Limits, check, depth
from rewardmesh.server.reward.run_code import RunCode
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
# Every scoring route is also served under this prefix, for clients that can send a URL but no header.
TOKEN_PREFIX = "/t/{rm_token}"


def load_token(path: str = "", env: str = TOKEN_ENV) -> str | None:
    """The shared secret: the file's content (stripped) if a path is given, else the variable `env`, else None."""
    return read_token(path, env, "http_token_file")


def gateway_token(http_token_file: str = "", grpc_token_file: str = "") -> str | None:
    """The gateway's token: its own, else the gRPC server's, so a server closed on gRPC is never open on HTTP."""
    token = load_token(http_token_file)
    if token is None:
        token = auth_token(grpc_token_file)
        if token is not None:
            log.info("HTTP gateway: no http_token_file or %s set; it requires the gRPC auth token", TOKEN_ENV)
    return token


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
class _SampleReply:
    """What the gateway answers for one sample: its score and extras, or the status it failed with."""

    score: float | None = None
    extras: dict[str, float] | None = None
    code: grpc.StatusCode = grpc.StatusCode.OK
    message: str = ""
    busy: bool = False  # a _BUSY error: the whole request is answered 503 + Retry-After

    def error(self) -> dict[str, str] | None:
        return None if self.code == grpc.StatusCode.OK else {"code": self.code.name, "message": self.message}


def _reason(code: grpc.StatusCode, message: str) -> str:
    """The HTTP reason phrase: what OpenRLHF's and slime's clients log of a failed request (one latin-1 line)."""
    text = " ".join(f"{code.name}: {message}".split())[:300]
    return text.encode("latin-1", "replace").decode("latin-1")


def _error_response(
    code: grpc.StatusCode, message: str, *, busy: bool = False, status: int = 0, body: dict[str, Any] | None = None
) -> web.Response:
    headers = {"Retry-After": "1"} if busy else None
    payload = {"error": {"code": code.name, "message": message}, **(body or {})}
    return web.json_response(payload, status=status or _HTTP[code], headers=headers, reason=_reason(code, message))


def _sample_status(outcome: _SampleReply) -> int:
    """A sample that cannot be scored is the caller's to fix or drop, not a retry: 4xx (its own code's status
    where that is 4xx, else 422); a failed dependency (502) or a deadline (504) keep theirs."""
    status = _HTTP[outcome.code]
    return 422 if status in (500, 503) else status


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
        self.app = web.Application(middlewares=[self._guard], client_max_size=_MAX_BODY_BYTES)
        self.app.router.add_get("/health", self._health)
        self.route("POST", "/get_reward", self._openrlhf)
        self.route("POST", "/score/{pipeline}", self._slime)
        self.route("POST", "/run_code", RunCode(engine).handle)  # SandboxFusion's API, for verl's client
        self._runner: web.AppRunner | None = None

    def route(self, method: str, path: str, handler: Any) -> None:
        """Serve `handler` at `path`, behind the gateway's auth and drain, and at TOKEN_PREFIX + `path`."""
        self.app.router.add_route(method, path, handler)
        self.app.router.add_route(method, TOKEN_PREFIX + path, handler)

    @property
    def url(self) -> str:
        scheme = "https" if self.ssl_context else "http"
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"{scheme}://{host}:{self.port}"

    async def start(self) -> int:
        self._runner = web.AppRunner(self.app, access_log=None)  # no access log: a path may carry the token
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.requested_port, ssl_context=self.ssl_context)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        log.info("HTTP gateway (OpenRLHF /get_reward, slime /score/{pipeline}) on %s", self.url)
        if self.token is None:
            log.info("HTTP gateway: no token configured; anyone who can reach %s can score", self.url)
        elif self.ssl_context is None:
            log.warning("HTTP gateway: a token without TLS travels in clear text; set tls_cert and tls_key")
        return self.port

    def begin_drain(self) -> None:
        """From now on /health answers 503 and new requests 503 + Retry-After (in step with gRPC NOT_SERVING)."""
        self._draining = True

    async def drain(self) -> None:
        """Refuse new work and wait until the requests in flight are answered (the caller bounds the wait)."""
        self.begin_drain()
        while self._in_flight:
            await asyncio.sleep(0.01)

    async def stop(self, grace: float = 5.0) -> None:
        try:
            await asyncio.wait_for(self.drain(), grace)
        except TimeoutError:
            log.warning("HTTP gateway: %d requests still in flight after %.1fs; closing", self._in_flight, grace)
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Bearer-token check, drain refusal, and whole-request errors as JSON."""
        if self.token is not None and request.path != "/health":  # probes need no secret, as gRPC health
            auth = request.headers.get("Authorization", "")
            given = auth[7:] if auth.startswith("Bearer ") else request.match_info.get("rm_token", "")
            if not hmac.compare_digest(given.encode(), self.token.encode()):
                reason = (
                    "invalid token"
                    if given
                    else "missing token: send 'Authorization: Bearer <token>' or put it in the path (/t/<token>/...)"
                )
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
            return _error_response(grpc.StatusCode.UNAVAILABLE, "draining", busy=True, body={"status": "NOT_SERVING"})
        if self.token is not None:  # open to probes: the status only, not what the server offers
            return web.json_response({"status": "SERVING"})
        return web.json_response({"status": "SERVING", "pipelines": sorted(self.engine.pipelines)})

    async def _json(self, request: web.Request) -> Any:
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise _HttpError(grpc.StatusCode.INVALID_ARGUMENT, f"body: not valid JSON: {exc}") from None
        except RecursionError:
            raise _HttpError(grpc.StatusCode.INVALID_ARGUMENT, "body: JSON nested too deeply") from None

    @staticmethod
    def _error_score(request: web.Request) -> float | None:
        """`?error_score=X`: a failed sample scores X (flagged by rewardmesh_error) instead of failing the request."""
        raw = request.query.get("error_score")
        if raw is None:
            return None
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise _HttpError(grpc.StatusCode.INVALID_ARGUMENT, f"error_score: expected a finite number, got {raw!r}")
        return value

    def _input(
        self, prompt: str, response: str, label: Any, where: str, names: tuple[str, str] = ("", "")
    ) -> RewardInput:
        """One input, within the server's size limits; `names` are the prompt's and response's JSON fields."""
        import numpy as np

        truth, source, extra = label_fields(label, f"{where}.label")
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

    def _pipeline(self, name: str) -> Any:
        try:
            return self.engine.get(name)
        except RewardError as exc:
            raise _HttpError(*status_of(exc)) from None

    async def _score(self, pipeline_name: str, inputs: list[RewardInput | _SampleReply]) -> list[_SampleReply]:
        """Score every input at once on the named pipeline; inputs that failed to parse pass through."""
        pipeline = self._pipeline(pipeline_name)
        deadline = time.monotonic() + self.timeout_s if self.timeout_s else None

        async def one(inp: RewardInput | _SampleReply) -> _SampleReply:
            if isinstance(inp, _SampleReply):
                return inp
            try:
                scored = await pipeline.add(Ticket(inp, deadline=deadline)).future
            except SAMPLE_ERRORS as exc:  # any failure is this sample's error (an unexpected one: INTERNAL)
                code, message = status_of(exc)
                return _SampleReply(code=code, message=message, busy=isinstance(exc, _BUSY))
            return _SampleReply(score=scored.output.score, extras=dict(scored.output.extras))

        outcomes = list(await asyncio.gather(*(one(i) for i in inputs)))
        busy = next((o for o in outcomes if o.busy), None)
        if busy is not None:  # the client retries the request; nothing it would keep was lost
            raise _HttpError(busy.code, busy.message, busy=True)
        return outcomes

    def _parse(self, where: str, make: Any, *args: Any) -> RewardInput | _SampleReply:
        """`make(*args)`'s input; a malformed sample is that sample's INVALID_ARGUMENT, never the whole request's."""
        try:
            result: RewardInput = make(*args)
            return result
        except RecursionError:
            return _SampleReply(code=grpc.StatusCode.INVALID_ARGUMENT, message=f"{where}label: nested too deeply")
        except Exception as exc:  # whatever one sample's fields hold fails that sample only
            message = str(exc) if isinstance(exc, ValueError) else f"cannot read it: {type(exc).__name__}: {exc}"
            return _SampleReply(code=grpc.StatusCode.INVALID_ARGUMENT, message=f"{where}{message}")

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
        error_score = self._error_score(request)
        keys = self._pipeline(pipeline).extra_keys

        def make(i: int) -> RewardInput:
            prompt = prompts[i]
            if not isinstance(prompt, str):
                raise InvalidInput(f"prompts[{i}] must be a string, got {type(prompt).__name__}")
            response = strip_prompt(queries[i], prompt)
            return self._input(prompt, response, labels[i], f"labels[{i}]", (f"prompts[{i}]", f"query[{i}]"))

        inputs = [self._parse("", make, i) for i in range(n)]
        outcomes = await self._score(pipeline, inputs)
        failed = [o for o in outcomes if o.code != grpc.StatusCode.OK]
        rewards = [o.score if o.code == grpc.StatusCode.OK else error_score for o in outcomes]
        extra_logs = {k: [(o.extras or {}).get(k, math.nan) for o in outcomes] for k in keys}
        extra_logs[ERROR_KEY] = [0.0 if o.code == grpc.StatusCode.OK else 1.0 for o in outcomes]
        errors = [o.error() for o in outcomes]
        body = {"rewards": rewards, "scores": rewards, "extra_logs": extra_logs, "errors": errors}
        if failed and error_score is None:  # a null reward would crash OpenRLHF: the request fails, saying why
            first = failed[0]
            where = f"query[{outcomes.index(first)}]: "
            return _error_response(first.code, where + first.message, status=_sample_status(first), body=body)
        return web.json_response(body)

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
                truth, _, _ = label_fields(label, "label")
                label = {"ground_truth": truth, "data_source": item.get("data_source", ""), "extra_info": extra or {}}
            return self._input(_prompt_text(item.get("prompt", "")), response, label, "label")

        error_score = self._error_score(request)
        inputs = [self._parse("" if single else f"[{i}].", make, item) for i, item in enumerate(items)]
        outcomes = await self._score(request.match_info["pipeline"], inputs)
        replies: list[dict[str, Any]] = []
        for o in outcomes:
            if o.code == grpc.StatusCode.OK:
                replies.append({**(o.extras or {}), "score": o.score})
            elif error_score is not None:
                replies.append({"score": error_score, ERROR_KEY: 1.0, "error": o.error()})
            elif single:  # slime keeps any 200 reply as the reward: a failure must not be one
                return _error_response(o.code, o.message, status=_sample_status(o))
            else:
                replies.append({"score": None, "error": o.error()})
        return web.json_response(replies[0] if single else replies)

"""Optional bearer-token auth on every gRPC service: a shared secret checked in a server interceptor.

With a token configured (server option ``auth_token_file``, or ``REWARDMESH_AUTH_TOKEN``), every call must
carry ``authorization: Bearer <token>`` metadata or it is answered UNAUTHENTICATED before any handler runs.
grpc.health.v1 stays open, so Kubernetes' probes need no secret. It works beside mutual TLS (which
authenticates the peer's certificate) and is checked per call, not per message, so a long-lived stream
pays for it once. Clients send the token from the same variables (common/channels.py).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc import aio

from rewardmesh.common.streams import DRAIN_S, drain

# Open without a token: liveness and readiness probes.
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


class BearerTokenInterceptor(aio.ServerInterceptor):
    """Refuses a call whose metadata lacks the right bearer token (UNAUTHENTICATED), health excepted."""

    def __init__(self, token: str | Sequence[str]) -> None:
        tokens = [token] if isinstance(token, str) else list(token)
        if not tokens or not all(tokens):
            raise ValueError("auth: the token is empty")
        self._expected = [f"Bearer {t}".encode() for t in tokens]  # the shared token, and each tenant's

    def _allowed(self, details: grpc.HandlerCallDetails) -> bool:
        method = details.method or ""
        if method.startswith(OPEN_PREFIXES):
            return True
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else bytes(value)
                # every token compared (a list, not a short-circuit), so the time says nothing of which matched
                return any([hmac.compare_digest(given, expected) for expected in self._expected])
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if self._allowed(handler_call_details):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        return _refusing(handler)


_MESSAGE = "missing or wrong bearer token: send 'authorization: Bearer <token>' (REWARDMESH_AUTH_TOKEN)"


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape that answers UNAUTHENTICATED without reading the request."""

    async def unary(request: Any, context: aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _MESSAGE)

    async def stream_in(requests: Any, context: aio.ServicerContext) -> Any:
        # A client that is still writing when the refusal comes would hear of a failed write, not of the
        # refusal (see `drain`): its stream ends by itself (UpdateWeights' last chunk), so it is read out first.
        await drain(requests, DRAIN_S)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _MESSAGE)

    async def stream(request: Any, context: aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _MESSAGE)
        yield  # pragma: no cover - makes this an async generator, as a streaming handler must be

    kwargs: dict[str, Any] = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(stream_in, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, **kwargs)
    return grpc.stream_stream_rpc_method_handler(stream, **kwargs)

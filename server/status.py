"""The one place where exceptions become gRPC status codes: per-sample errors and whole-RPC aborts alike."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc import aio

from rewardmesh.common import errors
from rewardmesh.v1 import common_pb2

log = logging.getLogger(__name__)

_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (errors.InvalidInput, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.UnknownReward, grpc.StatusCode.NOT_FOUND),
    (errors.QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.SourceFailed, grpc.StatusCode.INTERNAL),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.Cancelled, grpc.StatusCode.CANCELLED),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.DependencyFailed, grpc.StatusCode.FAILED_PRECONDITION),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),  # decoding errors name their field
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
]

# What every per-sample path (Score, ScoreBatch, Generate) catches: anything but cancellation. A known
# error keeps its code; anything unexpected (an OverflowError in a tokenizer, a bug) is that one sample's
# INTERNAL error with the exception's type and message, never a lost result or a hung stream.
SAMPLE_ERRORS: tuple[type[Exception], ...] = (Exception,)


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The code and message for an exception; bad input is `errors.InvalidInput` (a plain ValueError is a bug)."""
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code, str(exc) or cls.__name__
    log.warning("unexpected error: %s: %s", type(exc).__name__, exc, exc_info=log.isEnabledFor(logging.DEBUG))
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def status_proto(exc: BaseException) -> common_pb2.Status:
    code, message = status_of(exc)
    return common_pb2.Status(code=code.value[0], message=message)


class ExceptionToStatusInterceptor(aio.ServerInterceptor):
    """Turns an exception escaping a handler into the matching status instead of UNKNOWN."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        streaming_in = bool(handler.stream_unary or handler.stream_stream)
        kwargs: dict[str, Any] = {
            "request_deserializer": _tolerant(handler.request_deserializer, streaming_in),
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_wrap_unary(handler.unary_unary), **kwargs)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(_wrap_unary(handler.stream_unary), **kwargs)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_wrap_stream(handler.unary_stream), **kwargs)
        return grpc.stream_stream_rpc_method_handler(_wrap_stream(handler.stream_stream), **kwargs)


class _Undecodable:
    """A unary request whose bytes are not the message: gRPC would answer UNKNOWN before our handler runs,
    so the deserializer hands this over and the handler answers INVALID_ARGUMENT."""

    __slots__ = ("error",)

    def __init__(self, error: errors.InvalidInput) -> None:
        self.error = error


def _tolerant(deserializer: Any, streaming_in: bool) -> Any:
    """Bytes that do not parse are INVALID_ARGUMENT: raised inside the handler for a request stream (read
    there), handed over as _Undecodable for a unary request (decoded before the handler runs)."""
    if deserializer is None:
        return None

    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:
            error = errors.InvalidInput(f"request: not a valid protobuf message ({exc})")
            if streaming_in:
                raise error from None
            return _Undecodable(error)

    return decode


async def _abort(context: aio.ServicerContext, exc: Exception) -> None:
    code, message = status_of(exc)
    await context.abort(code, message)


def _wrap_unary(fn: Any) -> Any:
    async def wrapped(request: Any, context: aio.ServicerContext) -> Any:
        try:
            if isinstance(request, _Undecodable):
                raise request.error
            return await fn(request, context)
        except aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, exc)

    return wrapped


def _wrap_stream(fn: Any) -> Any:
    async def wrapped(request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            if isinstance(request, _Undecodable):
                raise request.error
            async for response in fn(request, context):
                yield response
        except aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, exc)

    return wrapped

"""The one way clients open channels: message limits, keepalive, tracing interceptors, and TLS from the environment.

TLS (mutual when a client certificate is given) comes from REWARDMESH_TLS_CA, REWARDMESH_TLS_CERT and
REWARDMESH_TLS_KEY, the same variables the servers read. Clients dial pod addresses, so the
certificate is checked against REWARDMESH_TLS_SERVER_NAME, else the host of the dns:/// target.

A bearer token (the servers' optional auth, server/auth.py) comes from REWARDMESH_AUTH_TOKEN_FILE, else
REWARDMESH_AUTH_TOKEN. Over TLS it rides as call credentials (no per-message cost); on a plaintext channel
gRPC refuses call credentials, so an interceptor adds it, which grpc.aio pays on every message of a
stream: use tokens with TLS (a token on plaintext also travels in the clear).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

from rewardmesh.common.telemetry import client_interceptors


def channel_options(max_message_mb: int = 64) -> list[tuple[str, Any]]:
    size = max_message_mb * 1024 * 1024
    return [
        ("grpc.max_send_message_length", size),
        ("grpc.max_receive_message_length", size),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_permit_without_calls", 1),
        # A restarted pod should get work again within the pool's own backoff, not gRPC's default 1-120 s
        # reconnect schedule: the pool already spaces retries out per address.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 5_000),
        ("grpc.use_local_subchannel_pool", 1),
    ]


def _read(var: str) -> bytes | None:
    path = os.environ.get(var)
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{var}={path}: cannot read it: {exc}") from None


TOKEN_ENV = "REWARDMESH_AUTH_TOKEN"
TOKEN_FILE_ENV = "REWARDMESH_AUTH_TOKEN_FILE"


def read_token(path: str, env: str, what: str) -> str | None:
    """A shared secret: the file's content (stripped) if ``path``, else the variable ``env``, else None.
    An unreadable or empty file is a ValueError naming ``what`` (the option that named the file)."""
    if path:
        try:
            token = Path(path).read_text().strip()
        except OSError as exc:
            raise ValueError(f"{what}={path}: cannot read it: {exc}") from None
        if not token:
            raise ValueError(f"{what}={path} is empty")
        return token
    return os.environ.get(env, "").strip() or None


def auth_token(path: str = "") -> str | None:
    """The gRPC bearer token: the file ``path``, else $REWARDMESH_AUTH_TOKEN_FILE, else $REWARDMESH_AUTH_TOKEN,
    else None (no auth)."""
    return read_token(path or os.environ.get(TOKEN_FILE_ENV, ""), TOKEN_ENV, "auth token file")


def _with_token(details: aio.ClientCallDetails, header: tuple[str, str]) -> aio.ClientCallDetails:
    metadata = aio.Metadata(*(details.metadata or ()))
    metadata.add(*header)
    return aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials, details.wait_for_ready)


class _TokenUnaryUnary(aio.UnaryUnaryClientInterceptor):
    def __init__(self, header: tuple[str, str]) -> None:
        self.header = header

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self.header), request)


class _TokenUnaryStream(aio.UnaryStreamClientInterceptor):
    def __init__(self, header: tuple[str, str]) -> None:
        self.header = header

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self.header), request)


class _TokenStreamUnary(aio.StreamUnaryClientInterceptor):
    def __init__(self, header: tuple[str, str]) -> None:
        self.header = header

    async def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(_with_token(details, self.header), request_iterator)


class _TokenStreamStream(aio.StreamStreamClientInterceptor):
    def __init__(self, header: tuple[str, str]) -> None:
        self.header = header

    async def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(_with_token(details, self.header), request_iterator)


def token_interceptors(token: str) -> list[Any]:
    header = ("authorization", f"Bearer {token}")
    return [_TokenUnaryUnary(header), _TokenUnaryStream(header), _TokenStreamUnary(header), _TokenStreamStream(header)]


def open_channel(
    address: str, *, server_name: str = "", max_message_mb: int = 64, rpc_spans: bool = True, token: str | None = None
) -> aio.Channel:
    """`rpc_spans=False`: no OpenTelemetry interceptors, for channels whose traffic is a hot stream (grpc.aio
    routes every message of every call on an intercepted channel through extra Python, filtered or not).
    `token`: this channel's bearer token (e.g. a tenant's), instead of the one from the environment."""
    options = channel_options(max_message_mb)
    interceptors = client_interceptors() if rpc_spans else []
    token = token or auth_token()
    ca = _read("REWARDMESH_TLS_CA")
    if ca is None:
        if token:
            interceptors = [*interceptors, *token_interceptors(token)]
        return aio.insecure_channel(address, options=options, interceptors=interceptors)
    creds = grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=_read("REWARDMESH_TLS_KEY"),
        certificate_chain=_read("REWARDMESH_TLS_CERT"),
    )
    if token:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    name = os.environ.get("REWARDMESH_TLS_SERVER_NAME") or server_name
    if name:
        options.append(("grpc.ssl_target_name_override", name))
    return aio.secure_channel(address, creds, options=options, interceptors=interceptors)

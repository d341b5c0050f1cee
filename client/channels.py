"""The one way clients open channels: message limits, keepalive, tracing interceptors, and TLS from the environment.

TLS (mutual when a client certificate is given) comes from REWARDMESH_TLS_CA, REWARDMESH_TLS_CERT and
REWARDMESH_TLS_KEY, the same variables the servers read. Clients dial pod addresses, so the
certificate is checked against REWARDMESH_TLS_SERVER_NAME, else the host of the dns:/// target.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

from client.telemetry import client_interceptors


def channel_options(max_message_mb: int = 64) -> list[tuple[str, Any]]:
    size = max_message_mb * 1024 * 1024
    return [
        ("grpc.max_send_message_length", size),
        ("grpc.max_receive_message_length", size),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def _read(var: str) -> bytes | None:
    path = os.environ.get(var)
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{var}={path}: cannot read it: {exc}") from None


def open_channel(
    address: str, *, server_name: str = "", max_message_mb: int = 64, rpc_spans: bool = True
) -> aio.Channel:
    """`rpc_spans=False`: no OpenTelemetry interceptors, for channels whose traffic is a hot stream (grpc.aio
    routes every message of every call on an intercepted channel through extra Python, filtered or not)."""
    options = channel_options(max_message_mb)
    interceptors = client_interceptors() if rpc_spans else []
    ca = _read("REWARDMESH_TLS_CA")
    if ca is None:
        return aio.insecure_channel(address, options=options, interceptors=interceptors)
    creds = grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=_read("REWARDMESH_TLS_KEY"),
        certificate_chain=_read("REWARDMESH_TLS_CERT"),
    )
    name = os.environ.get("REWARDMESH_TLS_SERVER_NAME") or server_name
    if name:
        options.append(("grpc.ssl_target_name_override", name))
    return aio.secure_channel(address, creds, options=options, interceptors=interceptors)

"""What every rewardmesh server shares: channel options, health, reflection, interceptors, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc import aio
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rewardmesh.common.channels import auth_token
from rewardmesh.common.telemetry import server_interceptors
from rewardmesh.server.auth import BearerTokenInterceptor
from rewardmesh.server.limits import Limits
from rewardmesh.server.status import ExceptionToStatusInterceptor

log = logging.getLogger(__name__)


@dataclass
class ServerOptions(Limits):
    """Transport settings shared by the reward and rollout servers, with the request limits (server/limits.py)."""

    host: str = "0.0.0.0"
    port: int = 0
    max_message_mb: int = 64
    keepalive_time_s: float = 30.0
    keepalive_timeout_s: float = 10.0
    # Closing connections after this age makes clients re-resolve DNS as pods come and go; 0: never.
    max_connection_age_s: float = 0.0
    grace_s: float = 30.0
    # TLS from PEM files; with a CA, clients must present a certificate it signed (mutual TLS).
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    # Serve OpenTelemetry metrics for Prometheus scraping on this port; 0: off.
    prometheus_port: int = 0
    # A plaintext port serving only grpc.health.v1, for Kubernetes' gRPC probes (they cannot speak TLS); 0: none.
    health_port: int = 0
    # Write the bound port here once serving (with --port 0, how a parent process learns it); empty: don't.
    port_file: str = ""
    # Bearer-token auth on every service but health (server/auth.py): the token is this file's content, else
    # $REWARDMESH_AUTH_TOKEN; neither: no auth.
    auth_token_file: str = ""

    def credentials(self) -> grpc.ServerCredentials | None:
        if not (self.tls_cert or self.tls_key):
            if self.tls_ca:
                raise ValueError("tls_ca is set but tls_cert/tls_key are not: a TLS server needs its own certificate")
            return None
        if not (self.tls_cert and self.tls_key):
            raise ValueError("TLS needs both tls_cert and tls_key")
        try:
            pair = (Path(self.tls_key).read_bytes(), Path(self.tls_cert).read_bytes())
            ca = Path(self.tls_ca).read_bytes() if self.tls_ca else None
        except OSError as exc:
            raise ValueError(f"cannot read a TLS file: {exc}") from None
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)

    def channel_args(self) -> list[tuple[str, Any]]:
        size = self.max_message_mb * 1024 * 1024
        args: list[tuple[str, Any]] = [
            ("grpc.max_send_message_length", size),
            ("grpc.max_receive_message_length", size),
            ("grpc.keepalive_time_ms", int(self.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5000),
        ]
        if self.max_connection_age_s > 0:
            args += [
                ("grpc.max_connection_age_ms", int(self.max_connection_age_s * 1000)),
                ("grpc.max_connection_age_grace_ms", int(self.grace_s * 1000)),
            ]
        return args


def write_port_file(path: str | Path, port: int) -> None:
    """Write `port` to `path` atomically (a reader never sees a partial number)."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(f"{port}\n")
    tmp.replace(target)


class GrpcServer:
    """A grpc.aio server with health and reflection whose shutdown drains before it stops."""

    def __init__(
        self,
        options: ServerOptions,
        services: Sequence[tuple[Callable[[Any, aio.Server], None], Any, str]],
        *,
        on_drain: Callable[[], Awaitable[None]] | None = None,
        on_stopped: Callable[[], Awaitable[None]] | None = None,
        tenant_tokens: Sequence[str] = (),
    ) -> None:
        self.options = options
        interceptors = [*server_interceptors(), ExceptionToStatusInterceptor()]
        token = auth_token(options.auth_token_file)
        if token:  # first: a refused call never reaches the others; a tenant's token passes too (server/tenants.py)
            interceptors.insert(0, BearerTokenInterceptor([token, *tenant_tokens]))
        self.server = aio.server(interceptors=interceptors, options=options.channel_args())
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [full_name for _, _, full_name in services]
        for add, servicer, _ in services:
            add(servicer, self.server)
        reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        self._names = names
        self._on_drain = on_drain
        self._on_stopped = on_stopped  # releases what the servicers use (engine, backend, clients) once stopped
        self.port = 0
        self.health_server: aio.Server | None = None
        self._stopped = asyncio.Event()
        self._stopping: asyncio.Task[None] | None = None  # the one stop in progress, kept (never collected mid-run)

    async def start(self, *, ready: bool = True) -> int:
        """Bind and serve. ``ready=False``: the services report NOT_SERVING (the server itself SERVING, so a
        liveness probe passes) until :meth:`set_ready`, e.g. while an engine boots."""
        address = f"{self.options.host}:{self.options.port}"
        creds = self.options.credentials()
        self.port = self.server.add_secure_port(address, creds) if creds else self.server.add_insecure_port(address)
        if self.port == 0:
            raise RuntimeError(f"could not bind {address}; is the port taken?")
        await self.server.start()
        if self.options.health_port:
            self.health_server = aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            if not self.health_server.add_insecure_port(f"{self.options.host}:{self.options.health_port}"):
                raise RuntimeError(f"could not bind health port {self.options.health_port}")
            await self.health_server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        for name in self._names:
            status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
            await self.health.set(name, status)
        if self.options.port_file and ready:
            write_port_file(self.options.port_file, self.port)
        return self.port

    async def set_ready(self) -> None:
        """Report the services SERVING (after ``start(ready=False)``) and write the port file, unless a stop
        has begun."""
        if self._stopping is None:
            for name in self._names:
                await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
            if self.options.port_file:  # a harness waiting for the port file waits for a ready server
                write_port_file(self.options.port_file, self.port)

    @property
    def address(self) -> str:
        """HOST:PORT a client on this machine dials (a wildcard bind is reached at 127.0.0.1)."""
        host = "127.0.0.1" if self.options.host in ("0.0.0.0", "::", "[::]", "") else self.options.host
        return f"{host}:{self.port}"

    async def stop(self, grace: float | None = None) -> None:
        """The one shutdown path: NOT_SERVING, drain within the grace period, stop, release (`on_stopped`).

        Tests, the in-process mesh and SIGTERM/SIGINT all come here; a second call waits for the first.
        """
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_task(self._stop(grace))
        await asyncio.shield(self._stopping)

    async def _stop(self, grace: float | None) -> None:
        grace = self.options.grace_s if grace is None else grace
        deadline = time.monotonic() + grace  # one budget for the drain and the close of open streams
        await self.health.enter_graceful_shutdown()
        if self._on_drain is not None:
            try:
                await asyncio.wait_for(self._on_drain(), grace)
            except TimeoutError:
                log.warning("drain did not finish within %.1fs; stopping anyway", grace)
        await self.server.stop(max(0.0, deadline - time.monotonic()))
        if self.health_server is not None:
            await self.health_server.stop(0)
        try:
            if self._on_stopped is not None:
                await self._on_stopped()
        finally:
            self._stopped.set()

    def stop_on_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        if self._stopping is not None:
            log.info("received %s again: already draining", sig.name)
            return
        log.info("received %s: draining (grace %.0fs), health NOT_SERVING", sig.name, self.options.grace_s)
        self._stopping = asyncio.get_running_loop().create_task(self._stop(None))

    async def wait(self) -> None:
        await self._stopped.wait()


class MeshServer:
    """What the reward and rollout servers share: their `GrpcServer`, its address, one way to stop."""

    grpc: GrpcServer

    @property
    def port(self) -> int:
        return self.grpc.port

    @property
    def address(self) -> str:
        return self.grpc.address

    async def stop(self, grace: float | None = None) -> None:
        await self.grpc.stop(grace)

    async def wait(self) -> None:
        await self.grpc.wait()

    async def serve_until_signalled(self) -> None:
        """Run until SIGTERM/SIGINT, which take the same `stop()` path (drain, stop, release)."""
        self.grpc.stop_on_signals()
        await self.grpc.wait()

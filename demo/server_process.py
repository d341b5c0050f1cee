"""A `rewardmesh serve ...` (or any server) as a real process: started, its port learned, stopped with SIGTERM.

The child is given `--port-file`; it binds port 0 and writes the port it got there once it serves, so
nobody parses its log. Benchmarks and the CLI tests share this one harness.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from grpc import aio

log = logging.getLogger(__name__)


class ServerProcess:
    """A server subprocess on 127.0.0.1; its log goes to `<log_dir>/<name>.log`, its port to `<name>.port`."""

    def __init__(self, name: str, argv: Sequence[str], log_dir: Path) -> None:
        self.name = name
        self.port_path = log_dir / f"{name}.port"
        self.argv = [*argv, "--port-file", str(self.port_path)]
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.host = "127.0.0.1"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def start(self, timeout_s: float = 120.0) -> int:
        """Start the process and wait until it has written its port file; returns the port."""
        # The log goes to a file rather than a pipe: a chatty server can never block on a full pipe.
        self.port_path.unlink(missing_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(self.log_path, "wb") as log_file:  # the child writes through its own copy of the descriptor
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, env=env
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.port_path.exists():
                self.port = int(self.port_path.read_text())
                return self.port
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with code {self.proc.returncode} before serving; its log:\n{self.log_tail()}"
                )
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"{self.name} wrote no port file within {timeout_s:.0f}s; its log:\n{self.log_tail()}")

    async def wait_serving(self, service: str = "", timeout_s: float = 60.0) -> None:
        """Poll grpc.health.v1 until `service` reports SERVING."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout_s
        last = "no answer"
        async with aio.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}:\n{self.log_tail()}")
                try:
                    reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                    last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                except aio.AioRpcError as exc:
                    last = f"{exc.code().name}: {exc.details()}"
                await asyncio.sleep(0.1)
        raise RuntimeError(f"{self.name} at {self.address} not SERVING after {timeout_s:.0f}s (last: {last})")

    def signal(self, sig: signal.Signals = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then wait for the exit; returns the exit code (killed with SIGKILL after timeout_s: -9)."""
        if self.proc is None:
            return 0
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("%s did not exit within %.0fs of SIGTERM; killing it", self.name, timeout_s)
            self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

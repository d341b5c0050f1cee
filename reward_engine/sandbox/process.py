"""One started sandbox and the host's end of its pipes: a job goes in as one JSON line, the runner's lines come
back until the record that ends the exchange (``ready`` after a start, ``done`` after a job).

The host never trusts what comes back beyond its size: lines are parsed as they arrive and capped, and a runner
that prints garbage, goes silent past the budget or exits ends the exchange; the pool then retires the sandbox.
A job taken back mid-exchange is stopped by a line to the runner (``stop``), which ends it and resets the sandbox
within STOP_S; a runner that does not is treated as silent.
Everything here blocks and runs in one of the pool's threads: asyncio's child watcher in Python 3.11 races with
itself here and logs every sandbox.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import selectors
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from rewardmesh.reward_engine.sandbox.levels import PATH

_SANDBOX_ENV = {"PATH": PATH + ":/usr/sbin:/sbin", "LANG": "C.UTF-8"}
_STDERR_KEEP = 65536
_STOP_LINE = b'{"stop": true}\n'
# A stopped job's runner ends it, resets the sandbox and says done within this, or the sandbox is given up.
STOP_S = 2.0
_serials = itertools.count(1)


@dataclass
class Reply:
    """What one exchange read: the runner's records before the ending one, and how it ended."""

    records: list[dict[str, Any]] = field(default_factory=list)
    final: dict[str, Any] | None = None  # the ``ready`` or ``done`` record; None when the exchange broke off
    timed_out: bool = False
    over: bool = False  # more output than the cap
    unreadable: bool = False  # a line that is not a JSON object
    ended: bool = False  # the runner's stdout closed: it exited
    stop_s: float | None = None  # the job was stopped: seconds from the stop to the exchange's end


class SandboxProcess:
    """A sandbox (bubblewrap or unshare with the runner as PID 1) and its pipes; one thread uses it at a time."""

    def __init__(self, argv: list[str]) -> None:
        self.serial = next(_serials)
        self.served = 0  # jobs run in it so far
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_SANDBOX_ENV,
            start_new_session=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None and self.proc.stderr is not None
        self._stdin, self._stdout, self._stderr = self.proc.stdin, self.proc.stdout, self.proc.stderr
        self._buffer = bytearray()  # stdout after the last complete line
        self.stderr = bytearray()  # the runner's own stderr (its traceback if it failed), the last 64 KiB
        self._killed = False
        self._sel = selectors.DefaultSelector()
        self._wake_r = self._wake_w = -1
        try:
            self._wake_r, self._wake_w = os.pipe()  # another thread's ``wake`` ends a wait in ``exchange``
            os.set_blocking(self._stdin.fileno(), False)
            self._sel.register(self._stdout, selectors.EVENT_READ)
            self._sel.register(self._stderr, selectors.EVENT_READ)
            os.set_blocking(self._wake_r, False)
            os.set_blocking(self._wake_w, False)
            self._sel.register(self._wake_r, selectors.EVENT_READ)
        except BaseException:  # a sandbox that cannot be talked to is ended, not left running
            self.kill()
            raise

    def alive(self) -> bool:
        return not self._killed and self.proc.poll() is None

    def exchange(self, data: bytes, until: str, budget: float, cap: int, stop: threading.Event | None = None) -> Reply:
        """Write ``data`` (a job line, or nothing) and read records until one holding the key ``until``, at most
        ``cap`` bytes within ``budget`` seconds. Once ``stop`` is set (and ``wake`` called), the runner is told to
        stop the job, and has STOP_S left to end the exchange."""
        reply = Reply()
        deadline = time.monotonic() + budget
        pending = memoryview(data)
        if pending:
            self._sel.register(self._stdin, selectors.EVENT_WRITE)
        got = 0
        stopped_at: float | None = None
        try:
            while True:
                if self._take_lines(reply, until):
                    return reply
                if reply.ended:
                    self._drain_stderr(min(deadline, time.monotonic() + 1.0))
                    return reply
                if stop is not None and stop.is_set() and stopped_at is None:
                    stopped_at = time.monotonic()
                    deadline = min(deadline, stopped_at + STOP_S)
                    if not pending:
                        self._sel.register(self._stdin, selectors.EVENT_WRITE)
                    pending = memoryview(bytes(pending) + _STOP_LINE)
                left = deadline - time.monotonic()
                if left <= 0:
                    reply.timed_out = True
                    return reply
                for key, _ in self._sel.select(min(left, 1.0)):
                    if key.fileobj == self._wake_r:
                        with contextlib.suppress(BlockingIOError):
                            os.read(self._wake_r, 4096)
                        continue
                    if key.fileobj is self._stdin:
                        try:
                            pending = pending[os.write(key.fd, pending[:65536]) :]
                        except BrokenPipeError:
                            pending = pending[:0]
                        if not pending:
                            self._sel.unregister(self._stdin)
                        continue
                    chunk = os.read(key.fd, 65536)
                    if key.fileobj is self._stderr:
                        if not chunk:
                            self._sel.unregister(self._stderr)
                        self.stderr = (self.stderr + chunk)[-_STDERR_KEEP:]
                    elif not chunk:
                        self._sel.unregister(self._stdout)
                        reply.ended = True
                    else:
                        self._buffer.extend(chunk)
                        got += len(chunk)
                        if got > cap:
                            reply.over = True
                            return reply
        finally:
            if stopped_at is not None:
                reply.stop_s = time.monotonic() - stopped_at
            if pending and self._stdin in self._sel.get_map():
                self._sel.unregister(self._stdin)

    def _take_lines(self, reply: Reply, until: str) -> bool:
        """Move complete lines from the buffer into ``reply``; True once the exchange is over."""
        while (end := self._buffer.find(b"\n")) >= 0:
            line = bytes(self._buffer[:end])
            del self._buffer[: end + 1]
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if not isinstance(record, dict):
                reply.unreadable = True
                return True
            if until in record:
                reply.final = record
                return True
            reply.records.append(record)
        return False

    def _drain_stderr(self, until: float) -> None:
        """The runner exited: read the rest of its stderr (its traceback), briefly."""
        if self._stderr not in self._sel.get_map():
            return
        self._sel.unregister(self._stderr)
        with selectors.DefaultSelector() as sel:
            sel.register(self._stderr, selectors.EVENT_READ)
            while (left := until - time.monotonic()) > 0 and sel.select(left):
                chunk = os.read(self._stderr.fileno(), 65536)
                if not chunk:
                    return
                self.stderr = (self.stderr + chunk)[-_STDERR_KEEP:]

    def exit_status(self) -> int | None:
        """The runner's exit status once it is gone (waits a moment for it), else None."""
        try:
            return self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return None

    def wake(self) -> None:
        """From a thread other than the one exchanging with the sandbox: look at the exchange's ``stop`` now."""
        if self._wake_w >= 0:
            with contextlib.suppress(BlockingIOError):  # full: a wake is pending anyway
                os.write(self._wake_w, b"!")

    def kill(self) -> None:
        """End the sandbox (its PID 1 dies with bubblewrap or unshare, and every process of it with its PID 1)."""
        if not self._killed:
            self._killed = True
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.kill()
        self.proc.wait()
        self._sel.close()
        for pipe in (self._stdin, self._stdout, self._stderr):
            with contextlib.suppress(OSError):
                pipe.close()
        if self._wake_r >= 0:  # raw descriptors: closed once, or a second close could end another's
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1

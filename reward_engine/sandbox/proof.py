"""Which isolation a pool's sandboxes run under, proven before any job runs: the level the operator asks for
("bwrap" or "unshare") must run a probe program with no network, a read-only root, its own PID namespace and the
runner's system-call filter as promised. If it does not, a lower level is used only with
``allow_weaker_isolation=True``; otherwise every job fails with SandboxUnavailable, and the levels are tried again
when asked, RETRY_START_S later. There is no level without namespaces."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from rewardmesh.common.errors import Unavailable
from rewardmesh.reward_engine.sandbox.jobs import Job, JobResult
from rewardmesh.reward_engine.sandbox.levels import LEVELS, RANK, Level

log = logging.getLogger(__name__)

# A level that failed its probe (missing tool, a probe slowed past its budget) is tried again this much later.
RETRY_START_S = 30.0
# Runs a job in a sandbox of the level started for it alone: its result and the runner's ready record.
RunAlone = Callable[[Level, Job], Awaitable[tuple[JobResult, dict[str, Any]]]]


class SandboxUnavailable(Unavailable):
    """The configured isolation cannot be provided on this machine; no code runs."""


class IsolationProof:
    """The level asked for (``requested``) and, once proven, the level in use (``level``) with the system-call filter
    the runner installs (``filter``: "seccomp", or why none); ``failure`` says why none was acceptable."""

    def __init__(self, requested: str, allow_weaker: bool, python: str, run_alone: RunAlone) -> None:
        self.requested = requested
        self.allow_weaker = allow_weaker
        self.python = python
        self.run_alone = run_alone
        self.level: Level | None = None
        self.filter = "?"
        self.failure: str | None = None
        self._retry_at = 0.0
        self._lock = asyncio.Lock()

    def outlook(self) -> str:
        """Which isolation is asked for and which tools are installed, without starting anything."""
        found = [name for name in LEVELS if Level.find(name) is not None]
        weaker = " (weaker levels allowed)" if self.allow_weaker else ""
        return f"isolation '{self.requested}'{weaker}, tools found: {', '.join(found) or 'none'}"

    async def prove(self) -> tuple[Level, bool]:
        """The level in use, and whether this call proved it; raises SandboxUnavailable when none is acceptable."""
        async with self._lock:
            if self.level is not None:
                return self.level, False
            if self.failure is not None and time.monotonic() < self._retry_at:
                raise SandboxUnavailable(self.failure)
            tried: list[str] = []
            candidates = [n for n in LEVELS if RANK[n] <= RANK[self.requested]]
            for name in candidates:
                weaker = RANK[name] < RANK[self.requested]
                if weaker and not self.allow_weaker:
                    break
                level = Level.find(name)
                if level is None:
                    tried.append(f"{name}: not installed")
                    continue
                problem = await self._probe(level)
                if problem:
                    tried.append(f"{name}: {problem}")
                    continue
                self.level = level
                if weaker:
                    log.warning(
                        "code sandbox: %s unavailable (%s); running with the weaker level %s as allowed by "
                        "allow_weaker_isolation",
                        self.requested,
                        "; ".join(tried),
                        name,
                    )
                return level, True
            hint = "" if self.allow_weaker else " (set allow_weaker_isolation to accept a lower level)"
            self.failure = (
                f"isolation level '{self.requested}' is not available: {'; '.join(tried) or 'nothing tried'}{hint};"
                " no code is executed"
            )
            self._retry_at = time.monotonic() + RETRY_START_S
            log.error("code sandbox: %s (tried again in %gs when asked)", self.failure, RETRY_START_S)
            raise SandboxUnavailable(self.failure)

    async def _probe(self, level: Level) -> str | None:
        """None if a program runs in the level's sandbox with its network, tmp, root and filter as promised."""
        probe = (
            "import os, socket\n"
            "s = socket.socket()\n"
            "try:\n    s.connect(('127.0.0.1', 1)); print('net')\n"
            "except OSError:\n    pass\n"
            "seccomp = [line.split()[1] for line in open('/proc/self/status') if line.startswith('Seccomp:')]\n"
            "print(len(socket.if_nameindex()) <= 1, os.access('/usr', os.W_OK), os.getpid() < 100, *seccomp)\n"
        )
        job = Job({"probe.py": probe}, [self.python, "-I", "-S", "probe.py"], [""])
        try:
            result, ready = await self.run_alone(level, job)
        except OSError as exc:
            return str(exc)
        run = result.runs[0]
        if run.status != "exited" or run.exit_code != 0:
            return f"a probe program did not run ({run.status}: {(run.stderr or '').strip()[-300:]})"
        self.filter = str(ready.get("filter", "?"))
        filtered = "2" if self.filter == "seccomp" else "0"
        if run.stdout.split() != ["True", "False", "True", filtered]:
            return f"the probe saw a leaky sandbox: {run.stdout.strip()!r}"
        return None

"""A pool of sandbox starts sized to the machine: one job (a program and a batch of its test inputs) per start.

The host never trusts what comes back beyond its size: the runner's lines are parsed, capped, and a sandbox that
dies, hangs or prints garbage fails its job's remaining tests as sandbox errors, never as passes. When the server
runs as root, each pool slot runs its sandbox as an unprivileged uid of its own (``uid_base + slot``, set with
util-linux ``setpriv``), so a
program cannot signal or read anything of the server's or of another slot even outside the namespaces.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rewardmesh.common.errors import Unavailable
from rewardmesh.reward_engine.sandbox.levels import LEVELS, PATH, RANK, Level, default_python

log = logging.getLogger(__name__)

# Starting a sandbox (namespaces, mounts, the runner's interpreter) may take this long before its first test.
STARTUP_S = 10.0
# A level that failed its probe (missing tool, a probe slowed past its budget) is tried again this much later.
RETRY_START_S = 30.0
_SANDBOX_ENV = {"PATH": PATH + ":/usr/sbin:/sbin", "LANG": "C.UTF-8"}


class SandboxUnavailable(Unavailable):
    """The configured isolation cannot be provided on this machine; no code runs."""


@dataclass(frozen=True)
class Limits:
    """Per test process: CPU seconds, wall seconds, address space, processes (threads count), open files,
    bytes of stdout, bytes per written file; per sandbox: the size of its tmpfs."""

    cpu_s: float = 5.0
    wall_s: float = 10.0
    memory_mb: int = 512
    procs: int = 32
    files: int = 64
    output_bytes: int = 1 << 20
    file_bytes: int = 16 << 20
    tmp_mb: int = 64
    compile_timeout_s: float = 30.0

    def check(self, where: str) -> None:
        for name in ("cpu_s", "wall_s", "memory_mb", "procs", "files", "output_bytes", "file_bytes", "tmp_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{where}: '{name}' must be a positive number, got {value!r}")

    def as_job(self) -> dict[str, Any]:
        return {
            "cpu_s": self.cpu_s,
            "wall_s": self.wall_s,
            "memory_mb": self.memory_mb,
            "procs": self.procs,
            "files": self.files,
            "output_bytes": self.output_bytes,
            "file_bytes": self.file_bytes,
        }


@dataclass
class Job:
    """What one sandbox start runs: files in its work dir, an optional compile, one run per stdin."""

    files: dict[str, str]
    run: list[str]
    stdins: list[str]
    compile: list[str] | None = None
    binary: str = ""
    stop_on_error: bool = False  # skip the remaining tests after one that crashed or timed out
    limits: Limits | None = None  # this job's own limits (the sandbox's when None)


@dataclass
class TestRun:
    """One test's raw outcome; ``status``: exited | timeout | output_limit | error | compile_error |
    sandbox_error."""

    status: str
    exit_code: int | None = None
    signal: int | None = None
    stdout: str = ""
    stderr: str = ""
    time_s: float = 0.0
    cpu_s: float = 0.0


@dataclass
class JobResult:
    runs: list[TestRun]
    compile_ok: bool = True
    compile_stderr: str = ""
    compile_time_s: float = 0.0
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def _exchange(argv: list[str], data: bytes, budget: float, cap: int) -> tuple[bytes, bytes, bool, bool, int]:
    """Start a sandbox, feed it the job, read its lines (at most ``cap`` bytes) within ``budget`` seconds, and
    kill it if it is still there: (stdout, stderr head, timed out, over the cap, exit status). Runs in a thread
    with plain Popen: asyncio's child watcher in Python 3.11 races with itself here and logs every sandbox."""
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_SANDBOX_ENV,
        start_new_session=True,
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    out, err = bytearray(), bytearray()
    timed_out = over = False
    deadline = time.monotonic() + budget
    pending = memoryview(data)
    sel = selectors.DefaultSelector()
    try:
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE)
        while any(key.data is not None for key in sel.get_map().values()):
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(min(left, 1.0)):
                if key.fileobj is proc.stdin:
                    try:
                        pending = pending[os.write(key.fd, pending[:65536]) :]
                    except BrokenPipeError:
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                elif key.data is out:
                    out.extend(chunk)
                    over = len(out) > cap
                elif len(err) < 65536:
                    err.extend(chunk)
            if over:
                break
    finally:
        sel.close()
        try:
            proc.wait(timeout=0 if timed_out or over else max(0.1, min(2.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.kill()
            proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            with contextlib.suppress(OSError):
                pipe.close()
    return bytes(out[:cap]), bytes(err), timed_out, over, proc.returncode


def _decode(value: Any) -> str:
    try:
        return base64.b64decode(str(value or ""), validate=True).decode(errors="replace")
    except (binascii.Error, ValueError):
        return ""


def _run_of(record: dict[str, Any]) -> TestRun:
    def num(key: str) -> float:
        value = record.get(key)
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0

    def opt_int(key: str) -> int | None:
        value = record.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    status = record.get("status")
    return TestRun(
        status=status if isinstance(status, str) else "sandbox_error",
        exit_code=opt_int("exit"),
        signal=opt_int("signal"),
        stdout=_decode(record.get("stdout")),
        stderr=str(record.get("stderr", "")),
        time_s=num("time"),
        cpu_s=num("cpu"),
    )


class Sandbox:
    """Runs jobs in fresh sandboxes, at most ``workers`` at once.

    ``isolation`` is the level the operator asks for ("bwrap" or "unshare"). ``start()`` proves it works by
    running a program; if it does not, a lower level is used only with ``allow_weaker_isolation=True``, and
    otherwise every job fails with SandboxUnavailable. There is no level without namespaces.
    """

    def __init__(
        self,
        *,
        isolation: str = "bwrap",
        allow_weaker_isolation: bool = False,
        workers: int = 0,
        limits: Limits | None = None,
        python: str = "",
        uid_base: int = 61000,
    ) -> None:
        if isolation not in LEVELS:
            raise ValueError(f"sandbox: 'isolation' must be one of {', '.join(LEVELS)}, got {isolation!r}")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ValueError(f"sandbox: 'workers' must be an integer >= 0 (0: one per CPU), got {workers!r}")
        self.requested = isolation
        self.allow_weaker = bool(allow_weaker_isolation)
        self.workers = workers or max(1, len(os.sched_getaffinity(0)))
        self.limits = limits or Limits()
        self.limits.check("sandbox")
        self.python = python or default_python()
        self.uid_base = uid_base
        self.level: Level | None = None
        self._setpriv = shutil.which("setpriv", path=PATH + ":/usr/sbin:/sbin")
        self._failure: str | None = None
        self._retry_at = 0.0
        self._start_lock = asyncio.Lock()
        # One thread per running sandbox (it blocks on the sandbox's pipes), plus the start probe.
        self._threads = ThreadPoolExecutor(self.workers + 1, thread_name_prefix="sandbox")
        self._slots: asyncio.Queue[int] = asyncio.Queue()
        for slot in range(self.workers):
            self._slots.put_nowait(slot)

    @property
    def description(self) -> str:
        if self.level is None:
            return f"unavailable ({self._failure})" if self._failure else "not started"
        return f"{self.level.name} ({self.level.tool}), {self.workers} workers"

    def outlook(self) -> str:
        """Which isolation this sandbox asks for and which tools are installed, without starting anything."""
        found = [name for name in LEVELS if Level.find(name) is not None]
        weaker = " (weaker levels allowed)" if self.allow_weaker else ""
        return f"isolation '{self.requested}'{weaker}, tools found: {', '.join(found) or 'none'}"

    async def start(self) -> Level:
        """Find and prove the isolation level (once it works); raises SandboxUnavailable when none is acceptable."""
        async with self._start_lock:
            if self.level is not None:
                return self.level
            if self._failure is not None and time.monotonic() < self._retry_at:
                raise SandboxUnavailable(self._failure)
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
                log.info("code sandbox: isolation level %s", self.description)
                if os.geteuid() == 0 and not self._setpriv:
                    log.warning("code sandbox: running as root without setpriv: sandboxes keep uid 0 outside")
                return level
            hint = "" if self.allow_weaker else " (set allow_weaker_isolation to accept a lower level)"
            self._failure = (
                f"isolation level '{self.requested}' is not available: {'; '.join(tried) or 'nothing tried'}{hint};"
                " no code is executed"
            )
            self._retry_at = time.monotonic() + RETRY_START_S
            log.error("code sandbox: %s (tried again in %gs when asked)", self._failure, RETRY_START_S)
            raise SandboxUnavailable(self._failure)

    async def _probe(self, level: Level) -> str | None:
        """None if a program runs in the level's sandbox with its network, tmp and root as promised."""
        probe = (
            "import os, socket\n"
            "s = socket.socket()\n"
            "try:\n    s.connect(('127.0.0.1', 1)); print('net')\n"
            "except OSError:\n    pass\n"
            "print(len(socket.if_nameindex()) <= 1, os.access('/usr', os.W_OK), os.getpid() < 100)\n"
        )
        job = Job({"probe.py": probe}, [self.python, "-I", "-S", "probe.py"], [""])
        try:
            result = await self._execute(level, job, 0)
        except OSError as exc:
            return str(exc)
        run = result.runs[0]
        if run.status != "exited" or run.exit_code != 0:
            return f"a probe program did not run ({run.status}: {(run.stderr or '').strip()[-300:]})"
        if run.stdout.strip() != "True False True":
            return f"the probe saw a leaky sandbox: {run.stdout.strip()!r}"
        return None

    async def run(self, job: Job) -> JobResult:
        level = await self.start()
        slot = await self._slots.get()
        # A caller that goes away does not free the slot early: its sandbox runs on (within its budget).
        task = asyncio.ensure_future(self._execute(level, job, slot))
        task.add_done_callback(lambda _: self._slots.put_nowait(slot))
        return await asyncio.shield(task)

    def close(self) -> None:
        """No new sandboxes; those running end within their budgets."""
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def _execute(self, level: Level, job: Job, slot: int) -> JobResult:
        lim = job.limits or self.limits
        payload = {
            "files": job.files,
            "run": job.run,
            "tests": job.stdins,
            "limits": lim.as_job(),
            "compile": job.compile,
            "compile_timeout_s": lim.compile_timeout_s,
            "binary": job.binary,
            "stop_on_error": job.stop_on_error,
        }
        budget = STARTUP_S + len(job.stdins) * (lim.wall_s + 1.0) + (lim.compile_timeout_s if job.compile else 0)
        cap = len(job.stdins) * (lim.output_bytes * 4 // 3 + 65536) + 65536  # base64 stdout, 4 KiB stderr
        argv = level.command(self.python, lim.tmp_mb << 20)
        if os.geteuid() == 0 and self._setpriv:
            # Through setpriv, not Popen(user=...): that makes CPython fork instead of vfork, and a fork of a
            # process running gRPC's threads runs gRPC's fork handlers in the child, which can crash it.
            uid = str(self.uid_base + slot)
            argv = [self._setpriv, "--reuid", uid, "--regid", uid, "--clear-groups", "--", *argv]
        start = time.monotonic()
        data = json.dumps(payload).encode()
        loop = asyncio.get_running_loop()
        out, err, timed_out, over, code = await loop.run_in_executor(self._threads, _exchange, argv, data, budget, cap)
        records: list[dict[str, Any]] = []
        compile_info: dict[str, Any] | None = None
        notes = ["sandbox output over its cap"] if over else []
        for line in out.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                notes.append("unreadable line from the sandbox")
                break
            if not isinstance(record, dict):
                break
            if isinstance(record.get("compile"), dict):
                compile_info = record["compile"]
            elif record.get("test") == len(records):
                records.append(record)
        if not records and compile_info is None:
            notes.append(f"exit {code}: " + err.decode(errors="replace").strip()[-500:])
        runs = [_run_of(r) for r in records]
        result = JobResult(runs, wall_s=time.monotonic() - start, notes=notes)
        if compile_info is not None:
            result.compile_ok = bool(compile_info.get("ok"))
            result.compile_stderr = str(compile_info.get("stderr", ""))
            result.compile_time_s = float(compile_info.get("time", 0.0) or 0.0)
            if not result.compile_ok:
                status = "timeout" if compile_info.get("status") == "timeout" else "compile_error"
                why = f"{status}: {result.compile_stderr}"
                result.runs = [TestRun("compile_error", stderr=why) for _ in job.stdins]
                return result
        why = "sandbox wall budget exceeded" if timed_out else ("; ".join(notes) or "sandbox ended early")
        status = "timeout" if timed_out else "sandbox_error"
        last = result.runs[-1] if result.runs else None
        if job.stop_on_error and last and not timed_out and (last.status != "exited" or last.exit_code != 0):
            status, why = "skipped", "not run: an earlier test failed"
        while len(result.runs) < len(job.stdins):
            result.runs.append(TestRun(status, stderr=why))
        return result

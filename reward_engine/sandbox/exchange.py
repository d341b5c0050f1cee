"""One sandbox's exchange with its runner: a job goes in as one JSON line, under a budget and an output cap that its
limits set, and the runner's records come back as the job's result. The host trusts nothing in them beyond their
size: a test the runner did not report fails (as a sandbox error, a timeout, or skipped), never passes. The same
reply says whether the sandbox may serve another job: the pool retires it on any anomaly."""

from __future__ import annotations

import base64
import binascii
import json
import logging
import threading
import time
from typing import Any

from rewardmesh.reward_engine.sandbox.jobs import Job, JobResult, Limits, TestRun
from rewardmesh.reward_engine.sandbox.process import Reply, SandboxProcess

log = logging.getLogger(__name__)

# Starting a sandbox (namespaces, mounts, the runner's interpreter) may take this long before its first test.
STARTUP_S = 10.0
# The runner's reset after a job (kill, wipe, check) may take this long.
RESET_S = 2.0
# stderr that says a test ran out of memory or processes: a limit was hit, the sandbox is retired.
_LIMIT_MARKS = ("MemoryError", "bad_alloc", "Cannot allocate memory", "Resource temporarily unavailable")


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


def hit_limit(run: TestRun) -> bool:
    """Whether a test ran into a limit (output, memory, processes) or was killed by a signal of its own: its sandbox
    is retired. A test that ran out of time is not: the runner killed it, with everything else in the sandbox, and
    reset the sandbox, as for a stopped job, and the reset's check answers for what is left."""
    if run.status != "timeout" and (run.status not in ("exited", "skipped", "compile_error") or run.signal is not None):
        return True
    return any(mark in run.stderr for mark in _LIMIT_MARKS)


def result_of(job: Job, reply: Reply, exit_status: int | None, stderr: bytes, wall_s: float) -> JobResult:
    """The job's runs from the runner's records; every test it did not report is a failure, never a pass."""
    compile_info: dict[str, Any] | None = None
    records: list[dict[str, Any]] = []
    for record in reply.records:
        if isinstance(record.get("compile"), dict):
            compile_info = record["compile"]
        elif record.get("test") == len(records):
            records.append(record)
    notes = []
    if reply.over:
        notes.append("sandbox output over its cap")
    if reply.unreadable:
        notes.append("unreadable line from the sandbox")
    if reply.ended and reply.final is None:
        notes.append(f"exit {exit_status}: " + stderr.decode(errors="replace").strip()[-500:])
    result = JobResult([_run_of(r) for r in records], wall_s=wall_s, notes=notes)
    if compile_info is not None:
        result.compile_ok = bool(compile_info.get("ok"))
        result.compile_stderr = str(compile_info.get("stderr", ""))
        result.compile_time_s = float(compile_info.get("time", 0.0) or 0.0)
        if not result.compile_ok:
            status = "timeout" if compile_info.get("status") == "timeout" else "compile_error"
            why = f"{status}: {result.compile_stderr}"
            result.runs = [TestRun("compile_error", stderr=why) for _ in job.stdins]
            return result
    timed_out = reply.timed_out
    why = "sandbox wall budget exceeded" if timed_out else ("; ".join(notes) or "sandbox ended early")
    status = "timeout" if timed_out else "sandbox_error"
    last = result.runs[-1] if result.runs else None
    if job.stop_on_error and last and not timed_out and (last.status != "exited" or last.exit_code != 0):
        status, why = "skipped", "not run: an earlier test failed"
    while len(result.runs) < len(job.stdins):
        result.runs.append(TestRun(status, stderr=why))
    return result


class RunnerExchange:
    """One job's exchange with the runner of the sandbox that runs it (a fresh sandbox's start counted in its
    budget), and whether that sandbox may serve another job afterwards. ``limits``: the pool's, for a job without
    its own; ``samples_per_sandbox``: how many jobs a sandbox serves before it retires."""

    def __init__(self, job: Job, limits: Limits, samples_per_sandbox: int) -> None:
        self.job = job
        self.limits = job.limits or limits
        self.samples_per_sandbox = samples_per_sandbox

    def run(self, box: SandboxProcess, fresh: bool, stop: threading.Event | None = None) -> tuple[JobResult, Reply]:
        job, lim = self.job, self.limits
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
        tests_s = len(job.stdins) * (lim.wall_s + 1.0) + (lim.compile_timeout_s if job.compile else 0)
        budget = (STARTUP_S if fresh else 0.0) + RESET_S + tests_s
        cap = len(job.stdins) * (lim.output_bytes * 4 // 3 + 65536) + 65536  # base64 stdout, 4 KiB stderr
        start = time.monotonic()
        reply = box.exchange(json.dumps(payload).encode() + b"\n", "done", budget, cap, stop)
        box.served += 1
        status = box.exit_status() if reply.ended else None
        result = result_of(job, reply, status, bytes(box.stderr), time.monotonic() - start)
        result.sandbox, result.nth = box.serial, box.served
        return result, reply

    def retire_reason(
        self, box: SandboxProcess, result: JobResult, reply: Reply, stopped: bool, reuse: bool
    ) -> str | None:
        """Why the sandbox must not serve another job (None: it may). A stopped job's runner must have reset the
        sandbox in time, and only the tests it reported count: the rest were not run."""
        if stopped and reply.final is None:
            return "stopped, and not reset in time"
        if not reuse:
            return "single use"
        runs = [_run_of(r) for r in reply.records if "test" in r] if stopped else result.runs
        if reply.final is None:
            return "runner misbehaved"
        if not reply.final.get("clean"):
            left = reply.final.get("left")
            log.info("code sandbox: retired sandbox %d, left after the reset: %s", box.serial, left)
            return "left something after the reset"
        if any(hit_limit(run) for run in runs):
            return "a test hit a limit"
        if box.served >= self.samples_per_sandbox:
            return "served its samples"
        return None

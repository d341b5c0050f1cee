"""What the pool runs and what comes back: a job (its files, an optional compile, one run per test's stdin) under
its limits, and each test's raw outcome. Kept apart from the pool so the grading and the runner exchange read them
without the pool's machinery."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    sandbox: int = 0  # which sandbox ran it (a serial number, unique in the process)
    nth: int = 0  # the how-manieth job of that sandbox it was (1: the sandbox was started for it or ahead)

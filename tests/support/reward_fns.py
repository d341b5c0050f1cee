"""User reward functions with verl's signature, loaded by the custom-function tests as a file and as a module.

Kept free of test-only imports: worker processes import this file on their own.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from typing import Any


def _forked_from_tests() -> float:
    """1.0 if this process inherited the test modules, which only a fork (not spawn) would give it."""
    return float(any(name.startswith("tests.") and ".test_" in name for name in sys.modules))


def exact(data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None) -> float:
    return 1.0 if solution_str.strip() == ground_truth.strip() else 0.0


async def exact_async(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> float:
    await asyncio.sleep(0)
    return 1.0 if solution_str.strip() == ground_truth.strip() else 0.0


def detailed(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "score": 0.5 if solution_str == ground_truth else -0.5,
        "length": len(solution_str),
        "matched": solution_str == ground_truth,
        "pid": os.getpid(),
        "forked": _forked_from_tests(),
        "note": "non-numeric, dropped",
        "source_len": len(data_source),
    }


def boom(data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None) -> float:
    """Raises for a response containing 'boom', scores 1 otherwise."""
    if "boom" in solution_str:
        raise ValueError(f"cannot score {solution_str!r}")
    return 1.0


def sleepy(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """Sleeps extra_info['sleep_s'] seconds (0 if absent): a hung call when that exceeds timeout_s."""
    time.sleep(float((extra_info or {}).get("sleep_s", 0.0)))
    return {"score": 1.0, "pid": os.getpid()}


# Set by a test to let `held` calls return (thread executor only: the test and the call share the process).
RELEASE = threading.Event()


def held(data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None) -> float:
    """Holds its thread until the test sets RELEASE when extra_info['hold'] is set (at most 60 s); scores 1."""
    if (extra_info or {}).get("hold"):
        RELEASE.wait(60)
    return 1.0


async def sleepy_async(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> float:
    await asyncio.sleep(float((extra_info or {}).get("sleep_s", 0.0)))
    return 1.0


def cpu_heavy(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """Pure-Python arithmetic that holds the GIL the whole time (~0.1 s)."""
    n = int((extra_info or {}).get("n", 300_000))
    started = time.perf_counter()
    total = 0
    for i in range(n):
        total += i * i % 7
    return {
        "score": float(total % 2),
        "pid": os.getpid(),
        "forked": _forked_from_tests(),
        "ms": (time.perf_counter() - started) * 1000.0,
    }


def crash(data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None) -> float:
    """Kills its own process for a response 'crash' (a segfaulting extension would look the same)."""
    if solution_str == "crash":
        os._exit(3)
    return 1.0


def returns_text(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> str:
    return "high"


NOT_CALLABLE = 42


def hog(data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None) -> float:
    """Allocates extra_info['mb'] MiB and touches it (a checker that blows up on a huge input)."""
    block = bytearray(int((extra_info or {}).get("mb", 1)) * 1024 * 1024)
    return float(len(block) > 0)


def many_extras(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """A score with extra_info['count'] extras (a function that logs far too much)."""
    return {"score": 1.0, **{f"x{i}": float(i) for i in range(int((extra_info or {}).get("count", 0)))}}


def forks_a_sleeper(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> float:
    """Starts a long `sleep` (as a checker that shells out would), writes its pid to extra_info['pid_file'],
    then waits for it: the sleeper must not outlive the worker."""
    import subprocess

    child = subprocess.Popen(["sleep", "600"])
    with open(str((extra_info or {})["pid_file"]), "w") as f:
        f.write(str(child.pid))
    child.wait()
    return 1.0


def logged_start(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> float:
    """Appends the sample's `ground_truth` (its id, in the tests that use it) to the file extra_info['log'] as it
    starts (one O_APPEND write: lines of several workers never mix), then waits until the file extra_info['gate']
    exists (at most a minute), if given, and burns extra_info['burn_ms'] of CPU: what started, in what order, in
    the worker processes themselves."""
    extra = extra_info or {}
    fd = os.open(str(extra["log"]), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, f"{ground_truth}\n".encode())
    finally:
        os.close(fd)
    gate = extra.get("gate")
    if gate:
        until = time.monotonic() + 60
        while not os.path.exists(str(gate)) and time.monotonic() < until:
            time.sleep(0.001)
    burn_until = time.perf_counter() + float(extra.get("burn_ms", 0)) / 1000
    while time.perf_counter() < burn_until:
        pass
    return 1.0

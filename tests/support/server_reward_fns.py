"""User reward functions the server integration tests load by file path, as users would."""

from __future__ import annotations

import asyncio
import os
from typing import Any


async def sleepy(data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None) -> dict:
    """Sleeps extra_info['delay'] seconds (a slow remote checker), then scores the response length. With
    extra_info['started_file'], it first creates that file: a test in another process sees it is scoring."""
    extra = extra_info or {}
    delay = float(extra.get("delay", 0.0))
    if extra.get("started_file"):
        os.close(os.open(str(extra["started_file"]), os.O_CREAT | os.O_WRONLY))  # a tiny local write
    await asyncio.sleep(delay)
    return {"score": float(len(solution_str)), "delay": delay}


def exact_match(data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None) -> float:
    return 1.0 if solution_str.strip() == ground_truth.strip() else 0.0


def explode(data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None) -> float:
    raise ZeroDivisionError("checker bug")


async def fails_some(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None
) -> float:
    """Raises on a response containing 'boom' (INTERNAL), hangs on 'slow' (past its timeout: DEADLINE_EXCEEDED),
    else 1 if the response ends with the ground truth: a checker that fails for some samples of a group."""
    if "boom" in solution_str:
        raise RuntimeError("checker crashed")
    if "slow" in solution_str:
        await asyncio.sleep(5.0)
    return 1.0 if solution_str.strip().endswith(ground_truth.strip()) else 0.0


def truth_as_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None) -> float:
    """The ground truth as the score: a result matched to the wrong sample shows as the wrong number."""
    return float(ground_truth)

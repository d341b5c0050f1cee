"""A verifiers 0.4.0 environment as a hub package would ship one: a Task whose reward checks the final answer (it
raises on a reply containing 'boom' and hangs on 'slow'), a metric, and the Taskset the package exports. The tests
put this folder on sys.path, so the environment id is `vf_math_env`, as when it is pip-installed."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import verifiers.v1 as vf


class MathData(vf.TaskData):
    answer: str = ""
    delay: Any = 0  # read by the reward server's `sleepy` function, which the judge tests score on


class MathTask(vf.Task[MathData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: MathData, trace: Any) -> float:
        reply = trace.last_reply
        if "boom" in reply:
            raise RuntimeError("checker crashed")
        if "slow" in reply:
            await asyncio.sleep(60)
        return float(reply.removeprefix("####").strip() == task.answer)

    @vf.metric
    async def reply_chars(self, trace: Any) -> float:
        return float(len(trace.last_reply))


class JudgedTask(vf.Task[MathData, vf.State, vf.TaskConfig]):
    """No reward of its own: its plugged judges score it."""


class MathTaskset(vf.Taskset[MathTask, vf.TasksetConfig]):
    def load(self) -> Iterable[MathTask]:
        return [MathTask(MathData(prompt="What is 2 + 2?", answer="4"))]


__all__ = ["MathTaskset"]

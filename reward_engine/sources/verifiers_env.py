"""A verifiers environment's own scoring (verifiers 0.4.0, `verifiers.v1`): `Task.score` on each sample.

    pipelines:
      hub-math:
        sources:
          - type: verifiers
            taskset: math-env          # an installed verifiers environment (taskset id), or
            # task: my_pkg.tasks:MathTask   a Task class by import path
            task_config: {}            # the task's TaskConfig (judges, plugged rewards), validated at start
            answer_field: answer       # the task field a sample's ground_truth fills (no `task` in extra_info)
            concurrency: 32            # scorings in flight (the source's capacity, fair-shared like any other)
            timeout_s: 60              # per sample -> DEADLINE_EXCEEDED

One fleet scores many environments: the environment's package is installed beside the server, and each sample
carries its task and response. The task: `extra_info["task"]` (the task's data, as a trace's `task.data`), else
`{"prompt": prompt_text, <answer_field>: ground_truth}`. The trace: `extra_info["trace"]` (a serialized verifiers
trace: its messages, tool calls, info), else the prompt as a user turn and the response as the model's reply.

The score is `trace.reward` (every reward times its weight, the task's judges included); the extras are each
named reward's score and each metric. A reward that raises fails the sample (INTERNAL, with verifiers' TaskError
naming the task and the cause), a reward that never ran fails it too: never a zero. Environments' code runs on
an event loop of its own, in a thread, so a reward that blocks never stalls the server's loop.
"""

from __future__ import annotations

import asyncio
import importlib
import math
import threading
from collections.abc import Mapping
from typing import Any

from rewardmesh.common.errors import DeadlineExceeded, InvalidInput, SourceFailed, Unavailable, describe_exception
from rewardmesh.reward_engine.types import (
    BatchResult,
    Capacity,
    Outcome,
    RewardInput,
    RewardOutput,
    RewardSource,
    SourceKind,
)

INSTALL_HINT = "pip install verifiers==0.4.0 (and the environment's package) beside the reward server"


def _verifiers(where: str) -> Any:
    """verifiers.v1, imported only when a pipeline asks for it (a server without it scores everything else)."""
    try:
        return importlib.import_module("verifiers.v1")
    except ImportError as exc:
        raise ValueError(f"{where}: type 'verifiers' needs the verifiers package ({exc}); {INSTALL_HINT}") from None


def _task_class(where: str, taskset: str, task: str) -> type:
    if bool(taskset) == bool(task):
        raise ValueError(f"{where}: set one of 'taskset' (a verifiers environment id) or 'task' (module:Class)")
    vf = _verifiers(where)
    if taskset:
        from verifiers.v1.utils.loaders import taskset_class

        try:
            cls: type = taskset_class(taskset).task_type()
        except (ImportError, AttributeError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: taskset {taskset!r}: {describe_exception(exc)}") from None
        return cls
    module, _, attr = task.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"{where}: task {task!r} (module:Class): {describe_exception(exc)}") from None
    if not (isinstance(cls, type) and issubclass(cls, vf.Task)):
        raise ValueError(f"{where}: task {task!r} is not a verifiers Task subclass")
    return cls


class VerifiersSource(RewardSource):
    """Runs a verifiers Task's `score` (its `@vf.reward`s, `@vf.metric`s and plugged judges) on each sample."""

    kind = SourceKind.FUNCTION

    def __init__(
        self,
        name: str,
        taskset: str = "",
        task: str = "",
        task_config: dict[str, Any] | None = None,
        answer_field: str = "answer",
        concurrency: int = 32,
        timeout_s: float = 60.0,
    ) -> None:
        where = f"verifiers source {name!r}"
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"{where}: 'concurrency' must be an integer >= 1, got {concurrency!r}")
        if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"{where}: 'timeout_s' must be a positive number, got {timeout_s!r}")
        if not isinstance(answer_field, str):
            raise ValueError(f"{where}: 'answer_field' must be a string, got {answer_field!r}")
        self.task_cls = _task_class(where, str(taskset or ""), str(task or ""))
        try:
            self.task_config = self.task_cls.config_type().model_validate(task_config or {})  # type: ignore[attr-defined]
        except ValueError as exc:
            raise ValueError(f"{where}: task_config: {exc}") from None
        self.data_type: Any = self.task_cls.data_type()  # type: ignore[attr-defined]
        self.name = name
        self.target = taskset or task
        self.answer_field = answer_field
        self.concurrency = concurrency
        self.timeout_s = float(timeout_s)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def capacity(self) -> Capacity:
        return Capacity(self.concurrency, "scorings in flight", "sample")

    def _worker_loop(self) -> asyncio.AbstractEventLoop:
        """The environments' own event loop, in a daemon thread, started on first use."""
        if self._loop is None:
            loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=loop.run_forever, name=f"verifiers-{self.name}", daemon=True)
            self._thread.start()
            self._loop = loop
        return self._loop

    def _task_and_trace(self, sample: RewardInput) -> tuple[Any, Any]:
        from verifiers.v1.configs.agent import AgentConfig
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.trace import AgentInfo, Trace, TraceTask
        from verifiers.v1.types import AssistantMessage, UserMessage

        extra = sample.extra_info
        data = extra.get("task")
        if data is None:
            data = {"prompt": sample.prompt_text}
            if self.answer_field:
                data[self.answer_field] = sample.ground_truth
        if not isinstance(data, Mapping):
            raise InvalidInput(f"extra_info.task must be an object (the task's data), got {type(data).__name__}")
        try:
            task = self.task_cls(self.data_type.model_validate(dict(data)), self.task_config)
        except ValueError as exc:
            raise InvalidInput(f"extra_info.task: not a {self.data_type.__name__}: {exc}") from None
        recorded = TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash)
        raw = extra.get("trace")
        if raw is not None:
            if not isinstance(raw, Mapping):
                raise InvalidInput(f"extra_info.trace must be an object (a verifiers trace), got {type(raw).__name__}")
            try:
                trace = Trace.model_validate({**raw, "task": recorded.model_dump(), "rewards": {}, "metrics": {}})
            except ValueError as exc:
                raise InvalidInput(f"extra_info.trace: not a verifiers trace: {exc}") from None
            return task, trace
        nodes = [
            MessageNode(message=UserMessage(content=sample.prompt_text)),
            MessageNode(parent=0, message=AssistantMessage(content=sample.response_text), sampled=True),
        ]
        return task, Trace(task=recorded, agent=AgentInfo(config=AgentConfig()), nodes=nodes)

    async def _score_one(self, sample: RewardInput) -> Outcome:
        if self._closed:
            return Unavailable(f"verifiers source {self.name!r} is closed")
        try:
            task, trace = self._task_and_trace(sample)
        except InvalidInput as exc:
            return exc
        done = asyncio.run_coroutine_threadsafe(task.score(trace), self._worker_loop())
        try:
            await asyncio.wait_for(asyncio.wrap_future(done), self.timeout_s)
        except TimeoutError:
            done.cancel()
            return DeadlineExceeded(f"verifiers task {self.target!r} did not score within {self.timeout_s:g}s")
        except Exception as exc:  # verifiers' TaskError: the reward that raised, and why
            return SourceFailed(f"verifiers task {self.target!r}: {describe_exception(exc)}")
        unscored = sorted(k for k, v in trace.rewards.items() if v is None)
        if unscored:
            return SourceFailed(f"verifiers task {self.target!r}: rewards {unscored} did not score")
        if not trace.rewards:
            return SourceFailed(f"verifiers task {self.target!r} has no reward (no @vf.reward, no judge)")
        extras = {k: float(v.score) for k, v in trace.rewards.items()}
        extras.update({k: float(v) for k, v in trace.metrics.items() if v is not None})
        return RewardOutput(float(trace.reward), extras)

    def start_each(self, batch: list[RewardInput]) -> list[asyncio.Future[Outcome]]:
        """Each sample's scoring started now, answered when its own rewards are in."""
        return [asyncio.ensure_future(self._score_one(sample)) for sample in batch]

    async def score_batch(self, batch: list[RewardInput]) -> BatchResult:
        return list(await asyncio.gather(*self.start_each(batch)))

    async def close(self) -> None:
        self._closed = True
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
            if self._thread is not None:
                await asyncio.to_thread(self._thread.join, 10)
            if not loop.is_running():
                loop.close()

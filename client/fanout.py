"""Fan-out of a step's prompt groups over the rollout servers, with retries.

Each prompt group is one Generate call on the rollout server with the least outstanding work. The client names
every sample id up front, so if a server fails mid-step only the samples it had not yet returned are asked of
another server: none is lost, none is counted twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc import aio
from opentelemetry import context as otel_context
from opentelemetry import trace

from rewardmesh.client.batch import ScoredSample
from rewardmesh.client.prompts import PromptSpec, Sampling
from rewardmesh.client.targets import Member, TargetPool
from rewardmesh.common.channels import open_channel
from rewardmesh.common.telemetry import group_context, trace_config, tracer
from rewardmesh.v1 import common_pb2, reward_pb2, rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)

__all__ = ["MAX_PER_MESSAGE", "RETRYABLE", "Launched", "RolloutFanout", "RolloutTarget"]

MAX_PER_MESSAGE = 64  # asked of rollout servers: samples that finish together share a message

# A failed or draining server: resend its unfinished samples elsewhere. Anything else is the caller's bug.
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED, grpc.StatusCode.UNKNOWN}


@dataclass
class Launched:
    """One step in flight: its groups' tasks, the queue their samples (or a step-ending error) arrive on."""

    out: asyncio.Queue[ScoredSample | BaseException]
    tasks: list[asyncio.Task[None]]
    total: int
    started: float
    span: trace.Span
    dropped: list[ScoredSample] = field(default_factory=list)  # groups dropped for a failed sample


class RolloutTarget(Member):
    """One rollout server: its channel, stub and the samples asked of it that have not come back."""

    channel: aio.Channel

    def __init__(self, address: str, server_name: str) -> None:
        super().__init__(address, server_name)
        self.channel = open_channel(address, server_name=server_name)
        self.stub: rollout_pb2_grpc.RolloutServiceAsyncStub = rollout_pb2_grpc.RolloutServiceStub(self.channel)
        self.outstanding = 0

    @property
    def load(self) -> int:
        return self.outstanding

    async def close(self) -> None:
        await self.channel.close(grace=None)


class Behind(Exception):
    """A sample older than the step's policy version: its server restarted or missed an update."""


class RolloutFanout:
    """Starts a step's Generate calls, one per prompt group, and re-sends what a failed server left unfinished."""

    def __init__(
        self,
        pool: TargetPool[RolloutTarget],
        *,
        agent: rollout_pb2.AgentLoopConfig,
        reward_timeout: float | None,
        max_attempts: int,
        generate_timeout_s: float,
        policy_version: Callable[[], int],
        step_deadline_s: float | None = None,
    ) -> None:
        self.pool = pool
        self.agent = agent
        self.reward_timeout = reward_timeout
        # Each step's samples must be scored within this many seconds of its start: a shared reward fleet serves
        # earlier step deadlines first and fails a sample that cannot make it early (DEADLINE_EXCEEDED). None: none.
        self.step_deadline_s = step_deadline_s
        self.max_attempts = max_attempts
        # The deadline of each Generate call: a sample that never comes is DEADLINE_EXCEEDED, never a hang.
        self.generate_timeout_s = generate_timeout_s
        self._policy_version = policy_version  # the version every server applied before a step began
        self.resent_samples = 0
        self.behind_samples = 0  # samples refused because their server was behind the step's policy version
        self.groups_started = 0
        self._step = 0

    def _request(
        self, prompt: rollout_pb2.Prompt, n: int, reward: str, sampling: Sampling, step_deadline: float | None = None
    ) -> Any:
        req = rollout_pb2.GenerateRequest(prompts=[prompt], n=n, reward=reward, sampling=sampling.to_proto(),
                                          agent=self.agent, max_samples_per_message=MAX_PER_MESSAGE)  # fmt: skip
        if self.reward_timeout is not None:
            req.reward_timeout.FromNanoseconds(int(self.reward_timeout * 1e9))
        if step_deadline is not None:  # what is left of the step's deadline (a retry sends less)
            req.step_time_left.FromNanoseconds(max(0, int((step_deadline - time.monotonic()) * 1e9)))
        return req

    async def _run_group(
        self,
        spec: PromptSpec,
        group_id: str,
        sample_ids: list[str],
        reward: str,
        sampling: Sampling,
        out: asyncio.Queue[ScoredSample | BaseException],
        started: float,
        step_deadline: float | None = None,
    ) -> None:
        remaining = list(sample_ids)
        errors: list[str] = []
        target: RolloutTarget | None = None
        floor = self._policy_version()  # every server applied it before this step began
        for _attempt in range(self.max_attempts):
            if not remaining:  # every sample came, then the call failed (a server killed before its OK): done
                return
            target = self.pool.pick(avoid=target)
            waits = _attempt
            while target is None:  # every server down: our own retry schedule, or at once when one is back
                await self.pool.wait_up(self.pool.retry_in(waits))
                waits += 1
                target = self.pool.pick(probe=True)
            if errors:
                self.resent_samples += len(remaining)
            request = self._request(spec.to_proto(group_id, remaining), len(remaining), reward, sampling, step_deadline)
            target.outstanding += len(remaining)
            call = target.stub.Generate(request, timeout=self.generate_timeout_s)
            try:
                async for message in call:
                    if target.failures:
                        self.pool.mark_ok(target)
                    arrived = time.perf_counter() - started
                    for response in message.items or (message,):  # several samples per message, or one
                        sid = response.sample.sample_id
                        if sid not in remaining:
                            continue  # never count a sample twice
                        sample = ScoredSample.from_response(response)
                        if sample.policy_version < floor and not sample.failed:  # asked again elsewhere, never used
                            raise Behind(f"serves policy version {sample.policy_version}, behind {floor}")
                        remaining.remove(sid)
                        target.outstanding -= 1
                        sample.arrived = arrived
                        out.put_nowait(sample)
                if not remaining:
                    return
                errors.append(f"{target.address}: stream ended without {len(remaining)} samples")
            except Behind as exc:  # restarted, or missed an update: the pool's join hook brings it up to date
                call.cancel()
                self.behind_samples += 1
                errors.append(f"{target.address}: {exc}")
                self.pool.mark_failed(target, str(exc))
            except aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # each missing sample fails; the step goes on
                    for sid in remaining:
                        out.put_nowait(timed_out(sid, group_id, self.generate_timeout_s, started))
                    remaining = []
                    return
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:  # this group's own input: its samples fail alone
                    for sid in remaining:
                        out.put_nowait(failed(sid, group_id, exc.code(), str(exc.details()), started))
                    return
                if exc.code() not in RETRYABLE:
                    out.put_nowait(exc)
                    return
                errors.append(f"{target.address}: {exc.code().name}: {exc.details()}")
                self.pool.mark_failed(target, f"{exc.code().name}: {exc.details()}")
                log.debug("re-sending %d samples of group %s after %s failed", len(remaining), group_id, target.address)
            finally:
                target.outstanding -= len(remaining)
        out.put_nowait(RuntimeError(f"group {group_id}: no rollout server finished it: {'; '.join(errors)}"))

    def launch(self, prompts: Sequence[PromptSpec], n: int, reward: str, sampling: Sampling) -> Launched:
        """Start every group's Generate call now (they run whenever the caller awaits anything)."""
        self._step += 1
        stamp = f"s{self._step}-{uuid.uuid4().hex[:6]}"
        span = tracer().start_span("trainer.step", attributes={
            "rewardmesh.step": self._step, "rewardmesh.num_prompts": len(prompts), "rewardmesh.n": n,
            "rewardmesh.policy_version": self._policy_version()})  # fmt: skip
        launched = Launched(asyncio.Queue(), [], len(prompts) * n, time.perf_counter(), span)
        deadline = None if self.step_deadline_s is None else time.monotonic() + self.step_deadline_s
        token = otel_context.attach(trace.set_span_in_context(span))  # the tasks (and their RPCs) inherit it
        ratio = trace_config().head_ratio
        try:
            for i, spec in enumerate(prompts):
                group = spec.group_id or f"{stamp}-{i}"
                ids = [f"{group}/{k}" for k in range(n)]
                run = self._run_group(spec, group, ids, reward, sampling, launched.out, launched.started, deadline)
                # Head sampling per prompt group, decided here and carried in the trace flags.
                ctx = group_context(span, random.random() < ratio)
                group_token = otel_context.attach(ctx) if ctx is not None else None
                try:
                    launched.tasks.append(asyncio.create_task(run))
                finally:
                    if group_token is not None:
                        otel_context.detach(group_token)
        finally:
            otel_context.detach(token)
        self.groups_started += len(prompts)
        return launched

    @staticmethod
    @staticmethod
    async def consume(launched: Launched) -> AsyncIterator[ScoredSample]:
        """The step's samples as they arrive; the first step-ending error raised; the step's calls ended after."""
        try:
            for _ in range(launched.total):
                item = await launched.out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            for t in launched.tasks:
                t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*launched.tasks, return_exceptions=True)


def timed_out(sid: str, group_id: str, timeout_s: float, started: float) -> ScoredSample:
    """A sample whose Generate call passed its deadline: a failed sample (masked out), not a hang."""
    message = f"no sample within generate_timeout_s={timeout_s:g}"
    return failed(sid, group_id, grpc.StatusCode.DEADLINE_EXCEEDED, message, started)


def failed(sid: str, group_id: str, code: grpc.StatusCode, message: str, started: float) -> ScoredSample:
    """A sample its Generate call failed without sending: a failed sample (masked out), not a lost one."""
    status = common_pb2.Status(code=code.value[0], message=message)
    response = rollout_pb2.GenerateResponse(
        sample=common_pb2.Sample(sample_id=sid, group_id=group_id),
        result=reward_pb2.RewardResult(sample_id=sid, error=status),
    )
    sample = ScoredSample.from_response(response)
    sample.arrived = time.perf_counter() - started
    return sample

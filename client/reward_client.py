"""Async RewardService client: one long-lived Score stream per target, least-outstanding balancing, failover.

A sample lives in exactly one target's pending map at a time and its future is resolved once, so a
caller gets exactly one result per sample even when a target fails mid-stream: the failed target's
unanswered samples are re-sent to another target (a server-side UNAVAILABLE, e.g. while draining,
is treated the same way).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc import aio

from client.channels import open_channel
from client.targets import Member, Resolve, TargetPool
from rewardmesh.v1 import common_pb2, reward_pb2, reward_pb2_grpc

log = logging.getLogger(__name__)

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


@dataclass(eq=False)
class _Pending:
    request: reward_pb2.ScoreRequest
    future: asyncio.Future[reward_pb2.RewardResult]
    attempts: int = 0
    errors: list[str] = field(default_factory=list)


class _TargetStream(Member):
    """The long-lived Score stream to one target, reopened on demand after a failure."""

    def __init__(self, owner: RewardClient, address: str, server_name: str, max_message_mb: int) -> None:
        super().__init__(address, server_name)
        self.owner = owner
        # No RPC spans: the Score stream is the hot path, and each sample carries its own trace context.
        self.channel = open_channel(address, server_name=server_name, max_message_mb=max_message_mb, rpc_spans=False)
        self.stub = reward_pb2_grpc.RewardServiceStub(self.channel)
        self.pending: dict[str, _Pending] = {}
        self._outbox: asyncio.Queue[reward_pb2.ScoreRequest | None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._call: Any = None
        self._closed = False

    @property
    def load(self) -> int:
        return len(self.pending)

    def usable(self, now: float) -> bool:
        return self.owner.pool.usable(self, now)

    def send(self, p: _Pending) -> None:
        if self._outbox is None:
            self._outbox = asyncio.Queue()
            self._task = asyncio.get_running_loop().create_task(self._run(self._outbox))
        self.pending[p.request.sample.sample_id] = p
        self._outbox.put_nowait(p.request)

    async def _run(self, outbox: asyncio.Queue[reward_pb2.ScoreRequest | None]) -> None:
        async def requests() -> AsyncIterator[reward_pb2.ScoreRequest]:
            while (req := await outbox.get()) is not None:
                yield req

        reason = "the server ended the stream"
        answered = False
        try:
            self._call = call = self.stub.Score(requests())
            async for response in call:
                if not answered:
                    answered = True
                    self.owner.pool.mark_ok(self)
                self.owner._on_result(self, response.result)
        except aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            self._outbox = self._task = self._call = None
            raise
        self._outbox = self._task = self._call = None
        if self._closed:
            return
        orphans = list(self.pending.values())
        self.pending.clear()
        self.owner.pool.mark_failed(self, f"{reason}; re-sending its {len(orphans)} unanswered samples")
        self.owner._reroute(orphans, self, reason)

    async def close(self) -> None:
        """End the request stream, cancel the call and wait for the reader: nothing is left pending."""
        if self._closed:
            return
        self._closed = True
        if self._outbox is not None:
            self._outbox.put_nowait(None)
        if self._call is not None:
            self._call.cancel()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.channel.close(grace=None)


class RewardClient:
    """Scores samples on reward servers; results come back in completion order, exactly once each."""

    def __init__(
        self,
        targets: Sequence[str] | str,
        *,
        max_attempts: int = 5,
        retry_backoff_s: float = 0.2,
        max_message_mb: int = 64,
        resolve: Resolve | None = None,
        resolve_interval_s: float = 30.0,
    ) -> None:
        self.max_attempts = max_attempts
        self.retry_backoff_s = retry_backoff_s
        self.max_message_mb = max_message_mb
        self.rerouted = 0
        self._waiting: dict[_Pending, asyncio.TimerHandle] = {}  # samples waiting for a target to come up
        self.pool: TargetPool[_TargetStream] = TargetPool(
            targets,
            lambda address, name: _TargetStream(self, address, name, max_message_mb),
            kind="reward target",
            backoff_s=retry_backoff_s,
            interval_s=resolve_interval_s,
            resolve=resolve,
        )
        self.pool.on_change(self._on_membership)

    @property
    def streams(self) -> list[_TargetStream]:
        return self.pool.members

    def _on_membership(self, added: list[_TargetStream], removed: list[_TargetStream]) -> None:
        """Re-send what vanished addresses had pending, then close their streams."""
        for stream in removed:
            orphans = list(stream.pending.values())
            stream.pending.clear()
            self._reroute(orphans, stream, "its address no longer resolves")
            self.pool.spawn(stream.close())

    @property
    def outstanding(self) -> int:
        return sum(len(s.pending) for s in self.streams)

    async def __aenter__(self) -> RewardClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every stream; samples still waiting for a target or a result are cancelled."""
        for p, timer in self._waiting.items():
            timer.cancel()
            p.future.cancel()
        self._waiting.clear()
        await self.pool.close()
        for stream in [*self.pool.members, *self.pool.retired]:
            for p in stream.pending.values():
                p.future.cancel()
            stream.pending.clear()

    # -- streaming ----------------------------------------------------------------------------

    def submit(
        self,
        sample: common_pb2.Sample,
        reward: str,
        *,
        timeout: float | None = None,
        trace_context: dict[str, str] | None = None,
    ) -> asyncio.Future[reward_pb2.RewardResult]:
        """Send one sample now; the future resolves with its result (errors are in `result.error`)."""
        request = reward_pb2.ScoreRequest(sample=sample, reward=reward)
        if trace_context:  # even an empty dict costs a Python-level map update per sample
            request.trace_context.update(trace_context)
        if timeout is not None:
            request.timeout.FromNanoseconds(int(timeout * 1e9))
        p = _Pending(request, asyncio.get_running_loop().create_future())
        self._dispatch(p, avoid=None)
        return p.future

    async def score(
        self, samples: Iterable[common_pb2.Sample], reward: str, *, timeout: float | None = None
    ) -> AsyncIterator[reward_pb2.RewardResult]:
        """Send every sample at once and yield results as they complete."""
        futures = [self.submit(s, reward, timeout=timeout) for s in samples]
        try:
            for fut in asyncio.as_completed(futures):
                yield await fut
        finally:
            for fut in futures:
                fut.cancel()

    def _dispatch(self, p: _Pending, avoid: _TargetStream | None) -> None:
        if p.future.done():
            return
        stream = self.pool.pick(avoid)
        if stream is None:  # every target is backing off (or none has resolved yet): try again when one may be up
            self._waiting[p] = asyncio.get_running_loop().call_later(self.pool.retry_in(), self._retry, p)
            return
        stream.send(p)

    def _retry(self, p: _Pending) -> None:
        del self._waiting[p]
        self._dispatch(p, None)

    def _on_result(self, stream: _TargetStream, result: reward_pb2.RewardResult) -> None:
        p = stream.pending.pop(result.sample_id, None)
        if p is None:
            log.debug("result for unknown sample %s from %s ignored", result.sample_id, stream.address)
            return
        if result.HasField("error") and result.error.code == UNAVAILABLE:
            self._reroute([p], stream, result.error.message)
        elif not p.future.done():
            p.future.set_result(result)

    def _reroute(self, orphans: list[_Pending], failed: _TargetStream, reason: str) -> None:
        for p in orphans:
            if p.future.done():
                continue
            p.attempts += 1
            p.errors.append(f"{failed.address}: {reason}")
            if p.attempts >= self.max_attempts:
                sid = p.request.sample.sample_id
                p.future.set_result(
                    reward_pb2.RewardResult(
                        sample_id=sid,
                        reward=p.request.reward,
                        error=common_pb2.Status(
                            code=UNAVAILABLE,
                            message=f"no reward target scored sample '{sid}' after {p.attempts} attempts: "
                            + "; ".join(p.errors[-3:]),
                        ),
                    )
                )
                continue
            self.rerouted += 1
            self._dispatch(p, avoid=failed)

    # -- unary --------------------------------------------------------------------------------

    async def score_batch(
        self, samples: Sequence[common_pb2.Sample], reward: str, *, timeout: float | None = None
    ) -> list[reward_pb2.RewardResult]:
        """One ScoreBatch call on the least-loaded usable target, retried elsewhere on UNAVAILABLE."""
        request = reward_pb2.ScoreBatchRequest(reward=reward, samples=samples)
        if timeout is not None:
            request.timeout.FromNanoseconds(int(timeout * 1e9))
        last: aio.AioRpcError | None = None
        now = time.monotonic()
        order = sorted(await self.pool.wait_for_members(), key=lambda s: (not s.usable(now), len(s.pending)))
        for stream in order:
            try:
                response = await stream.stub.ScoreBatch(request)
                self.pool.mark_ok(stream)
                return list(response.results)
            except aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                last = exc
                self.pool.mark_failed(stream, f"ScoreBatch: {exc.details()}")
        assert last is not None
        raise last

    async def keep_traces(self, sample_ids: Sequence[str]) -> int:
        """Ask every reward target to export these samples' span trees; returns the spans exported in all.

        Which target scored a sample is not tracked, so all are asked (targets skip ids they do not know).
        """
        request = reward_pb2.KeepTracesRequest(sample_ids=sample_ids)

        async def one(stream: _TargetStream) -> int:
            try:
                return (await stream.stub.KeepTraces(request, timeout=10.0)).exported_spans
            except aio.AioRpcError as exc:  # traces are best effort: never fail a caller for them
                log.debug("KeepTraces on %s failed: %s", stream.address, exc.code().name)
                return 0

        return sum(await asyncio.gather(*(one(s) for s in self.streams)))

    async def list_rewards(self) -> reward_pb2.ListRewardsResponse:
        (first, *_) = await self.pool.wait_for_members()
        return await first.stub.ListRewards(reward_pb2.ListRewardsRequest())

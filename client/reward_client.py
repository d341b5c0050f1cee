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

import grpc
from grpc import aio

from client.channels import open_channel
from client.targets import Resolver
from rewardmesh.v1 import common_pb2, reward_pb2, reward_pb2_grpc

log = logging.getLogger(__name__)

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


@dataclass(eq=False)
class _Pending:
    request: reward_pb2.ScoreRequest
    future: asyncio.Future[reward_pb2.RewardResult]
    attempts: int = 0
    errors: list[str] = field(default_factory=list)


class _TargetStream:
    """The long-lived Score stream to one target, reopened on demand after a failure."""

    def __init__(self, owner: RewardClient, address: str, max_message_mb: int) -> None:
        self.owner = owner
        self.address = address
        self.channel = open_channel(address, server_name=owner.resolver.server_name, max_message_mb=max_message_mb)
        self.stub = reward_pb2_grpc.RewardServiceStub(self.channel)
        self.pending: dict[str, _Pending] = {}
        self.down_until = 0.0
        self._outbox: asyncio.Queue[reward_pb2.ScoreRequest | None] | None = None
        self._task: asyncio.Task[None] | None = None

    def usable(self, now: float) -> bool:
        return now >= self.down_until

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
        try:
            call = self.stub.Score(requests())
            async for response in call:
                self.owner._on_result(self, response.result)
        except aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            self._outbox = self._task = None
            raise
        self._outbox = self._task = None
        orphans = list(self.pending.values())
        self.pending.clear()
        self.down_until = time.monotonic() + self.owner.retry_backoff_s
        log.warning(
            "reward stream to %s ended (%s); re-sending its %d unanswered samples",
            self.address,
            reason,
            len(orphans),
        )
        self.owner._reroute(orphans, self, reason)

    async def close(self) -> None:
        if self._outbox is not None:
            self._outbox.put_nowait(None)
        if self._task is not None:
            self._task.cancel()
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
        resolver: Resolver | None = None,
    ) -> None:
        self.resolver = resolver or Resolver(targets)
        if not self.resolver.addresses:
            raise ValueError("RewardClient needs at least one target HOST:PORT")
        self.max_attempts = max_attempts
        self.retry_backoff_s = retry_backoff_s
        self.max_message_mb = max_message_mb
        self.streams = [_TargetStream(self, a, max_message_mb) for a in self.resolver.addresses]
        self.rerouted = 0
        self._retired: list[_TargetStream] = []

    def _reconcile(self, addresses: list[str] | None) -> None:
        """Open streams to new addresses; retire streams to vanished ones once they have nothing pending."""
        if addresses is None:
            return
        known = {s.address: s for s in self.streams}
        self.streams = [known.get(a) or _TargetStream(self, a, self.max_message_mb) for a in addresses]
        for gone in set(known) - set(addresses):
            stream = known[gone]
            self._retired.append(stream)
            self._reroute(list(stream.pending.values()), stream, "its address no longer resolves")
            stream.pending.clear()
            asyncio.get_running_loop().create_task(stream.close())

    @property
    def outstanding(self) -> int:
        return sum(len(s.pending) for s in self.streams)

    async def __aenter__(self) -> RewardClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for s in self.streams:
            await s.close()
        for s in self._retired:
            await s.close()

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
        self._reconcile(self.resolver.maybe_refresh())
        now = time.monotonic()
        if len(self.streams) == 1 and self.streams[0].usable(now):  # the common case: one target, up
            self.streams[0].send(p)
            return
        usable = [s for s in self.streams if s.usable(now)]
        preferred = [s for s in usable if s is not avoid] or usable
        if not preferred:
            wait = max(0.0, min(s.down_until for s in self.streams) - now)
            asyncio.get_running_loop().call_later(wait, self._dispatch, p, None)
            return
        min(preferred, key=lambda s: len(s.pending)).send(p)

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
        if orphans and failed in self.streams:
            self._reconcile(self.resolver.refresh())  # the pod may have been replaced
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
        order = sorted(self.streams, key=lambda s: (not s.usable(time.monotonic()), len(s.pending)))
        for stream in order:
            try:
                response = await stream.stub.ScoreBatch(request)
                return list(response.results)
            except aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                last = exc
                stream.down_until = time.monotonic() + self.retry_backoff_s
        assert last is not None
        raise last

    async def list_rewards(self) -> reward_pb2.ListRewardsResponse:
        return await self.streams[0].stub.ListRewards(reward_pb2.ListRewardsRequest())

"""Async RewardService client: one long-lived Score stream per target, least-outstanding balancing, failover.

A sample lives in exactly one target's pending map at a time and its future is resolved once, so a
caller gets exactly one result per sample even when a target fails mid-stream: the failed target's
unanswered samples are re-sent to another target (a server-side UNAVAILABLE, e.g. while draining,
is treated the same way).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc import aio

from rewardmesh.client.targets import REFUSED, Member, Resolve, TargetPool, refusal_message
from rewardmesh.common.channels import open_channel
from rewardmesh.v1 import common_pb2, reward_pb2, reward_pb2_grpc

log = logging.getLogger(__name__)

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
MAX_ITEMS_PER_MESSAGE = 256  # samples coalesced into one ScoreRequest when many are queued at once
MAX_RESULTS_PER_MESSAGE = 256  # asked of the server: results that finish together share a message


@dataclass(eq=False, slots=True)
class _Pending:
    """One submitted sample. Its request is built only when it is written, straight into the message that
    carries it: one copy of the sample, not one into a ScoreRequest and another into the batched message."""

    sample: common_pb2.Sample
    reward: str
    sample_id: str
    future: asyncio.Future[reward_pb2.RewardResult]
    wire_id: str  # the id it travels under: its own, unless another live sample of this client has it
    deadline: float  # time.monotonic() by which a result must have come (end to end, retries included)
    timeout_ns: int | None = None  # ScoreRequest.timeout
    due: float | None = None  # time.monotonic() by which its step must be scored (ScoreRequest.step_time_left)
    trace_context: dict[str, str] | None = None
    attempts: int = 0
    errors: list[str] = field(default_factory=list)
    stream: _TargetStream | None = None  # where it is pending now

    def fill(self, req: reward_pb2.ScoreRequest, now: float) -> None:
        """Write this sample's request into `req` (an item of a message, or the message itself)."""
        req.sample.CopyFrom(self.sample)
        if self.wire_id is not self.sample_id:
            req.sample.sample_id = self.wire_id
        req.reward = self.reward
        if self.trace_context:  # even an empty dict costs a Python-level map update per sample
            req.trace_context.update(self.trace_context)
        if self.timeout_ns is not None:
            req.timeout.FromNanoseconds(self.timeout_ns)
        if self.due is not None:  # what is left of it now: each attempt sends less
            req.step_time_left.FromNanoseconds(max(0, int((self.due - now) * 1e9)))


# How long the one call that tells a refusal from a lost stream may take (the stream's own error stands after it).
REFUSAL_PROBE_TIMEOUT_S = 10.0


class _TargetStream(Member):
    """The long-lived Score stream to one target, reopened on demand after a failure.

    Whatever is queued when the stream can write goes out in one message (`ScoreRequest.items`, or one
    sample on its own), cancellations ride along (`cancel_sample_ids`), and the server is asked for
    several results per message: nothing waits to fill a message, a message takes what is ready.
    """

    channel: aio.Channel

    def __init__(
        self, owner: RewardClient, address: str, server_name: str, max_message_mb: int, token: str | None = None
    ) -> None:
        super().__init__(address, server_name)
        self.owner = owner
        # No RPC spans: the Score stream is the hot path, and each sample carries its own trace context.
        self.channel = open_channel(
            address, server_name=server_name, max_message_mb=max_message_mb, rpc_spans=False, token=token
        )
        self.stub = reward_pb2_grpc.RewardServiceStub(self.channel)
        self.pending: dict[str, _Pending] = {}
        # Wire ids cancelled on the server and not yet answered: a late answer must not be taken for a new sample.
        self.cancelling: set[str] = set()
        self._queued: collections.deque[_Pending] = collections.deque()
        self._cancels: list[str] = []
        self._keeps: dict[str, str] = {}  # sample id -> traceparent ("": its own) to keep, on the next message
        self._wake: asyncio.Future[None] | None = None
        self._open = False  # the request stream is open (its writer waits on _wake)
        self._task: asyncio.Task[None] | None = None
        self._call: Any = None
        self._closed = False

    @property
    def load(self) -> int:
        return len(self.pending)

    def usable(self, now: float) -> bool:
        return self.owner.pool.usable(self, now)

    def _poke(self) -> None:
        w = self._wake
        if w is not None and not w.done():
            w.set_result(None)

    def send(self, p: _Pending) -> None:
        if self._task is None:
            self._open = True
            self._task = asyncio.get_running_loop().create_task(self._run())
        p.stream = self
        self.pending[p.wire_id] = p
        self._queued.append(p)
        self._poke()

    def cancel(self, p: _Pending) -> None:
        """The caller gave up on p: forget it here and tell the server to drop it (if it was sent)."""
        if self.pending.get(p.wire_id) is not p:
            return
        del self.pending[p.wire_id]
        p.stream = None
        with contextlib.suppress(ValueError):
            self._queued.remove(p)  # never sent: nothing to tell the server
            return
        if self._open:
            self._cancels.append(p.wire_id)
            self.cancelling.add(p.wire_id)  # its id stays taken until the server answers for it
            self._poke()

    def keep_traces(self, kept: Mapping[str, str]) -> bool:
        """Ask the server to keep these samples' traces on the next message; False if the stream is not open."""
        if not self._open:
            return False
        self._keeps.update(kept)
        self._poke()
        return True

    async def _requests(self) -> AsyncIterator[reward_pb2.ScoreRequest]:
        first = True
        queued, loop = self._queued, asyncio.get_running_loop()
        while self._open:
            if not queued and not self._cancels and not self._keeps:
                self._wake = loop.create_future()
                await self._wake
                self._wake = None
                continue
            msg = reward_pb2.ScoreRequest()
            if self._cancels and queued:  # cancels first, on their own: a new sample may reuse a cancelled id
                msg.cancel_sample_ids.extend(self._cancels[:MAX_ITEMS_PER_MESSAGE])
                del self._cancels[:MAX_ITEMS_PER_MESSAGE]
            elif len(queued) == 1 and not self._cancels and not self._keeps:
                queued.popleft().fill(msg, time.monotonic())
            else:
                add, traced = msg.items.add, False
                now = time.monotonic()  # once: samples of one step deadline keep one deadline (and their order)
                for _ in range(min(len(queued), MAX_ITEMS_PER_MESSAGE)):
                    p = queued.popleft()
                    p.fill(add(), now)
                    if p.trace_context:
                        traced = True
                if not traced:
                    msg.items_untraced = True  # the server skips reading each item's trace_context
                if self._cancels:  # at most MAX_ITEMS_PER_MESSAGE ids a message: far under the server's limit
                    msg.cancel_sample_ids.extend(self._cancels[:MAX_ITEMS_PER_MESSAGE])
                    del self._cancels[:MAX_ITEMS_PER_MESSAGE]
                if self._keeps:
                    for sid in list(self._keeps)[:MAX_ITEMS_PER_MESSAGE]:
                        msg.keep_traces[sid] = self._keeps.pop(sid)
            if first:  # read by the server on every message; the last value set wins
                msg.max_results_per_message = MAX_RESULTS_PER_MESSAGE
                first = False
            yield msg

    async def _run(self) -> None:
        reason = "the server ended the stream"
        answered = False
        on_result = self.owner._on_result
        try:
            self._call = call = self.stub.Score(self._requests())
            async for response in call:
                if not answered:
                    answered = True
                    self.owner.pool.mark_ok(self)
                if response.results:
                    for result in response.results:
                        on_result(self, result)
                else:
                    on_result(self, response.result)
        except aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
            refusal = exc if exc.code() in REFUSED else await self._refusal_behind(exc)
            if refusal is not None:  # another try or another target gets the same answer: fail at once
                self._reset()
                self.owner._refuse(self, refusal)
                return
        except asyncio.CancelledError:
            self._reset()
            raise
        self._reset()
        if self._closed:
            return
        orphans = list(self.pending.values())
        self.pending.clear()
        self.owner.pool.mark_failed(self, f"{reason}; re-sending its {len(orphans)} unanswered samples")
        self.owner._reroute(orphans, self, reason)

    async def _refusal_behind(self, exc: aio.AioRpcError) -> aio.AioRpcError | None:
        """The refusal a lost status hid, if it was one. A server that refuses the caller ends the stream before
        reading it, and when a message the client writes meanwhile fails, grpc.aio reports that write's failure
        (INTERNAL, `Failed "execute_batch"` on a send) in place of the server's status. One unary call, which
        has no write to race, asks the target again."""
        if exc.code() != grpc.StatusCode.INTERNAL or "SendMessageOperation" not in (exc.debug_error_string() or ""):
            return None
        try:
            await self.stub.ListRewards(reward_pb2.ListRewardsRequest(), timeout=REFUSAL_PROBE_TIMEOUT_S)
        except aio.AioRpcError as probe:
            return probe if probe.code() in REFUSED else None
        return None

    def _reset(self) -> None:
        self._open = False
        self._poke()
        self._queued.clear()
        self._cancels.clear()
        self._keeps.clear()
        self._task = self._call = None
        self.owner._wire_ids.difference_update(self.cancelling)  # nothing more will come for them
        self.cancelling.clear()

    async def close(self) -> None:
        """End the request stream, cancel the call and wait for the reader: nothing is left pending."""
        if self._closed:
            return
        self._closed = True
        task = self._task
        self._open = False
        self._poke()
        if self._call is not None:
            self._call.cancel()
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.channel.close(grace=None)


async def _keep_traces_call(stream: _TargetStream, request: reward_pb2.KeepTracesRequest) -> int:
    """One target's KeepTraces call: the spans it exported; 0 if it failed (traces are best effort: never fail a
    caller for them)."""
    try:
        return (await stream.stub.KeepTraces(request, timeout=10.0)).exported_spans
    except aio.AioRpcError as exc:
        log.debug("KeepTraces on %s failed: %s", stream.address, exc.code().name)
        return 0


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
        result_timeout_s: float = 600.0,
        token: str | None = None,
    ) -> None:
        """`token`: the bearer token to send (a tenant's, naming the job on a shared reward fleet); default: the
        one in the environment (REWARDMESH_AUTH_TOKEN_FILE, REWARDMESH_AUTH_TOKEN), if any."""
        if result_timeout_s <= 0:
            raise ValueError(f"result_timeout_s must be > 0, got {result_timeout_s}")
        # End to end, retries included: a result that never comes is DEADLINE_EXCEEDED, never a hang.
        self.result_timeout_s = result_timeout_s
        self._live: dict[_Pending, None] = {}  # unanswered samples in submission order = deadline order
        # Wire ids of unanswered samples: two live samples never share one, so two callers reusing an id
        # (two steps reusing a group id) each get their own result.
        self._wire_ids: set[str] = set()
        self._collisions = 0
        self._sweeper: asyncio.Task[None] | None = None
        self.max_attempts = max_attempts
        self.retry_backoff_s = retry_backoff_s
        self.max_message_mb = max_message_mb
        self.rerouted = 0
        self._waiting: dict[_Pending, asyncio.TimerHandle] = {}  # samples waiting for a target to come up
        self.pool: TargetPool[_TargetStream] = TargetPool(
            targets,
            lambda address, name: _TargetStream(self, address, name, max_message_mb, token),
            kind="reward target",
            backoff_s=retry_backoff_s,
            interval_s=resolve_interval_s,
            resolve=resolve,
        )
        self.pool.on_change(self._on_membership)
        self.pool.on_up(self._on_target_up)

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
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self._live.clear()
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
        step_deadline: float | None = None,
    ) -> asyncio.Future[reward_pb2.RewardResult]:
        """Send one sample now; the future resolves with its result (errors are in `result.error`).

        The sample is copied into the stream's next message when that is written (one copy, not two): leave
        it unchanged until the future resolves. Cancelling the future cancels the sample on the reward
        server. `timeout` bounds its wait in the server's queue; the client's own `result_timeout_s` bounds
        the whole wait. `step_deadline` (a time.monotonic() value): when the step it belongs to must be scored;
        the server serves earlier step deadlines first and answers DEADLINE_EXCEEDED early for a sample that can
        no longer make its own.
        """
        loop = asyncio.get_running_loop()
        sid = wire = sample.sample_id
        while wire in self._wire_ids:  # rare: an id reused while its first sample is still live
            self._collisions += 1
            wire = f"{sid[:256]}~{self._collisions}"
        self._wire_ids.add(wire)
        p = _Pending(
            sample,
            reward,
            sid,
            loop.create_future(),
            wire,
            time.monotonic() + self.result_timeout_s,
            None if timeout is None else int(timeout * 1e9),
            step_deadline,
            trace_context,
        )
        p.future.add_done_callback(lambda fut: self._on_done(p, fut))
        self._live[p] = None
        if self._sweeper is None:
            self._sweeper = loop.create_task(self._sweep())
        self._dispatch(p, avoid=None)
        return p.future

    def _on_done(self, p: _Pending, fut: asyncio.Future[reward_pb2.RewardResult]) -> None:
        self._live.pop(p, None)
        if fut.cancelled():
            if p.stream is not None:
                p.stream.cancel(p)
            timer = self._waiting.pop(p, None)
            if timer is not None:
                timer.cancel()
        if not any(p.wire_id in s.cancelling for s in self.pool.members):
            self._wire_ids.discard(p.wire_id)

    async def _sweep(self) -> None:
        """Fail samples whose end-to-end deadline passed (one task per client, not a timer per sample)."""
        live = self._live
        try:
            while live:
                now = time.monotonic()
                while live and (p := next(iter(live))).deadline <= now:
                    del live[p]
                    if not p.future.done():
                        self._expire(p)
                if live:
                    await asyncio.sleep(min(1.0, max(0.01, next(iter(live)).deadline - now)))
        finally:
            self._sweeper = None

    def _expire(self, p: _Pending) -> None:
        where = p.stream.address if p.stream is not None else "no reward target"
        if p.stream is not None:
            p.stream.cancel(p)
        timer = self._waiting.pop(p, None)
        if timer is not None:
            timer.cancel()
        p.future.set_result(
            reward_pb2.RewardResult(
                sample_id=p.sample_id,
                reward=p.reward,
                error=common_pb2.Status(
                    code=DEADLINE_EXCEEDED,
                    message=f"no result for sample '{p.sample_id}' within {self.result_timeout_s:g}s "
                    f"(last sent to {where}, {p.attempts + 1} attempt(s))",
                ),
            )
        )

    async def score(
        self,
        samples: Iterable[common_pb2.Sample],
        reward: str,
        *,
        timeout: float | None = None,
        step_deadline: float | None = None,
    ) -> AsyncIterator[reward_pb2.RewardResult]:
        """Send every sample at once and yield results as they complete."""
        futures = [self.submit(s, reward, timeout=timeout, step_deadline=step_deadline) for s in samples]
        try:
            for fut in asyncio.as_completed(futures):
                yield await fut
        finally:
            for fut in futures:
                fut.cancel()

    def _dispatch(self, p: _Pending, avoid: _TargetStream | None, *, probe: bool = False) -> None:
        if p.future.done():
            return
        stream = self.pool.pick(avoid, probe=probe)
        if stream is None:  # every target is backing off (or none has resolved yet): try again on the sample's
            # own schedule (never a backoff that earlier samples' failures grew), or at once when one is back
            wait = self.pool.retry_in(p.attempts)
            self._waiting[p] = asyncio.get_running_loop().call_later(wait, self._retry, p)
            return
        stream.send(p)

    def _retry(self, p: _Pending) -> None:
        del self._waiting[p]
        self._dispatch(p, None, probe=True)

    def _on_target_up(self, stream: _TargetStream) -> None:
        """A target is reachable again: what waits for one goes now."""
        waiting = list(self._waiting.items())
        self._waiting.clear()
        for p, timer in waiting:
            timer.cancel()
            self._dispatch(p, None)

    def _on_result(self, stream: _TargetStream, result: reward_pb2.RewardResult) -> None:
        p = stream.pending.pop(result.sample_id, None)
        if p is None and result.sample_id in stream.cancelling:  # the server's answer to a cancel: the id is free
            stream.cancelling.discard(result.sample_id)
            self._wire_ids.discard(result.sample_id)
            return
        if p is None:  # cancelled or expired here meanwhile
            log.debug("result for unknown sample %s from %s ignored", result.sample_id, stream.address)
            return
        p.stream = None
        if result.HasField("error") and result.error.code == UNAVAILABLE:
            self._reroute([p], stream, result.error.message)
        elif not p.future.done():
            if p.wire_id is not p.sample_id:
                result.sample_id = p.sample_id
            p.future.set_result(result)

    def _refuse(self, stream: _TargetStream, exc: aio.AioRpcError) -> None:
        """The server refused the caller (auth): every sample pending there fails with that code, not retried."""
        message = refusal_message(stream.address, exc)
        log.error("%s", message)
        orphans = list(stream.pending.values())
        stream.pending.clear()
        for p in orphans:
            p.stream = None
            if not p.future.done():
                error = common_pb2.Status(code=exc.code().value[0], message=message)
                p.future.set_result(reward_pb2.RewardResult(sample_id=p.sample_id, reward=p.reward, error=error))

    def _reroute(self, orphans: list[_Pending], failed: _TargetStream, reason: str) -> None:
        for p in orphans:
            p.stream = None
            if p.future.done():
                continue
            p.attempts += 1
            p.errors.append(f"{failed.address}: {reason}")
            if p.attempts >= self.max_attempts:
                sid = p.sample_id
                p.future.set_result(
                    reward_pb2.RewardResult(
                        sample_id=sid,
                        reward=p.reward,
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
        self,
        samples: Sequence[common_pb2.Sample],
        reward: str,
        *,
        timeout: float | None = None,
        step_deadline: float | None = None,
    ) -> list[reward_pb2.RewardResult]:
        """One ScoreBatch call on the least-loaded usable target, retried elsewhere on UNAVAILABLE."""
        request = reward_pb2.ScoreBatchRequest(reward=reward, samples=samples)
        if timeout is not None:
            request.timeout.FromNanoseconds(int(timeout * 1e9))
        if step_deadline is not None:
            request.step_time_left.FromNanoseconds(max(0, int((step_deadline - time.monotonic()) * 1e9)))
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
        return sum(await asyncio.gather(*(_keep_traces_call(s, request) for s in self.streams)))

    async def announce_kept(self, kept: Mapping[str, str] | Sequence[str]) -> None:
        """As keep_traces, for a hot path: sample id -> traceparent (the one a sample sent without its trace
        context would have carried; "" or a plain list of ids: the one it came with). The ids ride on each
        target's open Score stream (no call, no answer); a target without one gets the KeepTraces call. Best
        effort, like every trace decision."""
        if not kept:
            return
        contexts = dict(kept) if isinstance(kept, Mapping) else dict.fromkeys(kept, "")
        request = reward_pb2.KeepTracesRequest(
            sample_ids=list(contexts), traceparents={sid: tp for sid, tp in contexts.items() if tp}
        )
        await asyncio.gather(*(_keep_traces_call(s, request) for s in self.streams if not s.keep_traces(contexts)))

    async def list_rewards(self) -> reward_pb2.ListRewardsResponse:
        (first, *_) = await self.pool.wait_for_members()
        return await first.stub.ListRewards(reward_pb2.ListRewardsRequest())

"""Dynamic batching of single samples onto batched reward sources, after Triton's dynamic batcher.

Knobs: `max_batch_size`, `max_batch_tokens` (padded: batch size x longest sample), `max_queue_delay_ms`
(wait for more work only while the oldest queued sample is younger than this), `max_queue_size`
(beyond it, reject at once), `max_concurrent_batches`. Queue policy: the oldest live sample always
goes into the next batch (bounded latency), the rest of the batch is filled with the samples
nearest to it in length (less padding). Expired samples are dropped before compute; cancelled ones
are skipped. The next batch forms while the current one computes.

Several tenants (training jobs sharing the server) queue side by side (`fair_queue.FairQueue`): a saturated
pipeline gives them batch slots by weight, each tenant's samples earliest step deadline first; a sample that can
no longer be scored by its step deadline (less time left than a batch takes) is answered DEADLINE_EXCEEDED at
once instead of computing. With one tenant and no step deadlines the order is plain arrival order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rewardmesh.common.errors import DeadlineExceeded, InvalidInput, QueueFull, SourceFailed, Unavailable
from rewardmesh.reward_engine.fair_queue import DEFAULT_TENANT, FairQueue, Lane, Queued, Tenant
from rewardmesh.reward_engine.types import BatchResult, RewardInput, RewardOutput

log = logging.getLogger(__name__)

ComputeFn = Callable[[list[RewardInput]], Awaitable[BatchResult]]


@dataclass
class BatcherConfig:
    """Triton-style dynamic batcher settings."""

    max_batch_size: int = 32
    max_batch_tokens: int = 0  # 0: no limit
    max_queue_delay_ms: float = 2.0
    max_queue_size: int = 4096
    max_concurrent_batches: int = 1

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_batch_tokens < 0:
            raise ValueError(f"max_batch_tokens must be >= 0, got {self.max_batch_tokens}")
        if self.max_queue_delay_ms < 0:
            raise ValueError(f"max_queue_delay_ms must be >= 0, got {self.max_queue_delay_ms}")
        if self.max_queue_size < 1:
            raise ValueError(f"max_queue_size must be >= 1, got {self.max_queue_size}")
        if self.max_concurrent_batches < 1:
            raise ValueError(f"max_concurrent_batches must be >= 1, got {self.max_concurrent_batches}")


@dataclass(slots=True)
class Scored:
    """A sample's result plus where its time went on this server."""

    output: RewardOutput
    queue_s: float
    compute_s: float
    batch_size: int


# Where a queued sample's outcome goes without a future: sink(token, Scored or the sample's exception),
# called once, at once (no loop round trip per sample), unless the ticket was cancelled first.
Sink = Callable[[Any, "Scored | BaseException"], None]


@dataclass
class BatchInfo:
    """What one executed batch looked like (for logs, metrics and batch spans)."""

    size: int
    padded_tokens: int
    real_tokens: int
    compute_s: float
    sample_ids: list[str]
    start_time_ns: int
    end_time_ns: int
    contexts: list[object]
    # Per sample, in sample_ids' order: seconds queued before the batch started, and the outcome (the output
    # or the exception that sample raised). What per-sample metrics and spans need, handed over once per batch.
    queue_s: list[float] = field(default_factory=list)
    outcomes: BatchResult = field(default_factory=list)


class Ticket:
    """One queued sample (slots: thousands are created per second). Its outcome goes to a future (`enqueue`)
    or to a sink (`put`); `cancel()` drops it if it has not been answered yet."""

    __slots__ = ("context", "deadline", "done", "due", "enqueued", "future", "inp", "sink", "tenant", "token",
                 "tokens")  # fmt: skip

    def __init__(
        self,
        inp: RewardInput,
        future: asyncio.Future[Scored] | None,
        enqueued: float,
        deadline: float | None,
        context: object = None,  # opaque per-sample context (a trace context), handed back in BatchInfo
        sink: Sink | None = None,
        token: Any = None,
        due: float | None = None,  # step deadline (time.monotonic()): scored by then, or DEADLINE_EXCEEDED early
        tenant: Tenant = DEFAULT_TENANT,
    ) -> None:
        self.inp = inp
        self.future = future
        self.sink = sink
        self.token = token
        self.done = False  # answered or cancelled (sink tickets; a future keeps its own state)
        self.enqueued = enqueued
        self.deadline = deadline
        self.due = due
        self.tenant = tenant
        self.context = context
        self.tokens = inp.num_tokens  # (a WireInput counts its ids without making arrays)

    @property
    def finished(self) -> bool:
        return self.done or (self.future is not None and self.future.done())

    def cancel(self) -> bool:
        """Drop the sample unless already answered; True if this call dropped it (nothing will be delivered)."""
        if self.future is not None:
            return self.future.cancel()
        if self.done:
            return False
        self.done = True
        self.token = None  # a token may be the ticket itself (a servicer's flight): no cycle left to collect
        return True

    def resolve(self, value: Scored | BaseException) -> None:
        """Deliver the outcome once (a cancelled or answered ticket ignores it)."""
        if self.future is not None:
            if not self.future.done():
                if isinstance(value, BaseException):
                    self.future.set_exception(value)
                else:
                    self.future.set_result(value)
            return
        if self.done:
            return
        self.done = True
        assert self.sink is not None
        token, self.token = self.token, None  # as in cancel: refcounting frees an answered ticket, not the GC
        try:
            self.sink(token, value)
        except Exception:  # a sink's bug must not strand the rest of the batch
            log.exception("result sink failed for sample %s", self.inp.sample_id)


class DynamicBatcher:
    """Collects concurrently submitted samples into batches for one compute function."""

    def __init__(
        self,
        compute: ComputeFn,
        config: BatcherConfig | None = None,
        *,
        name: str = "",
        on_batch: Callable[[BatchInfo], None] | None = None,
    ) -> None:
        self.config = config or BatcherConfig()
        self.name = name
        self._compute = compute
        self._on_batch = on_batch
        self._queue: FairQueue[Ticket] = FairQueue()
        self.service_s = 0.0  # how long a batch takes (moving average): a sample with less time left is hopeless
        self._prune_timer: asyncio.TimerHandle | None = None  # when the next queued sample becomes hopeless
        self._wake = asyncio.Event()
        self._slots = asyncio.Semaphore(self.config.max_concurrent_batches)
        self._running: set[asyncio.Task[None]] = set()
        self._late = 0  # samples a batch left to finish apart (a future in their place: see _answer_late)
        self._loop_task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def queue_depth(self) -> int:
        return self._queue.depth

    def tenant_queues(self) -> list[tuple[Tenant, int, float]]:
        """Per tenant seen here: (tenant, samples queued, seconds its longest-waiting sample has waited)."""
        now = time.monotonic()
        out = []
        for tenant, lane in self._queue.lanes.items():
            oldest = lane.oldest()
            out.append((tenant, lane.count, 0.0 if oldest is None else max(0.0, now - oldest)))
        return out

    @property
    def in_flight_batches(self) -> int:
        return len(self._running)

    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._schedule(), name=f"batcher:{self.name}")

    async def submit(
        self,
        inp: RewardInput,
        *,
        deadline: float | None = None,
        context: object = None,
        due: float | None = None,
        tenant: Tenant = DEFAULT_TENANT,
    ) -> Scored:
        """Queue one sample and wait for its result; `deadline` (start computing by) and `due` (step deadline:
        scored by) are time.monotonic() values."""
        # Cancellation of the caller cancels the future; the scheduler then skips the item.
        return await self.enqueue(inp, deadline=deadline, context=context, due=due, tenant=tenant)

    def enqueue(
        self,
        inp: RewardInput,
        *,
        deadline: float | None = None,
        context: object = None,
        due: float | None = None,
        tenant: Tenant = DEFAULT_TENANT,
    ) -> asyncio.Future[Scored]:
        """Queue one sample; its future resolves with the result. Cancelling the future drops the sample
        if it has not computed yet. No task per sample: a stream can hand thousands over cheaply."""
        loop = asyncio.get_running_loop()
        item = Ticket(inp, loop.create_future(), time.monotonic(), deadline, context, due=due, tenant=tenant)
        self.queue(item)
        assert item.future is not None
        return item.future

    def put(
        self,
        inp: RewardInput,
        sink: Sink,
        token: Any = None,
        *,
        deadline: float | None = None,
        context: object = None,
        now: float | None = None,
        due: float | None = None,
        tenant: Tenant = DEFAULT_TENANT,
    ) -> Ticket:
        """Queue one sample whose outcome goes to `sink(token, outcome)` (no future, no loop hop per sample:
        the cheapest way in for a server that handles thousands per second). `now`: its arrival time, when
        the caller already read the clock for a whole message."""
        arrived = time.monotonic() if now is None else now
        item = Ticket(inp, None, arrived, deadline, context, sink, token, due=due, tenant=tenant)
        self.queue(item)
        return item

    def queue(self, item: Ticket) -> None:
        """Queue a ticket the caller built: a subclass may carry the caller's own per-sample fields (the reward
        servicer's flight record is its sample's ticket), one object per sample instead of two. Raises (and
        queues nothing) when the pipeline, the tenant's share or its in-flight limit is full, or the sample's
        step deadline cannot be met."""
        self._admit(item)
        self._queue.push(item)
        item.tenant.in_flight += 1
        if item.due is not None:
            self._prune_when_hopeless(item.due)
        self._wake.set()

    def _prune_when_hopeless(self, due: float) -> None:
        """Fail the queued samples that cannot make their step deadline when the first of them becomes hopeless,
        even while every batch slot is busy (the scheduler prunes only when a slot is free)."""
        at = due - self.service_s
        timer = self._prune_timer
        if timer is not None and timer.when() <= at:
            return
        if timer is not None:
            timer.cancel()
        self._prune_timer = asyncio.get_running_loop().call_at(at, self._on_prune_timer)

    def _on_prune_timer(self) -> None:
        self._prune_timer = None
        self._prune()
        if (due := self._queue.earliest_due()) is not None:
            self._prune_when_hopeless(due)

    def _admit(self, item: Ticket) -> None:
        if self._closed:
            raise Unavailable(f"reward pipeline '{self.name}' is shutting down; send the sample elsewhere")
        tenant = item.tenant
        if tenant.max_in_flight and tenant.in_flight >= tenant.max_in_flight:
            raise QueueFull(
                f"tenant '{tenant.name}' has {tenant.in_flight} samples in flight on this server, its limit "
                "(max_in_flight); wait for results before sending more"
            )
        if item.due is not None and item.due - self.service_s <= item.enqueued:
            raise DeadlineExceeded(self._hopeless(item, item.enqueued))
        size = self.config.max_queue_size
        queue = self._queue
        if tenant.max_queue_share < 1:
            lane = queue.lanes.get(tenant)
            held = lane.count if lane is not None else 0
            if held >= tenant.max_queue_share * size:
                raise QueueFull(
                    f"tenant '{tenant.name}' holds {held} samples in reward pipeline '{self.name}', its share of the "
                    f"queue (max_queue_share {tenant.max_queue_share:g} of {size}); retry later"
                )
        if queue.depth >= size and not self._make_room(tenant):
            raise QueueFull(
                f"reward pipeline '{self.name}' queue is full ({size} samples"
                + (f", tenant '{tenant.name}' holds its share" if len(queue.lanes) > 1 else "")
                + "); retry later or raise max_queue_size"
            )
        if self._loop_task is None:
            self.start()

    def _make_room(self, tenant: Tenant) -> bool:
        """The queue is full: if `tenant` is under its weighted share, refuse the newest sample of the tenant
        furthest over its own share (the flooder pays, not its neighbours). False if none can make room."""
        lane = self._queue.lanes.get(tenant)
        held = lane.count if lane is not None else 0
        if held >= self._queue.share(tenant) * self.config.max_queue_size:
            return False
        victim_lane = self._queue.most_over_share(self.config.max_queue_size, tenant)
        if victim_lane is None:
            return False
        victim = self._queue.evict_newest(victim_lane)
        self._leave(victim)
        victim.resolve(
            QueueFull(
                f"reward pipeline '{self.name}' queue is full and tenant '{victim_lane.tenant.name}' holds more than "
                "its weighted share: its newest sample makes room for another tenant's; retry later"
            )
        )
        if self._loop_task is None:
            self.start()
        return True

    def _hopeless(self, item: Queued, now: float) -> str:
        left = item.due - now  # type: ignore[operator]
        if left <= 0:
            return f"step deadline passed {-left:.3f}s ago, after {now - item.enqueued:.3f}s in the reward queue"
        return (
            f"step deadline cannot be met: {left:.3f}s left, and a batch of reward pipeline '{self.name}' takes "
            f"about {self.service_s:.3f}s"
        )

    @staticmethod
    def _leave(item: Queued) -> None:
        item.tenant.in_flight -= 1

    async def close(self, *, drain: bool = True) -> None:
        """Stop taking work; with drain, finish what is queued and computing first."""
        self._closed = True
        if self._prune_timer is not None:
            self._prune_timer.cancel()
            self._prune_timer = None
        if drain:
            while self._queue.depth or self._running or self._late:
                self._wake.set()
                await asyncio.sleep(0.005)
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        for item in self._queue.take_all():
            self._leave(item)
            item.resolve(Unavailable(f"reward pipeline '{self.name}' shut down"))
        for task in list(self._running):
            task.cancel()

    # -- scheduling ---------------------------------------------------------------------------

    async def _schedule(self) -> None:
        while True:
            await self._slots.acquire()
            try:
                batch = await self._next_batch()
            except BaseException:
                self._slots.release()
                raise
            task = asyncio.get_running_loop().create_task(self._run(batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _next_batch(self) -> list[Ticket]:
        """Wait until a batch is due (full, or its oldest sample waited max_queue_delay_ms), then take it."""
        delay = self.config.max_queue_delay_ms / 1000.0
        while True:
            self._prune()
            if not self._queue.depth:
                self._wake.clear()
                await self._wake.wait()
                continue
            if self._batch_is_full() or delay == 0:
                return self._take()
            due = min(t for lane in self._queue.lanes.values() if (t := lane.oldest()) is not None) + delay
            now = time.monotonic()
            if now >= due:
                return self._take()
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), due - now)

    def _prune(self) -> None:
        """Drop cancelled samples, and fail expired ones and those that cannot make their step deadline, before
        they cost compute."""
        if not self._queue.depth:
            return
        now = time.monotonic()
        soon = now + self.service_s
        drop: dict[int, BaseException | None] = {}
        for item in self._queue.items():
            if item.finished:
                drop[id(item)] = None
            elif item.deadline is not None and now >= item.deadline:
                waited = now - item.enqueued
                drop[id(item)] = DeadlineExceeded(f"sample deadline passed after {waited:.3f}s in the reward queue")
            elif item.due is not None and item.due <= soon:
                drop[id(item)] = DeadlineExceeded(self._hopeless(item, now))
        if drop:
            for item in self._queue.remove(set(drop)):
                self._leave(item)
                if (error := drop[id(item)]) is not None:
                    item.resolve(error)

    def _batch_is_full(self) -> bool:
        cfg = self.config
        if self._queue.depth >= cfg.max_batch_size:
            return True
        if cfg.max_batch_tokens:
            longest = max(it.tokens for it in self._queue.items())
            return longest * self._queue.depth >= cfg.max_batch_tokens
        return False

    def _take(self) -> list[Ticket]:
        """The next sample in fair order (the oldest, with one tenant and no step deadlines) plus, within both
        limits, the samples nearest to it in length among the next few batches' worth in fair order."""
        cfg = self.config
        queue = self._queue
        if queue.depth <= cfg.max_batch_size and not cfg.max_batch_tokens:
            return queue.take_all()
        window = cfg.max_batch_size * 4
        candidates: list[tuple[Lane[Ticket], Ticket]] = []
        for lane, item in queue.fair_order(window):
            if item.finished:
                self._leave(item)
            else:
                candidates.append((lane, item))
        if not candidates:
            return []
        first = candidates[0][1]
        order = sorted(range(1, len(candidates)), key=lambda k: (abs(candidates[k][1].tokens - first.tokens), k))
        chosen = [0]
        longest = first.tokens
        for k in order:
            if len(chosen) >= cfg.max_batch_size:
                break
            new_longest = max(longest, candidates[k][1].tokens)
            if cfg.max_batch_tokens and new_longest * (len(chosen) + 1) > cfg.max_batch_tokens:
                continue
            chosen.append(k)
            longest = new_longest
        picked = set(chosen)
        queue.put_back([c for k, c in enumerate(candidates) if k not in picked])
        return sorted((candidates[k][1] for k in chosen), key=_arrival)

    async def _run(self, batch: list[Ticket]) -> None:
        try:
            live = [it for it in batch if not it.finished]
            if not live:
                return
            start = time.monotonic()
            start_ns = time.time_ns()
            try:
                results = await self._compute([it.inp for it in live])
                if len(results) != len(live):
                    raise SourceFailed(f"source returned {len(results)} results for a batch of {len(live)}")
            except asyncio.CancelledError:
                for it in live:
                    it.resolve(Unavailable(f"reward pipeline '{self.name}' shut down"))
                raise
            except Exception as exc:  # a whole-batch failure fails each sample, not the batcher
                log.warning("pipeline %s: batch of %d failed: %s", self.name, len(live), exc)
                err = exc if isinstance(exc, SourceFailed | InvalidInput) else SourceFailed(str(exc))
                results = [err] * len(live)
            queued = [start - it.enqueued for it in live]
            if any(isinstance(res, asyncio.Future) for res in results):  # slow samples, answered apart
                triples = zip(live, results, queued, strict=True)
                keep = [not self._answer_late(it, res, waited, start) for it, res, waited in triples]
                live = [it for it, k in zip(live, keep, strict=True) if k]
                results = [res for res, k in zip(results, keep, strict=True) if k]
                queued = [q for q, k in zip(queued, keep, strict=True) if k]
                if not live:
                    return
            end = time.monotonic()
            compute_s = end - start
            self.service_s = compute_s if not self.service_s else 0.8 * self.service_s + 0.2 * compute_s
            # The batch is described before its samples are answered: a sink may export a sample's spans at
            # once, and they link to the batch.
            if self._on_batch is not None:
                try:
                    self._on_batch(
                        BatchInfo(
                            size=len(live),
                            padded_tokens=len(live) * max(it.tokens for it in live),
                            real_tokens=sum(it.tokens for it in live),
                            compute_s=compute_s,
                            sample_ids=[it.inp.sample_id for it in live],
                            start_time_ns=start_ns,
                            end_time_ns=time.time_ns(),
                            contexts=[it.context for it in live],
                            queue_s=queued,
                            outcomes=results,
                        )
                    )
                except Exception:  # metrics or spans must never cost the batch its results
                    log.exception("pipeline %s: batch listener failed", self.name)
            size = len(live)
            for it, res, waited in zip(live, results, queued, strict=True):
                it.resolve(res if isinstance(res, BaseException) else Scored(res, waited, compute_s, size))
        finally:
            for it in batch:
                it.tenant.in_flight -= 1
            self._slots.release()

    def _answer_late(self, it: Ticket, res: object, waited: float, start: float) -> bool:
        """A source may leave a slow sample's result as a future (a call burning its budget must not hold its
        batch, nor the batch's slot): the sample is answered, as a batch of one, when it is done. True if so."""
        if not isinstance(res, asyncio.Future):
            return False
        self._late += 1
        it.tenant.in_flight += 1  # the batch lets go of it below; its tenant still waits for it

        def done(fut: asyncio.Future[Any]) -> None:
            self._late -= 1
            it.tenant.in_flight -= 1
            if fut.cancelled():
                outcome: RewardOutput | BaseException = Unavailable(f"reward pipeline '{self.name}' shut down")
            else:
                outcome = fut.exception() or fut.result()
            end = time.monotonic()
            if self._on_batch is not None:
                with contextlib.suppress(Exception):  # metrics or spans must never cost the sample its result
                    self._on_batch(BatchInfo(size=1, padded_tokens=it.tokens, real_tokens=it.tokens,
                                             compute_s=end - start, sample_ids=[it.inp.sample_id],
                                             start_time_ns=time.time_ns() - int((end - start) * 1e9),
                                             end_time_ns=time.time_ns(), contexts=[it.context], queue_s=[waited],
                                             outcomes=[outcome]))  # fmt: skip
            it.resolve(outcome if isinstance(outcome, BaseException) else Scored(outcome, waited, end - start, 1))

        res.add_done_callback(done)
        return True


def _arrival(item: Ticket) -> float:
    return item.enqueued

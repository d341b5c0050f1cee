"""Dynamic batching of single samples onto batched reward sources, after Triton's dynamic batcher.

Knobs: `max_batch_size`, `max_batch_tokens` (padded: batch size x longest sample), `max_queue_delay_ms`
(wait for more work only while the oldest queued sample is younger than this), `max_queue_size`
(beyond it, reject at once), `max_concurrent_batches`. Queue policy: the oldest live sample always
goes into the next batch (bounded latency), the rest of the batch is filled with the samples
nearest to it in length (less padding). Cancelled samples are skipped. The next batch forms while the
current one computes.

Work leaves the queue only when the pipeline's sources can start it (`StartLimits`, from each source's declared
capacity): a batch slot must be free, and where a source takes work per sample (worker processes, sandbox slots,
judge requests) a batch holds at most the free sample slots, each held until that sample's result is in. So every
waiting sample waits here, in fair order, up to the moment a worker starts it; no queue of a source's own sits
behind this one, whatever the knobs say (they are clamped to what can start: `describe_limits`). A source that
works on the event loop itself (an inline rule) has the loop as its capacity, shared with every tenant's messages:
it is handed one batch at a time, each of about INLINE_BATCH_S of loop time at its measured cost per sample, so a
sample that arrives waits for at most one short batch before the loop reads it and the queue starts it.

Which sample starts next, and what gives way for it when every slot is taken, is the scheduler's to say
(`scheduler.Scheduler`: tenants' fair shares, credit, preemption, overtaking, what each tenant is charged); when a
sample's deadline or step deadline ends its wait is `deadlines.Deadlines`'; running what is handed over and answering
its samples is `batch_runner.BatchRunner`'s. With one tenant and no step deadlines the order is plain arrival order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from rewardmesh.common.errors import Unavailable
from rewardmesh.reward_engine.batch_runner import BatchInfo, BatchRunner, ComputeFirstFn, ComputeFn, StartEachFn
from rewardmesh.reward_engine.deadlines import Deadlines
from rewardmesh.reward_engine.fair_queue import Lane, Queued, Tenant
from rewardmesh.reward_engine.scheduler import Scheduler
from rewardmesh.reward_engine.ticket import Ticket

log = logging.getLogger(__name__)

FAIR_SHARES = ("time", "samples")


@dataclass
class BatcherConfig:
    """Triton-style dynamic batcher settings."""

    max_batch_size: int = 32
    max_batch_tokens: int = 0  # 0: no limit
    max_queue_delay_ms: float = 2.0
    max_queue_size: int = 4096
    max_concurrent_batches: int = 1
    # What tenants' shares of a saturated pipeline count: "time", the sources' time each sample took (a tenant of
    # heavy samples does not get more of the workers than one of light samples), or "samples", one each.
    fair_share: str = "time"

    def __post_init__(self) -> None:
        if self.fair_share not in FAIR_SHARES:
            raise ValueError(f"fair_share must be one of {', '.join(FAIR_SHARES)}, got {self.fair_share!r}")
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


# An inline batch (a source working on the event loop itself) holds the loop about this long at most: its size is
# this over the measured loop time per sample, at least 1 and at most max_batch_size.
INLINE_BATCH_S = 0.001


class StartLimits(NamedTuple):
    """What a pipeline's sources can have started at once (None: no limit): `samples` per-sample slots (the least
    of its per-sample sources'), `batches` batch slots (the least of its per-batch sources'); `paced`: a source
    spaces its starts out (samples are then handed over one at a time, when its start delay allows); `inline`:
    the sources work on the event loop itself (one batch at a time, each bounded in loop time); `preemptible`: a
    started sample's work may be stopped and started again later, at `stop_cost_s` (see Capacity.preemptible);
    `aside`: of the `samples`, those held by the oldest started samples, which stepped aside (never stopped);
    `overtakes`: one batch beyond the `batches` may run ahead of those in flight (see Capacity.overtakes)."""

    samples: int | None = None
    batches: int | None = None
    paced: bool = False
    inline: bool = False
    preemptible: bool = False
    stop_cost_s: float = 0.0
    aside: int = 0
    overtakes: bool = False


NO_LIMITS = StartLimits()


class DynamicBatcher:
    """Collects concurrently submitted samples into batches for one compute function, handing a batch over only
    when `limits()` says the sources can start it."""

    def __init__(
        self,
        compute: ComputeFn,
        config: BatcherConfig | None = None,
        *,
        name: str = "",
        on_batch: Callable[[BatchInfo], None] | None = None,
        limits: Callable[[], StartLimits] | None = None,
        start_delay: Callable[[], float] | None = None,
        start_each: StartEachFn | None = None,
        compute_first: ComputeFirstFn | None = None,
    ) -> None:
        self.config = config or BatcherConfig()
        self.name = name
        self._limits = limits or (lambda: NO_LIMITS)
        self._start_delay = start_delay or (lambda: 0.0)
        # Called with each batch as it is handed to the source, in start order (observability: what started
        # when, and for whom).
        self.on_start: Callable[[list[Ticket]], None] | None = None
        self._wake = asyncio.Event()
        # What starts next and what gives way: the tenants' fair queue, shares, preemption and overtaking.
        self.scheduler = Scheduler(self.config, name, self._wake.set)
        self._queue = self.scheduler.queue
        self._deadlines = Deadlines(name, lambda: self.scheduler.service_s, self._expire)
        # Runs what is handed over and answers its samples.
        self.runner = BatchRunner(name, self.scheduler, self._deadlines, compute, limits=self._limits,
                                  freed=self._freed, serving=self._serving, on_batch=on_batch,
                                  start_each=start_each, compute_first=compute_first)  # fmt: skip
        self._batches = 0  # batches handed over and not yet returned
        self._held = 0  # samples handed over whose results are not in yet
        self.started = 0  # samples handed over since the start
        self._running: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def queue_depth(self) -> int:
        return self._queue.depth

    @property
    def service_s(self) -> float:
        """How long scoring takes (learnt by the scheduler)."""
        return self.scheduler.service_s

    @property
    def preemptions(self) -> int:
        return self.scheduler.preemptions

    @property
    def overtakes(self) -> int:
        return self.scheduler.overtakes

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
        return self._batches

    @property
    def in_flight_samples(self) -> int:
        """Samples handed to the source whose results are not in yet (what holds its slots)."""
        return self._held

    def inline_bound(self) -> int:
        """Samples the next inline batch may hold: about INLINE_BATCH_S of loop time at the measured cost per
        sample (one sample until one was measured), at least 1, at most max_batch_size."""
        cost = self.runner.inline_cost_s
        size = int(INLINE_BATCH_S / cost) if cost > 0 else 1
        return max(1, min(self.config.max_batch_size, size))

    def effective_config(self, lim: StartLimits | None = None) -> BatcherConfig:
        """The batching really run under `lim` (the sources' capacity; now, by default): the knobs clamped to what
        can start. Per-sample sources start and answer each sample apart: batches of 1 (as each result says), as
        many in flight as their slots allow, no queue delay. Sources on the event loop: one batch at a time, of
        the current bound. Batched sources: at most their batches in flight (and, beside per-sample ones, batches
        of at most their slots)."""
        cfg = self.config
        lim = self._limits() if lim is None else lim
        if lim.inline:
            return replace(cfg, max_batch_size=self.inline_bound(), max_concurrent_batches=1)
        size = cfg.max_batch_size if lim.samples is None else max(1, min(cfg.max_batch_size, lim.samples))
        if lim.paced:
            size = 1
        delay = 0.0 if lim.samples is not None else cfg.max_queue_delay_ms
        if lim.batches is not None:
            batches = max(1, min(cfg.max_concurrent_batches, lim.batches))
            return replace(cfg, max_batch_size=size, max_queue_delay_ms=delay, max_concurrent_batches=batches)
        if lim.samples is not None:
            in_flight = max(1, min(cfg.max_concurrent_batches * cfg.max_batch_size, lim.samples))
            return replace(cfg, max_batch_size=1, max_queue_delay_ms=0.0, max_concurrent_batches=in_flight)
        return replace(cfg, max_batch_size=size)

    def describe_limits(self) -> str:
        """What bounds the work handed over now, in words (for logs)."""
        cfg, lim = self.config, self._limits()
        if lim.inline:
            return (
                f"one batch at a time on the event loop, each of at most {cfg.max_batch_size} samples and about "
                f"{INLINE_BATCH_S * 1e3:g} ms of loop time at the measured cost per sample"
            )
        batches = cfg.max_concurrent_batches if lim.batches is None else min(cfg.max_concurrent_batches, lim.batches)
        samples = cfg.max_concurrent_batches * cfg.max_batch_size
        if lim.samples is not None:
            samples = min(samples, lim.samples)
            return (
                f"at most {samples} samples in flight, each answered when its own work is done (a batch holds at "
                f"most the free slots, up to {cfg.max_batch_size}; no queue delay)" + (", paced" if lim.paced else "")
            )
        ahead = ", and one more run ahead of them for a tenant back from idle" if lim.overtakes else ""
        return f"batches of up to {cfg.max_batch_size}, {batches} in flight" + ahead + (", paced" if lim.paced else "")

    def wake(self) -> None:
        """Look again at what can start (a source's capacity grew)."""
        self._wake.set()

    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._schedule(), name=f"batcher:{self.name}")

    def add(self, item: Ticket) -> Ticket:
        """Queue one sample: the batcher's one way in. The ticket carries all the sample brings (tenant, deadline,
        step deadline, context) and where its outcome goes; it is returned, so a caller may await its `future`.
        Raises (and queues nothing) when the pipeline, the tenant's share or its in-flight limit is full, or the
        sample's step deadline cannot be met."""
        self._admit(item)
        item.started = False
        item.inp.tenant = item.tenant.name
        self.scheduler.push(item)
        self._deadlines.watch(item)
        self._wake.set()
        return item

    def _expire(self, drop: dict[int, BaseException]) -> None:
        """Answer queued samples (by id()) whose deadlines ended their wait."""
        for item in self._queue.remove(set(drop)):
            self._leave(item)
            item.resolve(drop[id(item)])

    def _admit(self, item: Ticket) -> None:
        if self._closed:
            raise Unavailable(f"reward pipeline '{self.name}' is shutting down; send the sample elsewhere")
        self.scheduler.check_in_flight(item)
        self._deadlines.check_arrival(item)
        self.scheduler.admit(item)
        if self._loop_task is None:
            self.start()

    @staticmethod
    def _leave(item: Queued) -> None:
        item.tenant.in_flight -= 1

    async def close(self, *, drain: bool = True) -> None:
        """Stop taking work; with drain, finish what is queued and computing first."""
        self._closed = True
        self._deadlines.close()
        self.scheduler.close()
        if drain:
            while self._queue.depth or self._running or self.scheduler.apart:
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
        for fut, _ in list(self.scheduler.apart.values()):
            fut.cancel()  # its sample is answered UNAVAILABLE (see BatchRunner._answer_late)

    # -- forming batches and handing them over ----------------------------------------------------

    async def _schedule(self) -> None:
        while True:
            self._start(await self._next_batch())

    def _start(self, batch: list[Ticket]) -> None:
        """Hand `batch` to the source: its samples hold their slots from now on."""
        self._hold(batch)
        answered = self.runner.start_each(batch)
        if answered is not None:  # handed over whole: the batch itself holds nothing
            self._batches -= 1
            if answered:
                self._release(answered, dispatch=False)  # the scheduler takes the next: no recursion here
            return
        self.scheduler.batch_started(batch)
        self._spawn(self.runner.run(batch))

    def _spawn(self, run: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(run)
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    def _hold(self, batch: list[Ticket]) -> None:
        """`batch`'s samples hold their slots (and the batch its batch slot) from now on."""
        for it in batch:
            it.started = True
        self._batches += 1
        self._held += len(batch)
        self.started += len(batch)
        if self.on_start is not None:
            try:
                self.on_start(batch)
            except Exception:  # an observer's bug must not stop the pipeline
                log.exception("pipeline %s: start listener failed", self.name)
        self._deadlines.started()

    def _start_inline(self) -> None:
        """The next inline batch, taken from the queue when its turn of the loop comes, not now: a small step that
        arrives meanwhile is in it, instead of waiting for a batch taken before it came. The loop is held for it
        from now (no other inline batch starts)."""
        self._batches += 1
        self._spawn(self._run_inline())

    async def _run_inline(self) -> None:
        self._batches -= 1
        batch = self._take(self._room()) if self._queue.depth and not self._closed else []
        if not batch:
            self._wake.set()
            return
        self._hold(batch)
        await self.runner.run(batch)

    def _room(self) -> int:
        """Samples the next batch may hold now: 0 while every batch slot, or every per-sample slot, is taken.
        Samples in flight stay within the sources' per-sample capacity and within max_concurrent_batches x
        max_batch_size (what the knobs allowed before samples could be answered apart from their batch)."""
        lim = self._limits()
        cfg = self.config
        if lim.inline:  # the event loop is the capacity: one batch at a time, bounded in loop time
            return 0 if self._batches else self.inline_bound()
        batches = cfg.max_concurrent_batches if lim.batches is None else min(cfg.max_concurrent_batches, lim.batches)
        if self._batches >= batches:
            return 0
        samples = cfg.max_concurrent_batches * cfg.max_batch_size
        if lim.samples is not None:
            samples = min(samples, lim.samples)
        room = min(cfg.max_batch_size, samples - self._held)
        if lim.paced:
            room = min(room, 1)
        return max(room, 0)

    async def _next_batch(self) -> list[Ticket]:
        """Wait until the sources can start work and a batch is due (full, or its oldest sample waited
        max_queue_delay_ms; per-sample sources never wait for more), then take it."""
        while True:
            room = self._room() if self._queue.depth else 0
            if not room:
                if self._queue.depth:
                    self._give_way(self._limits())
                self._wake.clear()
                await self._wake.wait()
                continue
            wait = self._start_delay() if self._limits().paced else 0.0
            if wait > 0:  # a paced source: the next start is not allowed yet
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait)
                continue
            delay = 0.0 if self._limits().samples is not None else self.config.max_queue_delay_ms / 1000.0
            if delay == 0 or self._batch_is_full(room):
                batch = self._take(room)
                if batch:
                    return batch
                continue
            due = min(t for lane in self._queue.lanes.values() if (t := lane.oldest()) is not None) + delay
            now = time.monotonic()
            if now >= due:
                batch = self._take(room)
                if batch:
                    return batch
                continue
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), due - now)

    def _batch_is_full(self, room: int) -> bool:
        cfg = self.config
        if self._queue.depth >= room:
            return True
        if cfg.max_batch_tokens:
            longest = max(it.tokens for it in self._queue.items())
            return longest * self._queue.depth >= cfg.max_batch_tokens
        return False

    def _take(self, room: int) -> list[Ticket]:
        """Up to `room` samples that can still make it: the next in fair order (the oldest, with one tenant and no
        step deadlines) plus, within the limits, the samples nearest to it in length among the next few batches'
        worth in fair order (per-sample and inline sources: simply the next `room` in fair order, nothing to
        pad). A sample whose deadline passed, or that cannot make its step deadline, is answered DEADLINE_EXCEEDED
        here instead of taking a worker. Tenants are ordered by what they have had, what their running samples
        have run so far included."""
        grouped = bool(self.config.max_batch_tokens)
        inline = False
        if not grouped and self._queue.depth > room:
            lim = self._limits()
            grouped = lim.samples is None and not lim.inline
            inline = lim.inline
        # An inline batch ends with its first tenant's queued samples: a small step's results are handed back when
        # its own samples are done, not after a flooder's that would fill the batch behind them.
        taken = self._take_grouped(room) if grouped else self.scheduler.take(room, end_with_first=inline)
        now = time.monotonic()
        out = []
        for item in taken:
            if item.finished:
                self._leave(item)
            elif (overdue := self._deadlines.overdue(item, now)) is not None:
                self._leave(item)
                item.resolve(overdue)
            else:
                out.append(item)
        return out

    def _take_grouped(self, room: int) -> list[Ticket]:
        cfg = self.config
        window = room * 4
        candidates: list[tuple[Lane[Ticket], Ticket]] = []
        for lane, item in self.scheduler.window(window):
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
            if len(chosen) >= room:
                break
            new_longest = max(longest, candidates[k][1].tokens)
            if cfg.max_batch_tokens and new_longest * (len(chosen) + 1) > cfg.max_batch_tokens:
                continue
            chosen.append(k)
            longest = new_longest
        picked = set(chosen)
        self.scheduler.put_back([c for k, c in enumerate(candidates) if k not in picked])
        return sorted((candidates[k][1] for k in chosen), key=_arrival)

    def _give_way(self, lim: StartLimits) -> None:
        """Every slot is taken and samples wait: ask the scheduler what gives way. Started samples may be stopped
        for the next in fair order (`Scheduler.preempt`), or its batch may run ahead of those in flight, which pause
        for it (`Scheduler.may_overtake`)."""
        if self._closed:
            return
        if lim.preemptible:
            self.scheduler.preempt(lim)
        elif lim.overtakes and self.runner.compute_first is not None and self.scheduler.may_overtake():
            batch = self._take(self.config.max_batch_size)
            if batch:
                self.scheduler.batch_started(batch, ahead=True)
                self._hold(batch)
                self._spawn(self.runner.run(batch, first=True))

    def _release(self, samples: int, *, dispatch: bool = True) -> None:
        """Samples' slots are free: where the sources take work per sample, the next sample in fair order starts at
        once, and where they work on the event loop, the next inline batch (a loaded event loop would otherwise add
        its scheduler's turn to every hand-over, and to a small step's wait); else, or beyond that, the scheduler
        looks again."""
        self._held -= samples
        if dispatch and samples and not self._closed and self._queue.depth and self._loop_task is not None:
            lim = self._limits()
            if lim.inline and not self._batches:
                self._start_inline()
            elif lim.samples is not None and not lim.paced:
                room = self._room()
                if room:
                    batch = self._take(room)
                    if batch:
                        self._start(batch)
        self._wake.set()

    def _freed(self, batches: int, samples: int) -> None:
        """The runner let go of batch and sample slots."""
        self._batches -= batches
        self._release(samples)

    def _serving(self) -> bool:
        """The scheduling loop runs (a sample stopped for another tenant's may be queued again)."""
        return self._loop_task is not None and not self._loop_task.done()


def _arrival(item: Ticket) -> float:
    return item.enqueued

"""Running the batches the batcher hands over, and answering their samples.

The batcher decides when a batch is formed and handed over (with the scheduler's word on which samples); this part
runs it on the sources and reports: each sample answered exactly once (a whole-batch failure is each sample's
error), a sample the source answers apart (`RewardSource.start_each`) answered when its own work is done and
holding its slot until then, the batch described to `on_batch` before its samples are answered (a sample's spans
link to it), and what the batch took learnt and charged to its tenants (`Scheduler.learn`, `charge`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from rewardmesh.common.errors import InvalidInput, SourceFailed, Unavailable
from rewardmesh.reward_engine.deadlines import Deadlines
from rewardmesh.reward_engine.scheduler import Scheduler, moving_average
from rewardmesh.reward_engine.ticket import Scored, Ticket
from rewardmesh.reward_engine.types import ApartResult, BatchResult, Outcome, RewardInput, RewardOutput

if TYPE_CHECKING:
    from rewardmesh.reward_engine.batcher import StartLimits

log = logging.getLogger(__name__)

# A batch's outcomes, a future in the place of a sample answered apart (RewardSource.start_each).
ComputeFn = Callable[[list[RewardInput]], Awaitable[ApartResult]]
# A batch run ahead of those in flight: its outcomes, and the seconds it waited for them to pause (not charged).
ComputeFirstFn = Callable[[list[RewardInput]], Awaitable[tuple[ApartResult, float]]]
# Each sample's work started now, a future of its outcome each; None: the batch goes to the ComputeFn.
StartEachFn = Callable[[list[RewardInput]], "list[asyncio.Future[Outcome]] | None"]
# Slots free again: (batch slots, sample slots); the next work may be handed over at once.
FreedFn = Callable[[int, int], None]


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


class BatchRunner:
    """Runs handed-over batches on one pipeline's sources and answers their samples; tells the batcher, through
    `freed`, when their slots are free (it may hand the next work over at once)."""

    def __init__(
        self,
        name: str,
        scheduler: Scheduler,
        deadlines: Deadlines,
        compute: ComputeFn,
        *,
        limits: Callable[[], StartLimits],
        freed: FreedFn,
        serving: Callable[[], bool],
        on_batch: Callable[[BatchInfo], None] | None = None,
        start_each: StartEachFn | None = None,
        compute_first: ComputeFirstFn | None = None,
    ) -> None:
        self.name = name
        self.scheduler = scheduler
        self._deadlines = deadlines
        self._compute = compute
        self._limits = limits
        self._freed = freed
        self._serving = serving  # the batcher's scheduling loop runs (a stopped sample may be queued again)
        self.on_batch = on_batch
        self._start_each = start_each
        self.compute_first = compute_first
        # The loop's CPU time one sample of an inline batch takes, from its start to its result handed back, and
        # while the pipeline stays backlogged also what the loop did since the batch before (reading the next
        # samples' messages, writing the last results: what a flood costs the loop per sample, not only the rule's
        # own work) (moving average): what bounds an inline batch's size (DynamicBatcher.inline_bound).
        self.inline_cost_s = 0.0
        self._inline_mark: float | None = None  # the loop's CPU time when a backlogged inline batch ended
        self._overtaken_s = 0.0  # time the batches run ahead have taken, in all: not the paused batches' own

    def start_each(self, batch: list[Ticket]) -> int | None:
        """Start each sample's work now, where the pipeline can (no task, no turn of the event loop: a slot that
        frees is taken at once): each sample answered apart when its work is done. Returns how many samples were
        answered at once (their start failed: their slots are free now); None: it cannot, `run`."""
        if self._start_each is None:
            return None
        start = time.monotonic()
        try:
            futures = self._start_each([it.inp for it in batch])
            if futures is not None and len(futures) != len(batch):
                raise SourceFailed(f"source started {len(futures)} samples of a batch of {len(batch)}")
        except Exception as exc:  # a source's bug fails the batch's samples, not the batcher
            log.warning("pipeline %s: starting a batch of %d failed: %s", self.name, len(batch), exc)
            futures = [SourceFailed(str(exc))] * len(batch)  # type: ignore[list-item]
        if futures is None:
            return None
        late = 0
        for it, fut in zip(batch, futures, strict=True):
            if self._answer_late(it, fut, start - it.enqueued, start):
                late += 1
            else:  # not a future (the start failed): answered now
                it.resolve(fut)  # type: ignore[arg-type]
            it.tenant.in_flight -= 1  # the batch lets go of it (a late one is counted again until answered)
        return len(batch) - late

    async def run(self, batch: list[Ticket], *, first: bool = False) -> None:
        """Compute `batch` (`first`: ahead of the batches in flight, which pause for it) and answer its samples."""
        late = 0
        start = time.monotonic()
        overtaken = self._overtaken_s
        try:
            live = [it for it in batch if not it.finished]
            if not live:
                return
            start_ns = time.time_ns()
            start_cpu = time.thread_time()
            results, paused_s = await self._compute_batch(live, first)
            queued = [start - it.enqueued for it in live]
            if any(isinstance(res, asyncio.Future) for res in results):  # answered apart, each when it is done
                count = len(live)
                live, results, queued = self._apart(live, results, queued, start)
                late = count - len(live)
                if not live:
                    return
            outcomes = cast(BatchResult, results)  # the futures were taken out above
            # A batch that paused for one run ahead of it took its own time, not that one's too, and the one run ahead
            # its own, not its wait for the other to pause (learnt and charged).
            ran = self._overtaken_s - overtaken
            compute_s = max(time.monotonic() - start - (paused_s if first else ran), 0.0)
            if first:
                self._overtaken_s += compute_s
            self.scheduler.learn(compute_s)
            self._report(live, outcomes, queued, compute_s, start_ns)
            size = len(live)
            for it, res, waited in zip(live, outcomes, queued, strict=True):
                it.resolve(res if isinstance(res, BaseException) else Scored(res, waited, compute_s, size))
                self.scheduler.charge(it, compute_s / size)
            if self._limits().inline:
                self._measure_inline(start_cpu, size)
        finally:
            self.scheduler.batch_ended(batch, ahead=first)
            for it in batch:
                it.tenant.in_flight -= 1
            self._freed(1, len(batch) - late)

    async def _compute_batch(self, live: list[Ticket], first: bool) -> tuple[ApartResult, float]:
        """The sources' outcomes for `live` (a whole-batch failure: each sample's error), and, for a batch run
        ahead, how long it waited for the batches in flight to pause."""
        paused_s = 0.0
        try:
            if first and self.compute_first is not None:
                results, paused_s = await self.compute_first([it.inp for it in live])
            else:
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
        return results, paused_s

    def _apart(
        self, live: list[Ticket], results: ApartResult, queued: list[float], start: float
    ) -> tuple[list[Ticket], ApartResult, list[float]]:
        """The samples answered with the batch, their results and waits; those the source answers apart (a future)
        are left to `_answer_late`."""
        triples = zip(live, results, queued, strict=True)
        keep = [not self._answer_late(it, res, waited, start) for it, res, waited in triples]
        return (
            [it for it, k in zip(live, keep, strict=True) if k],
            [res for res, k in zip(results, keep, strict=True) if k],
            [q for q, k in zip(queued, keep, strict=True) if k],
        )

    def _report(
        self, live: list[Ticket], outcomes: BatchResult, queued: list[float], compute_s: float, start_ns: int
    ) -> None:
        """The batch described before its samples are answered: a sink may export a sample's spans at once, and
        they link to the batch."""
        if self.on_batch is None:
            return
        try:
            self.on_batch(
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
                    outcomes=outcomes,
                )
            )
        except Exception:  # metrics or spans must never cost the batch its results
            log.exception("pipeline %s: batch listener failed", self.name)

    def _measure_inline(self, start_cpu: float, size: int) -> None:
        """The loop's CPU an inline batch held, its results handed back included, and the loop's since the batch
        before if the queue was backlogged then (thread time: the waits a loaded host adds are not the batch's,
        and would shrink the bound for nothing)."""
        cpu = time.thread_time()
        since = start_cpu if self._inline_mark is None else min(start_cpu, self._inline_mark)
        self.inline_cost_s = moving_average(self.inline_cost_s, (cpu - since) / size)
        self._inline_mark = cpu if self.scheduler.queue.depth else None

    def _answer_late(self, it: Ticket, res: object, waited: float, start: float) -> bool:
        """A source may leave a sample's result as a future (each sample answered when its own work is done, and
        a call burning its budget holds neither its batch nor the batch's slot): the sample is answered, as a
        batch of one, when it is done, and holds its sample slot until then. True if so."""
        if not isinstance(res, asyncio.Future):
            return False
        self.scheduler.started_apart(it, res, start)
        it.tenant.in_flight += 1  # the batch lets go of it below; its tenant still waits for it

        def done(fut: asyncio.Future[Any]) -> None:
            it.tenant.in_flight -= 1
            # Before its slot frees: a sample stopped for another tenant's is queued again (the next in fair order
            # takes the slot), and what a sample took is learnt and charged (the next hand-over judges step
            # deadlines by the service time and picks its tenant by virtual time).
            end = time.monotonic()
            if self.scheduler.ended_apart(it, fut, end - start, requeue=self._serving()):
                self._deadlines.watch(it)
                self._freed(0, 1)
                return
            self._freed(0, 1)  # its slot was held until now
            if fut.cancelled():
                outcome: RewardOutput | BaseException = Unavailable(f"reward pipeline '{self.name}' shut down")
            else:
                outcome = fut.exception() or fut.result()
            if self.on_batch is not None:
                with contextlib.suppress(Exception):  # metrics or spans must never cost the sample its result
                    self.on_batch(BatchInfo(size=1, padded_tokens=it.tokens, real_tokens=it.tokens,
                                            compute_s=end - start, sample_ids=[it.inp.sample_id],
                                            start_time_ns=time.time_ns() - int((end - start) * 1e9),
                                            end_time_ns=time.time_ns(), contexts=[it.context], queue_s=[waited],
                                            outcomes=[outcome]))  # fmt: skip
            it.resolve(outcome if isinstance(outcome, BaseException) else Scored(outcome, waited, end - start, 1))

        res.add_done_callback(done)
        return True

"""The two deadlines a queued sample may carry, and when they end its wait.

`deadline` (start computing by) and `due` (its step's deadline: scored by). A sample whose deadline has passed, or
that can no longer be scored by its step deadline (less time left than scoring takes, `service_s`), is answered
DEADLINE_EXCEEDED instead of starting: when it arrives (`check_arrival`), when that moment comes while it waits
(one timer at the earliest such moment, over two heaps), and at the latest when it would start (`overdue`).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable

from rewardmesh.common.errors import DeadlineExceeded
from rewardmesh.reward_engine.ticket import Ticket


class Deadlines:
    """The queued samples' deadlines and step deadlines, in heaps (entries of samples that started or were answered
    are skipped), and one timer that answers those that expire while they wait, even while every slot is busy."""

    def __init__(
        self,
        name: str,
        service_s: Callable[[], float],
        expire: Callable[[dict[int, BaseException]], None],
    ) -> None:
        self.name = name
        self._service_s = service_s  # how long scoring takes now (learnt by the scheduler)
        self._expire = expire  # answers queued samples (by id()) with their errors, taking them out of the queue
        self._timer: asyncio.TimerHandle | None = None  # when the next queued sample expires or is hopeless
        self._deadlines: list[tuple[float, int, Ticket]] = []  # queued samples' deadlines (heap; stale entries skipped)
        self._dues: list[tuple[float, int, Ticket]] = []  # queued samples' step deadlines (heap; likewise)
        self._seq = itertools.count()
        self._closed = False

    def check_arrival(self, item: Ticket) -> None:
        """Raise DEADLINE_EXCEEDED for an arriving sample that cannot be scored by its step deadline."""
        if item.due is not None and item.due - self._service_s() <= item.enqueued:
            raise DeadlineExceeded(self.hopeless(item, item.enqueued))

    def watch(self, item: Ticket) -> None:
        """Follow a sample queued now (again, if it was preempted: its start deadline met, only its step's)."""
        if item.deadline is not None:
            heapq.heappush(self._deadlines, (item.deadline, next(self._seq), item))
            self._expire_at(item.deadline)
        if item.due is not None:
            heapq.heappush(self._dues, (item.due, next(self._seq), item))
            self._expire_at(item.due - self._service_s())

    def overdue(self, item: Ticket, now: float) -> DeadlineExceeded | None:
        """The error of a sample about to start that must not: its deadline passed, or its step deadline is nearer
        than scoring takes."""
        if item.deadline is not None and now >= item.deadline:
            return DeadlineExceeded(self._expired(item, now))
        if item.due is not None and item.due <= now + self._service_s():
            return DeadlineExceeded(self.hopeless(item, now))
        return None

    def started(self) -> None:
        """Samples started: their heap entries are stale now (skipped, so the timer follows the live ones)."""
        if self._deadlines or self._dues:
            self._skip_stale()

    def close(self) -> None:
        """The pipeline shuts down: the timer stops (a sample queued again meanwhile may set it once more)."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None

    def _expire_at(self, at: float) -> None:
        """Answer the queued samples that expire (deadline passed, or step deadline hopeless) when the first of
        them does; one timer, at the earliest such moment."""
        timer = self._timer
        if timer is not None and timer.when() <= at:
            return
        if timer is not None:
            timer.cancel()
        self._timer = asyncio.get_running_loop().call_at(at, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        now = time.monotonic()
        drop: dict[int, BaseException] = {}
        deadlines, dues = self._deadlines, self._dues
        while deadlines and deadlines[0][0] <= now:
            _, _, item = heapq.heappop(deadlines)
            if not item.started and not item.finished:
                drop[id(item)] = DeadlineExceeded(self._expired(item, now))
        service_s = self._service_s()
        soon = now + service_s
        while dues and dues[0][0] <= soon:
            _, _, item = heapq.heappop(dues)
            if not item.started and not item.finished and id(item) not in drop:
                drop[id(item)] = DeadlineExceeded(self.hopeless(item, now))
        if drop:
            self._expire(drop)
        self._skip_stale()
        nxt = [deadlines[0][0]] if deadlines else []
        if dues:
            nxt.append(dues[0][0] - service_s)
        if nxt and not self._closed:
            self._expire_at(max(min(nxt), now + 0.001))

    def _skip_stale(self) -> None:
        """Drop heap entries of samples no longer queued (started or answered), so the timer follows live ones."""
        for heap in (self._deadlines, self._dues):
            while heap and (heap[0][2].started or heap[0][2].finished):
                heapq.heappop(heap)

    def hopeless(self, item: Ticket, now: float) -> str:
        left = item.due - now  # type: ignore[operator]
        if left <= 0:
            return f"step deadline passed {-left:.3f}s ago, after {now - item.enqueued:.3f}s in the reward queue"
        return (
            f"step deadline cannot be met: {left:.3f}s left, and scoring in reward pipeline '{self.name}' takes "
            f"about {self._service_s():.3f}s"
        )

    @staticmethod
    def _expired(item: Ticket, now: float) -> str:
        return f"sample deadline passed after {now - item.enqueued:.3f}s in the reward queue"

"""One pipeline's queue, shared fairly by tenants (the training jobs that share a reward fleet).

Across tenants: weighted fair queuing (start-time fair queuing on a virtual clock). Every sample taken advances its
tenant's virtual time by 1/weight and the next sample comes from the backlogged tenant whose virtual time is least,
so while tenants stay backlogged they get slots in proportion to their weights. A share is a share of the sources'
time, not a count of samples: as a sample runs and once it ends, its tenant is charged what it really took
(`charge`, in units of the pipeline's mean sample), so a tenant whose samples run 30 ms does not get three times the
workers of one whose samples run 10 ms. A tenant that comes back after
sending less than its share keeps credit for what it left unused, up to BURST samples: its virtual time starts at
most BURST/weight behind the clock, so a small step sent at once is served ahead of a flooder's backlog, not
interleaved with it, and a tenant that keeps using more than its share has no credit left and alternates. When the
queue is full, the tenant furthest over its weighted share loses its newest sample to make room for a tenant under
its share: the flooder is the one that is refused. Within a tenant: earliest step deadline first, then arrival
order.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar


@dataclass(eq=False)
class Tenant:
    """Who a sample is scored for, with its share of the server and its limits (compared by identity)."""

    name: str = "default"
    # Share of a saturated pipeline, relative to the other tenants queued there.
    weight: float = 1.0
    # Most samples of this tenant queued or computing on this server, over all pipelines; 0: no limit.
    max_in_flight: int = 0
    # Most of a pipeline's max_queue_size this tenant's samples may hold (0 < share <= 1).
    max_queue_share: float = 1.0
    # Samples of this tenant the server's batchers hold now (queued or computing).
    in_flight: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"tenant '{self.name}': weight must be > 0, got {self.weight}")
        if self.max_in_flight < 0:
            raise ValueError(f"tenant '{self.name}': max_in_flight must be >= 0, got {self.max_in_flight}")
        if not 0 < self.max_queue_share <= 1:
            raise ValueError(f"tenant '{self.name}': max_queue_share must be in (0, 1], got {self.max_queue_share}")


DEFAULT_TENANT = Tenant()


def _arrival(item: Queued) -> float:
    return item.enqueued


# The credit, in samples, of a tenant back from idle (see the module's docstring): a few steps' worth of small
# samples. Lag stays bounded: no tenant is ever more than this many samples ahead of its weighted share.
BURST = 32


# Step deadlines this close count as one: the samples of one step (one deadline, carried as time left and turned
# back into a time on arrival, so they differ by microseconds) stay in arrival order.
DUE_TICK = 0.01


def _due_key(due: float) -> int:
    return round(due / DUE_TICK)


class Queued(Protocol):
    """What the queue needs of a queued sample (the batcher's Ticket)."""

    tenant: Tenant
    due: float | None  # step deadline, time.monotonic(); None: none
    enqueued: float
    tokens: int

    @property
    def finished(self) -> bool: ...


Q = TypeVar("Q", bound=Queued)


class Lane(Generic[Q]):
    """One tenant's samples in one pipeline: those with a step deadline in a heap (earliest first), the others
    in arrival order after them."""

    __slots__ = ("count", "edf", "fifo", "tenant", "vtime")

    def __init__(self, tenant: Tenant) -> None:
        self.tenant = tenant
        self.fifo: deque[Q] = deque()
        self.edf: list[tuple[int, int, Q]] = []  # (deadline in DUE_TICKs, arrival number, sample)
        self.vtime = 0.0  # virtual time of the next sample taken from this lane
        self.count = 0  # queued samples, cancelled ones included until they are dropped

    def pop(self) -> tuple[Q, tuple[int, int, Q] | None]:
        """The next sample, and its heap entry if it had a step deadline (to put it back where it was)."""
        self.count -= 1
        if self.edf:
            entry = heapq.heappop(self.edf)
            return entry[2], entry
        return self.fifo.popleft(), None

    def items(self) -> Iterator[Q]:
        for entry in self.edf:
            yield entry[2]
        yield from self.fifo

    def oldest(self) -> float | None:
        """Arrival time of the longest-waiting sample (the fifo's head; the heap is searched)."""
        times = [self.fifo[0].enqueued] if self.fifo else []
        if self.edf:
            times.append(min(entry[2].enqueued for entry in self.edf))
        return min(times) if times else None


class FairQueue(Generic[Q]):
    """Samples of many tenants, handed out in weighted-fair, earliest-deadline-first order (`fair_order`), or all
    at once when they fit one batch (`take_all`)."""

    def __init__(self) -> None:
        self.lanes: dict[Tenant, Lane[Q]] = {}
        self.depth = 0
        self._vclock = 0.0  # virtual time of the latest sample taken (the largest start tag served)
        self._window_clock = 0.0  # the clock when `fair_order` began taking (what `put_back` may return it to)
        self._seq = itertools.count()  # ties between equal deadlines go to the earlier arrival
        self._popped: dict[int, tuple[int, int, Q]] = {}  # heap entries `fair_order` took, for `put_back`

    def __len__(self) -> int:
        return self.depth

    def lane(self, tenant: Tenant) -> Lane[Q]:
        lane = self.lanes.get(tenant)
        if lane is None:
            lane = self.lanes[tenant] = Lane(tenant)
        return lane

    def push(self, item: Q) -> None:
        lane = self.lanes.get(item.tenant) or self.lane(item.tenant)
        if not lane.count:  # back from idle: credit for the share it left unused, up to BURST samples
            floor = self._clock() - BURST / lane.tenant.weight
            if lane.vtime < floor:
                lane.vtime = floor
        if item.due is None:
            lane.fifo.append(item)
        else:
            heapq.heappush(lane.edf, (_due_key(item.due), next(self._seq), item))
        lane.count += 1
        self.depth += 1

    def _clock(self) -> float:
        """The virtual time a tenant back from idle gets its credit against: the latest start tag served, but no
        later than the least virtual time of a tenant still queued. A backlogged tenant's charges can take its time
        back below the clock (its samples cost less than the mean sample as it started them, as a flood's batches
        grow): the credit is measured against what it really had."""
        clock = self._vclock
        for lane in self.lanes.values():
            if lane.count and lane.vtime < clock:
                clock = lane.vtime
        return clock

    def _unpop(self, lane: Lane[Q], item: Q) -> None:
        """Put back a sample taken but not used, where it was (its lane's charge refunded)."""
        self._put_front(lane, item, self._popped.pop(id(item), None))

    def requeue(self, item: Q) -> None:
        """Put a started sample whose work was stopped (preempted) back at the head of its lane, its start's charge
        refunded: it is the next of its tenant's to start, and its tenant has not had that time."""
        # first among its tenant's samples of the same step deadline
        entry = None if item.due is None else (_due_key(item.due), -next(self._seq), item)
        self._put_front(self.lane(item.tenant), item, entry)

    def _put_front(self, lane: Lane[Q], item: Q, entry: tuple[int, int, Q] | None) -> None:
        """`item` back in `lane` (its heap entry, if it has a step deadline; else at the fifo's head), its lane's
        start charge refunded."""
        if entry is None:
            lane.fifo.appendleft(item)
        else:
            heapq.heappush(lane.edf, entry)
        lane.count += 1
        self.depth += 1
        lane.vtime -= 1.0 / lane.tenant.weight

    def charge(self, tenant: Tenant, units: float) -> None:
        """Correct a started sample's charge (1 as it was taken) by `units` more (negative: less), once its real
        cost is known."""
        lane = self.lanes.get(tenant)
        if lane is not None:
            lane.vtime += units / tenant.weight

    def next_lane(self) -> Lane[Q] | None:
        """The lane `fair_order` takes from next (least virtual time; ties: the earlier lane), if any is queued."""
        best = None
        for lane in self.lanes.values():
            if lane.count and (best is None or lane.vtime < best.vtime):
                best = lane
        return best

    def fair_order(self, n: int, *, end_with_first: bool = False) -> Iterator[tuple[Lane[Q], Q]]:
        """Pop up to n live samples in fair order (dropped ones are yielded too: the caller skips them);
        `end_with_first`: none after the first one's lane has given all it holds."""
        backlog = [(lane.vtime, i, lane) for i, lane in enumerate(self.lanes.values()) if lane.count]
        heapq.heapify(backlog)
        self._popped = {}
        self._window_clock = self._vclock
        taken = 0
        first = backlog[0][2] if backlog else None
        while backlog and taken < n:
            vtime, i, lane = backlog[0]
            item, entry = lane.pop()
            if entry is not None:
                self._popped[id(item)] = entry
            self.depth -= 1
            if not item.finished:  # a cancelled sample costs its tenant nothing
                self._vclock = max(self._vclock, vtime)
                lane.vtime = vtime + 1.0 / lane.tenant.weight
                taken += 1
            if lane.count:
                heapq.heapreplace(backlog, (lane.vtime, i, lane))
            else:
                heapq.heappop(backlog)
            yield lane, item
            if end_with_first and lane is first and not lane.count:
                return

    def take_all(self) -> list[Q]:
        """Every queued sample in arrival order (the whole queue fits one batch), each lane charged for what it
        had, as `fair_order` would have charged it: a queued lane keeps its lead, whichever lane comes first here."""
        out: list[Q] = []
        parts = 0
        for lane in self.lanes.values():
            if lane.count:
                if lane.edf:  # a heap: never in arrival order by itself
                    out.extend([entry[2] for entry in lane.edf])
                    parts += 2
                if lane.fifo:
                    out.extend(lane.fifo)
                    parts += 1
                lane.vtime += lane.count / lane.tenant.weight
                # the clock moves to the start tag of the last sample served, as if they had been taken one by one
                self._vclock = max(self._vclock, lane.vtime - 1.0 / lane.tenant.weight)
                lane.fifo.clear()
                lane.edf.clear()
                lane.count = 0
        self.depth = 0
        if parts > 1:  # one part (the usual: one tenant, no deadlines) is in arrival order already
            out.sort(key=_arrival)
        return out

    def put_back(self, taken: list[tuple[Lane[Q], Q]]) -> None:
        """Return samples popped by `fair_order` and not used (newest first, so each lane keeps its order)."""
        for lane, item in reversed(taken):
            self._unpop(lane, item)
        for lane, _ in taken:  # the clock goes back to the first start tag not served (not before the window)
            self._vclock = max(self._window_clock, min(self._vclock, lane.vtime))

    def remove(self, drop: set[int]) -> list[Q]:
        """Take out the samples whose id() is in `drop`; returns them."""
        removed: list[Q] = []
        for lane in self.lanes.values():
            if not lane.count:
                continue
            if any(id(e[2]) in drop for e in lane.edf):
                removed += [e[2] for e in lane.edf if id(e[2]) in drop]
                lane.edf = [e for e in lane.edf if id(e[2]) not in drop]
                heapq.heapify(lane.edf)
            if any(id(it) in drop for it in lane.fifo):
                removed += [it for it in lane.fifo if id(it) in drop]
                lane.fifo = deque(it for it in lane.fifo if id(it) not in drop)
            lane.count = len(lane.edf) + len(lane.fifo)
        self.depth -= len(removed)
        return removed

    def items(self) -> Iterator[Q]:
        for lane in self.lanes.values():
            yield from lane.items()

    def share(self, tenant: Tenant) -> float:
        """The tenant's weighted share of the queued tenants (itself counted as queued)."""
        total = sum(lane.tenant.weight for lane in self.lanes.values() if lane.count and lane.tenant is not tenant)
        return tenant.weight / (total + tenant.weight)

    def most_over_share(self, capacity: int, besides: Tenant) -> Lane[Q] | None:
        """The lane (not `besides`'s) that holds the most over its weighted share of `capacity`, if any is over."""
        others = (lane.tenant.weight for lane in self.lanes.values() if lane.count and lane.tenant is not besides)
        total = sum(others) + besides.weight
        worst, excess = None, 0.0
        for lane in self.lanes.values():
            if lane.tenant is besides or not lane.count:
                continue
            over = lane.count - capacity * lane.tenant.weight / total
            if over > excess:
                worst, excess = lane, over
        return worst

    def evict_newest(self, lane: Lane[Q]) -> Q:
        """Remove the lane's least urgent sample: its newest without a deadline, else its latest deadline."""
        if lane.fifo:
            item = lane.fifo.pop()
        else:
            k = max(range(len(lane.edf)), key=lambda j: (lane.edf[j][0], lane.edf[j][1]))
            item = lane.edf[k][2]
            lane.edf[k] = lane.edf[-1]
            lane.edf.pop()
            heapq.heapify(lane.edf)
        lane.count -= 1
        self.depth -= 1
        return item

"""The scheduling policy of one pipeline: which sample starts next, and what gives way for it.

The batcher forms batches and hands them to the sources when they can start them; it asks this policy what comes
next (`take`, `window`), what gives way when every slot is taken (`preempt`: started samples stopped for a tenant
back from idle; `may_overtake`: a batch run ahead of those in flight) and tells it what started and ended. The
policy keeps the tenants' shares: the fair queue (`fair_queue.FairQueue`: weighted fair order, credit for a tenant
back from idle, earliest step deadline first within a tenant), what each tenant is charged for its samples (the
sources' time they really took, `charge`, and what its running samples have run so far, `_accrue`), the costs it
learns (`service_s`, `sample_cost_s`), and the admission limits of tenants (in flight, share of the queue; a full
queue refuses the flooder's newest sample, not its neighbour's).

The guarantee it keeps: a tenant's added wait under another's flood is at most the unit of work already started
when it arrives (none where started work is stopped for it), and a tenant that asks for more than its share gets
its share.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from rewardmesh.common.errors import QueueFull
from rewardmesh.reward_engine.fair_queue import FairQueue, Lane, Tenant
from rewardmesh.reward_engine.ticket import Ticket

if TYPE_CHECKING:
    from rewardmesh.reward_engine.batcher import BatcherConfig, StartLimits


def moving_average(average: float, value: float, weight: float = 0.2) -> float:
    """An exponential moving average with `value` weighing `weight`; the first value (average 0) as it is."""
    return value if not average else (1.0 - weight) * average + weight * value


def runs_on(usual_s: float, ran_s: float) -> float:
    """How much longer a started sample whose tenant's samples usually take `usual_s` and that has run `ran_s` can
    be expected to run: the rest of its usual time, or, once past it (a straggler), as long again as it overran."""
    return abs(usual_s - ran_s)


class Scheduler:
    """One pipeline's fair queue and the policy over it (see the module's docstring). `wake` asks the batcher to
    look again (a started sample became worth stopping)."""

    def __init__(self, config: BatcherConfig, name: str, wake: Callable[[], None]) -> None:
        self.config = config
        self.name = name
        self._wake = wake
        self.queue: FairQueue[Ticket] = FairQueue()
        # How long scoring takes (moving average; a batch's, or one sample's where samples are answered apart):
        # a sample with less time left before its step deadline is hopeless.
        self.service_s = 0.0
        # One sample's service time (moving average over every tenant's; a batch's shared by its samples): the
        # unit a tenant's fair share is charged in (`charge`).
        self.sample_cost_s = 0.0
        # One sample's service time per tenant, where samples are answered apart (moving average): how much longer a
        # started sample can be expected to run (`runs_on`) is read from its own tenant's samples, not from a mix
        # in which another tenant's short ones would make a long program look like a straggler near its end.
        self._usual: dict[Tenant, float] = {}
        # Units charged to a started sample (answered apart) for the time it has run beyond the start's charge of 1,
        # before it ends (`_accrue`): a tenant's share counts the slots its running programs hold, not only those
        # that have ended, so a tenant whose programs hang does not look behind its share while they hang.
        self._accrued: dict[Ticket, float] = {}
        # Samples answered apart whose work runs now (`started_apart`): each one's future (cancelling it stops the
        # work) and start.
        self.apart: dict[Ticket, tuple[asyncio.Future[Any], float]] = {}
        self._preempting: set[Ticket] = set()  # stopped for another tenant's, not yet back in the queue
        self._preempt_timer: asyncio.TimerHandle | None = None  # when a started sample becomes worth stopping
        self.preemptions = 0  # samples stopped for another tenant's and queued again, since the start
        # The batches handed over whole, until they end: each one's start, tenants and nearest step deadline, which
        # decide whether a batch may overtake them.
        self._runs: dict[int, tuple[float, frozenset[Tenant], float]] = {}
        self._overtaking = False  # a batch runs ahead of the others in flight, which pause for it
        self.overtakes = 0  # batches run ahead of those in flight, since the start

    # -- arrival ----------------------------------------------------------------------------------

    @staticmethod
    def check_in_flight(item: Ticket) -> None:
        """Refuse a sample of a tenant at its limit of samples in flight on this server."""
        tenant = item.tenant
        if tenant.max_in_flight and tenant.in_flight >= tenant.max_in_flight:
            raise QueueFull(
                f"tenant '{tenant.name}' has {tenant.in_flight} samples in flight on this server, its limit "
                "(max_in_flight); wait for results before sending more"
            )

    def admit(self, item: Ticket) -> None:
        """Refuse a sample whose tenant holds its share of the queue (max_queue_share), or that finds the queue full
        and cannot make room (`_make_room`)."""
        tenant = item.tenant
        size = self.config.max_queue_size
        queue = self.queue
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

    def _make_room(self, tenant: Tenant) -> bool:
        """The queue is full: if `tenant` is under its weighted share, refuse the newest sample of the tenant
        furthest over its own share (the flooder pays, not its neighbours). False if none can make room."""
        lane = self.queue.lanes.get(tenant)
        held = lane.count if lane is not None else 0
        if held >= self.queue.share(tenant) * self.config.max_queue_size:
            return False
        victim_lane = self.queue.most_over_share(self.config.max_queue_size, tenant)
        if victim_lane is None:
            return False
        victim = self.queue.evict_newest(victim_lane)
        victim.tenant.in_flight -= 1
        victim.resolve(
            QueueFull(
                f"reward pipeline '{self.name}' queue is full and tenant '{victim_lane.tenant.name}' holds more than "
                "its weighted share: its newest sample makes room for another tenant's; retry later"
            )
        )
        return True

    def push(self, item: Ticket) -> None:
        self.queue.push(item)
        item.tenant.in_flight += 1

    # -- what starts next -------------------------------------------------------------------------

    def take(self, room: int, *, end_with_first: bool = False) -> list[Ticket]:
        """The next `room` samples in fair order (every queued one, in arrival order, when they fit); tenants are
        ordered by what they have had, what their running samples have run so far included. `end_with_first`: none
        after the first one's tenant has given all it holds."""
        self._accrue_running()
        if self.queue.depth <= room:
            return self.queue.take_all()
        return [item for _, item in self.queue.fair_order(room, end_with_first=end_with_first)]

    def window(self, n: int) -> Iterator[tuple[Lane[Ticket], Ticket]]:
        """The next `n` samples in fair order, to pick a batch among (those not used go back: `put_back`), none
        after the first one's tenant has given all it holds."""
        self._accrue_running()
        return self.queue.fair_order(n, end_with_first=True)

    def put_back(self, unused: list[tuple[Lane[Ticket], Ticket]]) -> None:
        self.queue.put_back(unused)

    # -- what gives way ---------------------------------------------------------------------------

    def preempt(self, lim: StartLimits) -> None:
        """Every slot is taken and samples wait. If the tenant whose sample is next in fair order holds fewer than its
        weighted share of the slots and is far behind (a tenant back from idle, with its credit), stop the youngest
        started samples of tenants over their own share until it would hold its share, and beyond that, while its
        credit lasts, those its queued samples come before in fair order (none near its step deadline, none expected
        to end sooner than stopping it costs, none twice while it is its tenant's oldest, none that stepped aside):
        its samples start now, not when that work ends. A stopped sample goes back to the head of its tenant's lane,
        its start's charge refunded (the time it ran stays charged: its tenant held the slot). Shares are of the
        slots that serve: those of samples that stepped aside (the oldest, as many as `lim.aside`) are not."""
        if lim.samples is None or not self.apart:
            return
        now = time.monotonic()
        self._accrue(now)
        head = self.queue.next_lane()
        if head is None:
            return
        serving = lim.samples - lim.aside
        held, aside = self._holdings(lim.aside)
        weights = {lane.tenant: lane.tenant.weight for lane in self.queue.lanes.values() if lane.count}
        weights.update((tenant, tenant.weight) for tenant in held)
        per_weight = serving / sum(weights.values())
        tenant = head.tenant
        share = math.ceil(tenant.weight * per_weight - 1e-9) - held.get(tenant, 0)
        want = min(head.count, serving - held.get(tenant, 0)) - len(self._preempting)
        if want <= 0:
            return
        # Up to its share of the slots, each victim's tenant stays over its own share, and ahead of `tenant` in
        # virtual time by at least a share of the slots' worth of samples once its refunds are counted: the freed
        # slot goes to `tenant`, nobody is stopped for a tenant that has had more, and tenants that both stay
        # backlogged (a sample or two apart) never stop each other's. Beyond its share, `tenant` spends its credit:
        # a sample is stopped only for one of `tenant`'s that comes before it in fair order by that margin (a burst
        # sent after idle runs on every slot while its credit lasts, as the queue's order would have it).
        lead = per_weight
        given = len(self._preempting)
        vtimes = self._vtimes()
        later = math.inf  # when a sample not worth stopping yet becomes one (a straggler)
        for it in self._victims(tenant, aside, vtimes, now):  # the youngest first
            if want <= 0:
                break
            other = it.tenant
            refund = 1.0 / other.weight
            beyond = given >= share or held[other] <= other.weight * per_weight
            if vtimes[other] - refund < head.vtime + lead + (given / tenant.weight if beyond else 0.0):
                continue
            started = self.apart[it][1]
            usual = self._usual.get(other, self.service_s)
            if runs_on(usual, now - started) <= lim.stop_cost_s:
                later = min(later, started + usual + lim.stop_cost_s)  # as a straggler, it is worth it then
                continue
            if self.apart[it][0].cancel():  # its done callback puts it back in the queue (`ended_apart`)
                self._preempting.add(it)
                held[other] -= 1
                vtimes[other] -= refund
                want -= 1
                given += 1
        if want > 0 and later < math.inf:  # look again then (nothing else may wake the scheduler before)
            if self._preempt_timer is not None:
                self._preempt_timer.cancel()
            self._preempt_timer = asyncio.get_running_loop().call_at(later + 1e-3, self._wake)

    def _vtimes(self) -> dict[Tenant, float]:
        """Each queued tenant's virtual time, the start charges of its samples being stopped refunded."""
        vtimes = {lane.tenant: lane.vtime for lane in self.queue.lanes.values()}
        for it in self._preempting:
            vtimes[it.tenant] = vtimes.get(it.tenant, 0.0) - 1.0 / it.tenant.weight
        return vtimes

    def _holdings(self, aside_slots: int) -> tuple[dict[Tenant, int], set[Ticket]]:
        """The serving slots each tenant's started samples hold, and the samples that stepped aside (the oldest
        running, as many as `aside_slots`: see Capacity.aside), which hold none that serve."""
        apart = self.apart
        running = [it for it in apart if it not in self._preempting and not apart[it][0].done()]
        aside = set(sorted(running, key=lambda it: apart[it][1])[:aside_slots])
        held: dict[Tenant, int] = {}
        for it in apart:
            if it not in self._preempting and it not in aside:
                held[it.tenant] = held.get(it.tenant, 0) + 1
        return held, aside

    def _victims(self, tenant: Tenant, aside: set[Ticket], vtimes: dict[Tenant, float], now: float) -> list[Ticket]:
        """The started samples that may be stopped for `tenant`'s, the youngest first: another queued tenant's, not
        aside, not already stopping, none near its step deadline (two service times), and none stopped before while
        it is its tenant's oldest (each tenant's oldest started sample ends, so every sample does in turn: a stopped
        one starts again ahead of its tenant's others)."""
        apart = self.apart
        soon = now + 2 * self.service_s
        oldest: dict[Tenant, float] = {}
        for it, (_, started) in apart.items():
            oldest[it.tenant] = min(started, oldest.get(it.tenant, started))
        candidates = [it for it in apart if it.tenant is not tenant and it.tenant in vtimes and it not in aside
                      and (not it.preempted or apart[it][1] > oldest[it.tenant])
                      and it not in self._preempting and (it.due is None or it.due > soon)]  # fmt: skip
        return sorted(candidates, key=lambda it: apart[it][1], reverse=True)

    def may_overtake(self) -> bool:
        """Every batch slot is taken and samples wait. If the tenant whose sample is next in fair order has none in
        the batches running and its samples all came after those batches started (a tenant back from idle: nothing
        of it was passed over), its batch runs now, ahead of them: they pause at their next step until it is done,
        and its step waits for a step of theirs, not for their end. One such batch at a time. Tenants that both stay
        backlogged never overtake each other (each one's queued samples were there before the other's batch
        started), and a tenant overtakes only while the fair order puts it first, so it never gets more than its
        share this way. None is overtaken whose step deadline is less than two service times away."""
        if self._overtaking or not self._runs:
            return False
        head = self.queue.next_lane()
        arrived = None if head is None else head.oldest()
        if head is None or arrived is None:
            return False
        soon = time.monotonic() + 2 * self.service_s
        return not any(
            head.tenant in tenants or arrived <= started or due <= soon for started, tenants, due in self._runs.values()
        )

    # -- what started and ended -------------------------------------------------------------------

    def batch_started(self, batch: list[Ticket], *, ahead: bool = False) -> None:
        """A batch handed over whole: what a batch that may overtake it is judged against; `ahead`: it is the one
        run ahead of the others (`may_overtake`)."""
        if ahead:
            self._overtaking = True
            self.overtakes += 1
            return
        due = min((it.due for it in batch if it.due is not None), default=math.inf)
        self._runs[id(batch)] = (time.monotonic(), frozenset(it.tenant for it in batch), due)

    def batch_ended(self, batch: list[Ticket], *, ahead: bool) -> None:
        """A batch's run ended (`ahead`: it was the one run ahead of the others)."""
        self._runs.pop(id(batch), None)
        if ahead:
            self._overtaking = False

    def started_apart(self, it: Ticket, future: asyncio.Future[Any], start: float) -> None:
        """A sample answered apart runs now, until `future` is done (cancelling it stops the work)."""
        self.apart[it] = (future, start)

    def ended_apart(self, it: Ticket, future: asyncio.Future[Any], took_s: float, *, requeue: bool) -> bool:
        """A sample answered apart ended after `took_s`. True if its work was stopped for another tenant's: it is
        queued again (where `requeue`: the pipeline still serves). Else what it took is learnt (also as its
        tenant's usual) and charged to its tenant."""
        self.apart.pop(it, None)
        if it in self._preempting:
            self._preempting.discard(it)
            if future.cancelled() and requeue:
                self._requeue(it)
                return True
        self.learn(took_s)
        self._usual[it.tenant] = moving_average(self._usual.get(it.tenant, took_s), took_s)
        self.charge(it, took_s)
        return False

    def _requeue(self, it: Ticket) -> None:
        """A preempted sample back at the head of its tenant's lane (it started in time once: its start deadline is
        met; its step deadline still orders and bounds it)."""
        it.started = False
        it.preempted = True
        it.deadline = None
        self._accrued.pop(it, None)  # the time it ran stays charged: its tenant held the slot
        self.queue.requeue(it)
        it.tenant.in_flight += 1
        self.preemptions += 1

    # -- costs --------------------------------------------------------------------------------------

    def learn(self, compute_s: float) -> None:
        self.service_s = moving_average(self.service_s, compute_s)

    def charge(self, it: Ticket, cost_s: float) -> None:
        """Charge the sample's tenant what it really took of the sources' time, in units of the mean sample's (it
        was charged 1 as it started, and what `_accrue` charged while it ran): tenants share time, whatever their
        samples cost each."""
        accrued = self._accrued.pop(it, 0.0)
        if self.config.fair_share != "time":
            return
        mean = self.sample_cost_s
        self.sample_cost_s = moving_average(mean, cost_s, 0.05)
        if mean > 0:
            extra = cost_s / mean - 1.0 - accrued
            # What it accrued while it ran stays charged, though the mean may have grown since: a refund here would
            # put a tenant whose long programs just ended behind one it was ahead of a moment ago.
            self.queue.charge(it.tenant, max(extra, 0.0) if accrued > 0 else extra)

    def _accrue_running(self) -> None:
        if self.apart:
            self._accrue(time.monotonic())

    def _accrue(self, now: float) -> None:
        """Charge each running sample's tenant for the time it has run so far beyond the mean sample's, before the
        fair queue or a stop decides by tenants' virtual times (only where several tenants have queued here)."""
        mean = self.sample_cost_s
        if mean <= 0 or self.config.fair_share != "time" or len(self.queue.lanes) < 2:
            return
        accrued = self._accrued
        for it, (_, started) in self.apart.items():
            units = (now - started) / mean - 1.0
            charged = accrued.get(it, 0.0)
            if units > charged:
                self.queue.charge(it.tenant, units - charged)
                accrued[it] = units

    def close(self) -> None:
        if self._preempt_timer is not None:
            self._preempt_timer.cancel()
        self._preempt_timer = None

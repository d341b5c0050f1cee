"""The batcher's fair share between tenants and its step deadlines, with a recording compute function held open
by a gate (no gRPC, no timing: shares are counted in samples, `fair_share: samples`, so what each sample took
cannot move the order): what goes into each batch is decided by the queue alone. Shares counted in the sources'
time are tested here on the queue itself and, with real worker processes, in test_capacity."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest

from rewardmesh.common.errors import DeadlineExceeded, QueueFull, Unavailable
from rewardmesh.reward_engine.batcher import BatcherConfig, DynamicBatcher
from rewardmesh.reward_engine.fair_queue import BURST, FairQueue, Tenant
from rewardmesh.reward_engine.ticket import Scored, Ticket
from rewardmesh.reward_engine.types import BatchResult, RewardInput, RewardOutput
from tests.support.waiting import eventually

from .test_batcher import Recorder, inp


async def held_batcher(rec: Recorder, **config: float | str) -> tuple[DynamicBatcher, asyncio.Future[Scored]]:
    """A batcher whose first batch (one 'blocker' sample) holds the model until rec.gate is set: whatever is
    queued meanwhile is ordered by the queue alone."""
    rec.gate = asyncio.Event()
    b = DynamicBatcher(rec, BatcherConfig(**{"max_queue_delay_ms": 0, "fair_share": "samples", **config}))  # type: ignore[arg-type]
    blocker = b.add(Ticket(inp("blocker"))).future
    await eventually(lambda: rec.batches, "the blocker computes")
    return b, blocker


def tenant_of(sid: str) -> str:
    return sid.split("-")[0]


async def test_a_saturated_pipeline_gives_tenants_batch_slots_by_weight() -> None:
    rec = Recorder()
    b, blocker = await held_batcher(rec, max_batch_size=8)
    a, c = Tenant("a", weight=3), Tenant("c", weight=1)
    futures = [b.add(Ticket(inp(f"a-{i}"), tenant=a)).future for i in range(200)]
    futures += [b.add(Ticket(inp(f"c-{i}"), tenant=c)).future for i in range(200)]
    rec.gate.set()  # type: ignore[union-attr]
    await asyncio.gather(blocker, *futures)
    both_backlogged = rec.batches[1:21]  # 20 batches of 8: both tenants still had samples queued
    counts = Counter(tenant_of(sid) for batch in both_backlogged for sid in batch)
    assert counts == {"a": 120, "c": 40}, counts  # 3 : 1, exactly
    assert all(Counter(map(tenant_of, batch)) == {"a": 6, "c": 2} for batch in both_backlogged)
    assert sorted(sum(rec.batches, [])) == sorted(["blocker", *(f"a-{i}" for i in range(200)),
                                                   *(f"c-{i}" for i in range(200))])  # fmt: skip
    assert a.in_flight == c.in_flight == 0
    await b.close()


class Turnstile(Recorder):
    """Each batch waits for a permit: the test lets batches through one by one."""

    def __init__(self) -> None:
        super().__init__()
        self.permits = asyncio.Semaphore(0)

    async def __call__(self, batch: list[RewardInput]) -> BatchResult:
        self.batches.append([x.sample_id for x in batch])
        await self.permits.acquire()
        return [RewardOutput(1.0) for _ in batch]


async def test_a_tenant_that_arrives_behind_a_flood_is_served_in_the_next_batch() -> None:
    turnstile = Turnstile()
    b = DynamicBatcher(turnstile, BatcherConfig(max_batch_size=4, max_queue_delay_ms=0, fair_share="samples"))
    flood, late = Tenant("flood"), Tenant("late")
    futures = [b.add(Ticket(inp(f"flood-{i}"), tenant=flood)).future for i in range(400)]
    for _ in range(10):  # the flood has been served a while: ten batches done, the eleventh computing
        turnstile.permits.release()
    await eventually(lambda: len(turnstile.batches) == 11, "ten flood batches done, the eleventh computing")
    futures += [b.add(Ticket(inp(f"late-{i}"), tenant=late)).future for i in range(2)]
    for _ in range(200):
        turnstile.permits.release()
    await asyncio.gather(*futures)
    # Not behind 356 samples: the next batch, of its own samples only (a batch ends with its first tenant's queued).
    assert Counter(map(tenant_of, turnstile.batches[11])) == {"late": 2}
    assert Counter(map(tenant_of, turnstile.batches[12])) == {"flood": 4}
    assert flood.in_flight == late.in_flight == 0
    await b.close()


async def test_a_tenant_back_from_idle_goes_ahead_of_a_backlog_up_to_its_credit_then_alternates() -> None:
    """A small step sent at once (less than its share on average) is served ahead of a flooder's backlog, not
    interleaved with it; beyond BURST samples of credit the two alternate by weight."""
    turnstile = Turnstile()
    b = DynamicBatcher(turnstile, BatcherConfig(max_batch_size=4, max_queue_delay_ms=0, fair_share="samples"))
    flood, small = Tenant("flood"), Tenant("small")
    futures = [b.add(Ticket(inp(f"flood-{i}"), tenant=flood)).future for i in range(600)]
    for _ in range(10):
        turnstile.permits.release()
    await eventually(lambda: len(turnstile.batches) == 11, "ten flood batches done, the eleventh computing")
    futures += [b.add(Ticket(inp(f"small-{i}"), tenant=small)).future for i in range(BURST + 16)]
    for _ in range(400):
        turnstile.permits.release()
    await asyncio.gather(*futures)
    after = [tenant_of(sid) for batch in turnstile.batches[11:] for sid in batch]
    assert after[:BURST] == ["small"] * BURST, after[: BURST + 4]
    shared = after[BURST : BURST + 24]  # its credit spent: one each, alternating
    assert abs(shared.count("small") - shared.count("flood")) <= 2, shared
    assert flood.in_flight == small.in_flight == 0
    await b.close()


async def test_within_a_tenant_the_earliest_step_deadline_goes_first() -> None:
    rec = Recorder()
    b, blocker = await held_batcher(rec, max_batch_size=2)
    now = time.monotonic()
    futures = [b.add(Ticket(inp("none-0"))).future]
    futures += [b.add(Ticket(inp(f"due{s}"), due=now + s)).future for s in (50, 10, 30, 20)]
    futures += [b.add(Ticket(inp("none-1"))).future]
    rec.gate.set()  # type: ignore[union-attr]
    await asyncio.gather(blocker, *futures)
    # Each batch lists its samples in arrival order; the batches themselves follow the deadlines, and samples
    # without one follow every sample that has one, in arrival order.
    assert rec.batches[1:] == [["due10", "due20"], ["due50", "due30"], ["none-0", "none-1"]]
    await b.close()


async def test_a_full_queue_refuses_the_flooder_and_admits_its_neighbour() -> None:
    rec = Recorder()
    b, blocker = await held_batcher(rec, max_batch_size=4, max_queue_size=10)
    flood, neighbour = Tenant("flood"), Tenant("neighbour")
    flooded = [b.add(Ticket(inp(f"flood-{i}"), tenant=flood)).future for i in range(10)]
    with pytest.raises(QueueFull, match="queue is full"):
        b.add(Ticket(inp("flood-10"), tenant=flood))
    # The neighbour is under its share (half of 10): each of its samples pushes out the flooder's newest.
    mine = [b.add(Ticket(inp(f"neighbour-{i}"), tenant=neighbour)).future for i in range(5)]
    with pytest.raises(QueueFull, match="tenant 'neighbour' holds its share"):
        b.add(Ticket(inp("neighbour-5"), tenant=neighbour))
    pushed_out = [f for f in flooded if f.done()]
    assert len(pushed_out) == 5 and all(isinstance(f.exception(), QueueFull) for f in pushed_out)
    assert "tenant 'flood' holds more than its weighted share" in str(pushed_out[0].exception())
    assert [f for f in flooded if f.done()] == flooded[5:]  # the newest ones
    rec.gate.set()  # type: ignore[union-attr]
    await asyncio.gather(blocker, *mine, *flooded[:5])
    assert flood.in_flight == neighbour.in_flight == 0
    await b.close()


async def test_queue_share_and_in_flight_limits_refuse_only_their_tenant() -> None:
    rec = Recorder()
    b, blocker = await held_batcher(rec, max_batch_size=4, max_queue_size=100)
    capped = Tenant("capped", max_queue_share=0.1)
    counted = Tenant("counted", max_in_flight=3)
    other = Tenant("other")
    futures = [b.add(Ticket(inp(f"capped-{i}"), tenant=capped)).future for i in range(10)]
    with pytest.raises(QueueFull, match=r"tenant 'capped' holds 10 samples .*max_queue_share 0.1 of 100"):
        b.add(Ticket(inp("capped-10"), tenant=capped))
    futures += [b.add(Ticket(inp(f"counted-{i}"), tenant=counted)).future for i in range(3)]
    with pytest.raises(QueueFull, match=r"tenant 'counted' has 3 samples in flight .*max_in_flight"):
        b.add(Ticket(inp("counted-3"), tenant=counted))
    futures += [b.add(Ticket(inp(f"other-{i}"), tenant=other)).future for i in range(50)]
    rec.gate.set()  # type: ignore[union-attr]
    await asyncio.gather(blocker, *futures)
    assert counted.in_flight == 0
    await b.add(Ticket(inp("counted-again"), tenant=counted)).future  # room again once answered
    await b.close()


async def test_a_sample_that_cannot_make_its_step_deadline_is_failed_early_and_never_computed() -> None:
    rec = Recorder(delay=0.5)
    b = DynamicBatcher(rec, BatcherConfig(max_batch_size=1, max_queue_delay_ms=0, fair_share="samples"))
    await b.add(Ticket(inp("first"))).future  # teaches the batcher that a batch takes about 0.5 s
    assert b.service_s >= 0.5
    with pytest.raises(DeadlineExceeded, match=r"step deadline cannot be met: .* takes about"):
        b.add(Ticket(inp("hopeless"), due=time.monotonic() + 0.2))
    # Queued behind a slow batch: dropped as soon as its time left is less than a batch, not computed late.
    busy = b.add(Ticket(inp("busy"))).future
    await eventually(lambda: rec.active, "the busy batch computes")
    started = time.monotonic()
    late = b.add(
        Ticket(inp("late"), due=started + 0.8)
    ).future  # hopeless from started + 0.3 on: less than a batch left
    with pytest.raises(DeadlineExceeded, match="step deadline cannot be met"):
        await late
    assert time.monotonic() < started + 0.8  # reported before the deadline itself, while the model is busy
    await busy
    assert "hopeless" not in sum(rec.batches, []) and "late" not in sum(rec.batches, [])
    await b.close()


async def test_cancelled_expired_and_shut_down_samples_leave_their_tenants_count() -> None:
    rec = Recorder()
    b, blocker = await held_batcher(rec, max_batch_size=2)
    t = Tenant("t", max_in_flight=10)
    cancelled = [b.add(Ticket(inp(f"c{i}"), tenant=t)).future for i in range(3)]
    expired = b.add(Ticket(inp("x"), tenant=t, deadline=time.monotonic())).future
    left = [b.add(Ticket(inp(f"l{i}"), tenant=t)).future for i in range(3)]
    for f in cancelled:
        f.cancel()
    assert t.in_flight == 7
    await b.close(drain=False)  # the blocker's batch is cancelled; what is queued is answered UNAVAILABLE
    assert t.in_flight == 0
    outcomes = await asyncio.gather(blocker, expired, *left, return_exceptions=True)
    assert all(isinstance(o, Unavailable | DeadlineExceeded) for o in outcomes), outcomes


async def test_a_sample_answered_apart_from_its_batch_stays_in_its_tenants_count_until_answered() -> None:
    slow: asyncio.Future[RewardOutput] = asyncio.get_running_loop().create_future()

    async def compute(batch: list[RewardInput]) -> BatchResult:
        return [slow if x.sample_id == "slow" else RewardOutput(1.0) for x in batch]  # type: ignore[misc]

    b = DynamicBatcher(compute, BatcherConfig(max_batch_size=4, max_queue_delay_ms=50, fair_share="samples"))
    t = Tenant("t")
    fast, late = b.add(Ticket(inp("fast"), tenant=t)).future, b.add(Ticket(inp("slow"), tenant=t)).future
    await fast
    assert t.in_flight == 1 and not late.done()  # its batch is done; the sample is not
    slow.set_result(RewardOutput(2.0))
    assert (await late).output.score == 2.0 and t.in_flight == 0
    await b.close()


async def test_samples_of_one_step_deadline_keep_their_arrival_order() -> None:
    """One deadline sent as time left and turned back into a time on arrival differs by microseconds per sample:
    that must not reverse a step's samples (nor one step with another of the same deadline)."""
    rec = Recorder()
    b, blocker = await held_batcher(rec, max_batch_size=2)
    due = time.monotonic() + 10
    futures = [b.add(Ticket(inp(f"s{i}"), due=due - i * 1e-6)).future for i in range(6)]
    rec.gate.set()  # type: ignore[union-attr]
    await asyncio.gather(blocker, *futures)
    assert rec.batches[1:] == [["s0", "s1"], ["s2", "s3"], ["s4", "s5"]]
    await b.close()


class Item:
    """A queued sample as the queue sees it."""

    def __init__(self, tenant: Tenant, n: int) -> None:
        self.tenant, self.due, self.enqueued, self.tokens, self.n = tenant, None, float(n), 1, n
        self.finished = False


def test_a_queue_taken_whole_charges_its_tenants_as_taken_one_by_one() -> None:
    """B arrives with its credit while A is backlogged, and the whole queue then fits one batch. Taken at once or
    in fair order, each tenant has had the same: what comes next is in the same order either way (B's lead is not
    clipped because A's lane happened to be charged before it)."""
    a, b = Tenant("a"), Tenant("b")

    def backlog() -> FairQueue[Item]:
        queue: FairQueue[Item] = FairQueue()
        for n in range(200):
            queue.push(Item(a, n))
        assert len(list(queue.fair_order(100))) == 100
        for n in range(4):
            queue.push(Item(b, n))
        return queue

    whole, one_by_one = backlog(), backlog()
    assert len(whole.take_all()) == len(list(one_by_one.fair_order(104))) == 104
    orders = []
    for queue in (whole, one_by_one):
        for n in range(2 * BURST):
            queue.push(Item(a, n))
            queue.push(Item(b, n))
        orders.append([item.tenant.name for _, item in queue.fair_order(2 * BURST)])
    assert orders[0] == orders[1], orders
    assert orders[1][:BURST] == ["b"] * BURST  # B's credit from idle, counted against A's start tags


def test_a_tenant_charged_for_heavier_samples_gets_fewer_of_them() -> None:
    """Shares of time: each of A's samples turns out to cost four times the mean (charged 3 more once it is
    known), so while both are backlogged B gets four slots for each of A's."""
    queue: FairQueue[Item] = FairQueue()
    a, b = Tenant("a"), Tenant("b")
    for n in range(100):
        queue.push(Item(a, n))
        queue.push(Item(b, n))
    order: list[str] = []
    for _ in range(50):
        ((_, item),) = list(queue.fair_order(1))
        order.append(item.tenant.name)
        if item.tenant is a:
            queue.charge(a, 3.0)
    assert abs(order.count("b") - 4 * order.count("a")) <= 4, order


def test_a_tenant_back_from_idle_has_its_credit_against_what_a_cheaper_flood_really_had() -> None:
    """A's samples, taken 16 a batch, turn out to cost half the mean sample (each refunded half its start's charge
    once its batch is done: a flood whose batches grow gets cheaper per sample), so A's virtual time falls behind
    the latest start tag served. B, new, still comes before A's backlog for its whole credit (BURST samples), then
    alternates."""
    queue: FairQueue[Item] = FairQueue()
    a, b = Tenant("a"), Tenant("b")
    for n in range(400):
        queue.push(Item(a, n))
    for _ in range(8):
        assert len(list(queue.fair_order(16))) == 16
        for _ in range(16):
            queue.charge(a, -0.5)
    for n in range(2 * BURST):
        queue.push(Item(b, n))
    order = [item.tenant.name for _, item in queue.fair_order(BURST + 8)]
    assert order[:BURST] == ["b"] * BURST, order
    assert order[BURST:] == ["a", "b"] * 4, order

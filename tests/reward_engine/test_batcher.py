"""DynamicBatcher behaviour with a recording compute function (no gRPC, no model)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

from rewardmesh.common.errors import DeadlineExceeded, QueueFull, SourceFailed, Unavailable
from rewardmesh.reward_engine.batcher import BatcherConfig, BatchInfo, DynamicBatcher, StartLimits
from rewardmesh.reward_engine.fair_queue import Tenant
from rewardmesh.reward_engine.ticket import Ticket
from rewardmesh.reward_engine.types import BatchResult, RewardInput, RewardOutput
from tests.support.waiting import eventually, holds_for


def inp(sid: str, tokens: int = 4) -> RewardInput:
    return RewardInput(sid, np.zeros(1, np.int32), np.zeros(tokens - 1, np.int32))


class Recorder:
    """Compute function that records every batch and can be held open."""

    def __init__(self, delay: float = 0.0) -> None:
        self.batches: list[list[str]] = []
        self.delay = delay
        self.gate: asyncio.Event | None = None
        self.active = 0
        self.peak = 0

    async def __call__(self, batch: list[RewardInput]) -> BatchResult:
        self.batches.append([x.sample_id for x in batch])
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            if self.gate is not None:
                await self.gate.wait()
            if self.delay:
                await asyncio.sleep(self.delay)
        finally:
            self.active -= 1
        out: BatchResult = []
        for x in batch:
            out.append(SourceFailed(f"bad {x.sample_id}") if x.sample_id.startswith("bad") else RewardOutput(1.0))
        return out


async def test_collects_concurrent_samples_up_to_max_batch_size() -> None:
    rec = Recorder()
    b = DynamicBatcher(rec, BatcherConfig(max_batch_size=4, max_queue_delay_ms=50))
    results = await asyncio.gather(*(b.add(Ticket(inp(f"s{i}"))).future for i in range(10)))
    assert [len(x) for x in rec.batches] == [4, 4, 2]
    assert sorted(sum(rec.batches, [])) == sorted(f"s{i}" for i in range(10))  # each exactly once
    assert [r.batch_size for r in results] == [4] * 8 + [2] * 2
    await b.close()


async def test_waits_at_most_max_queue_delay_for_a_fuller_batch() -> None:
    rec = Recorder()
    # A delay far longer than a loaded machine takes to queue the second sample after the first.
    b = DynamicBatcher(rec, BatcherConfig(max_batch_size=64, max_queue_delay_ms=1000))
    t0 = time.monotonic()
    first = b.add(Ticket(inp("a"))).future
    await eventually(lambda: b.queue_depth == 1, "the first sample waits in the queue")
    second = b.add(Ticket(inp("b"))).future  # the scenario: it arrives while the first waits
    r1, r2 = await asyncio.gather(first, second)
    elapsed = time.monotonic() - t0
    assert rec.batches == [["a", "b"]]  # the second arrived within the delay and joined
    assert 0.99 <= elapsed < 30.0  # it waited for the delay (a lower bound), not for ever
    assert r1.queue_s >= 0.99 and r2.queue_s < r1.queue_s
    await b.close()


async def test_max_batch_tokens_counts_padding() -> None:
    rec = Recorder()
    b = DynamicBatcher(rec, BatcherConfig(max_batch_size=64, max_batch_tokens=40, max_queue_delay_ms=20))
    # Longest 20 tokens: at most 2 per batch (2 x 20 = 40); the short ones pack 10 to a batch of 4-token samples.
    samples = [inp("long0", 20), inp("long1", 20), inp("long2", 20)] + [inp(f"short{i}", 4) for i in range(10)]
    await asyncio.gather(*(b.add(Ticket(s)).future for s in samples))
    for batch in rec.batches:
        longest = max(20 if sid.startswith("long") else 4 for sid in batch)
        assert longest * len(batch) <= 40, batch
    assert sorted(sum(rec.batches, [])) == sorted(s.sample_id for s in samples)
    await b.close()


async def test_length_aware_grouping_keeps_oldest_and_groups_similar_lengths() -> None:
    rec = Recorder()
    rec.gate = asyncio.Event()
    b = DynamicBatcher(rec, BatcherConfig(max_batch_size=3, max_queue_delay_ms=0))
    blocker = b.add(Ticket(inp("blocker"))).future
    await eventually(lambda: rec.active == 1, "the blocker computes; the queue now fills")
    lengths = {"x10": 10, "y100": 100, "x11": 11, "y101": 101, "x12": 12, "y102": 102}
    tasks = [b.add(Ticket(inp(k, v))).future for k, v in lengths.items()]
    await eventually(lambda: b.queue_depth == 6, "all six queued behind the blocker")
    rec.gate.set()
    await asyncio.gather(blocker, *tasks)
    assert rec.batches[1] == ["x10", "x11", "x12"]  # oldest (x10) plus its nearest lengths
    assert rec.batches[2] == ["y100", "y101", "y102"]
    await b.close()


async def test_a_small_step_that_comes_first_in_fair_order_is_a_batch_of_its_own_whatever_its_lengths() -> None:
    """Length-aware grouping never splits a tenant's step that comes first (back from idle, with credit) among a
    flooder's samples nearer in length: the batch ends with that tenant's queued samples."""
    rec = Recorder()
    b = DynamicBatcher(rec, BatcherConfig(max_batch_size=8, max_queue_delay_ms=0))
    flooder, step = Tenant("flooder"), Tenant("step")
    await asyncio.gather(
        *(b.add(Ticket(inp(f"w{i}", 10), tenant=flooder)).future for i in range(40))
    )  # the flooder has had 40
    rec.gate, rec.batches = asyncio.Event(), []
    blocker = b.add(Ticket(inp("blocker"), tenant=flooder)).future
    await eventually(lambda: rec.active == 1, "the flooder's first batch computes; the queue now fills")
    flood = [b.add(Ticket(inp(f"a{i}", 10), tenant=flooder)).future for i in range(40)]
    lengths = {"b0": 10, "b1": 50, "b2": 60, "b3": 70}  # b0 is nearer in length to the flood than to b1-b3
    small = [b.add(Ticket(inp(sid, tokens), tenant=step)).future for sid, tokens in lengths.items()]
    rec.gate.set()
    await asyncio.gather(blocker, *flood, *small)
    assert rec.batches[1] == ["b0", "b1", "b2", "b3"]
    assert sorted(sum(rec.batches[2:], [])) == sorted(f"a{i}" for i in range(40))
    await b.close()


async def test_next_batch_forms_while_one_computes() -> None:
    rec = Recorder()
    rec.gate = asyncio.Event()
    b = DynamicBatcher(rec, BatcherConfig(max_batch_size=8, max_queue_delay_ms=0, max_concurrent_batches=1))
    first = b.add(Ticket(inp("first"))).future
    await eventually(lambda: rec.active == 1, "the first batch computes")
    rest = [b.add(Ticket(inp(f"r{i}"))).future for i in range(5)]
    await eventually(lambda: b.queue_depth == 5, "the rest queued meanwhile")
    assert rec.batches == [["first"]] and rec.peak == 1
    rec.gate.set()
    await asyncio.gather(first, *rest)
    assert rec.batches[1] == [f"r{i}" for i in range(5)]  # all queued meanwhile, one batch
    await b.close()


async def test_concurrent_batches_run_in_parallel() -> None:
    rec = Recorder(delay=0.05)
    b = DynamicBatcher(rec, BatcherConfig(max_batch_size=2, max_queue_delay_ms=0, max_concurrent_batches=3))
    await asyncio.gather(*(b.add(Ticket(inp(f"s{i}"))).future for i in range(6)))
    assert rec.peak == 3
    await b.close()


async def test_full_queue_rejects_at_once() -> None:
    rec = Recorder()
    rec.gate = asyncio.Event()
    b = DynamicBatcher(rec, BatcherConfig(max_batch_size=1, max_queue_delay_ms=0, max_queue_size=2))
    running = b.add(Ticket(inp("running"))).future
    await eventually(lambda: rec.active == 1, "one sample computes")
    queued = [b.add(Ticket(inp(f"q{i}"))).future for i in range(2)]
    await eventually(lambda: b.queue_depth == 2, "the queue is full")
    with pytest.raises(QueueFull, match="queue is full"):
        await b.add(Ticket(inp("overflow"))).future
    rec.gate.set()
    await asyncio.gather(running, *queued)
    assert "overflow" not in sum(rec.batches, [])
    await b.close()


async def test_expired_samples_are_dropped_before_compute() -> None:
    rec = Recorder()
    rec.gate = asyncio.Event()
    b = DynamicBatcher(rec, BatcherConfig(max_batch_size=8, max_queue_delay_ms=0))
    running = b.add(Ticket(inp("running"))).future
    await eventually(lambda: rec.active == 1, "one sample computes")
    late_deadline = time.monotonic() + 0.02
    late = b.add(Ticket(inp("late"), deadline=late_deadline)).future
    ok = b.add(Ticket(inp("ok"), deadline=time.monotonic() + 30)).future
    # Answered at its deadline, while the batch slot is still busy: not when the next batch forms.
    with pytest.raises(DeadlineExceeded, match="sample deadline passed"):
        await late
    assert rec.active == 1 and b.queue_depth == 1 and time.monotonic() >= late_deadline
    rec.gate.set()
    await asyncio.gather(running, ok)
    assert "late" not in sum(rec.batches, []) and "ok" in sum(rec.batches, [])
    await b.close()


async def test_cancelled_samples_are_skipped() -> None:
    rec = Recorder()
    rec.gate = asyncio.Event()
    b = DynamicBatcher(rec, BatcherConfig(max_batch_size=8, max_queue_delay_ms=0))
    running = b.add(Ticket(inp("running"))).future
    await eventually(lambda: rec.active == 1, "one sample computes")
    gone = b.add(Ticket(inp("gone"))).future
    kept = b.add(Ticket(inp("kept"))).future
    await eventually(lambda: b.queue_depth == 2, "both queued behind it")
    gone.cancel()
    rec.gate.set()
    await asyncio.gather(running, kept)
    assert "gone" not in sum(rec.batches, [])
    assert b.queue_depth == 0
    await b.close()


async def test_one_bad_sample_does_not_fail_its_batch_mates() -> None:
    b = DynamicBatcher(Recorder(), BatcherConfig(max_batch_size=8, max_queue_delay_ms=20))
    results = await asyncio.gather(
        b.add(Ticket(inp("good"))).future, b.add(Ticket(inp("bad"))).future, return_exceptions=True
    )
    assert not isinstance(results[0], BaseException) and results[0].output.score == 1.0
    assert isinstance(results[1], SourceFailed)
    await b.close()


async def test_whole_batch_exception_fails_each_sample_and_batcher_lives_on() -> None:
    calls = 0

    async def flaky(batch: list[RewardInput]) -> BatchResult:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("model exploded")
        return [RewardOutput(2.0) for _ in batch]

    b = DynamicBatcher(flaky, BatcherConfig(max_batch_size=8, max_queue_delay_ms=0))
    with pytest.raises(SourceFailed, match="model exploded"):
        await b.add(Ticket(inp("a"))).future
    assert (await b.add(Ticket(inp("b"))).future).output.score == 2.0
    await b.close()


async def test_batch_info_hook_and_close() -> None:
    seen: list[BatchInfo] = []
    b = DynamicBatcher(Recorder(), BatcherConfig(max_batch_size=8, max_queue_delay_ms=10), on_batch=seen.append)
    await asyncio.gather(
        b.add(Ticket(inp("a", 3), context="ctx-a")).future, b.add(Ticket(inp("b", 7), context="ctx-b")).future
    )
    assert len(seen) == 1
    info = seen[0]
    assert info.size == 2 and info.padded_tokens == 14 and info.real_tokens == 10
    assert info.sample_ids == ["a", "b"] and info.contexts == ["ctx-a", "ctx-b"]
    await b.close()
    with pytest.raises(Unavailable, match="shutting down"):
        await b.add(Ticket(inp("after"))).future


def test_config_validation_names_the_knob() -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        BatcherConfig(max_batch_size=0)
    with pytest.raises(ValueError, match="max_queue_size"):
        BatcherConfig(max_queue_size=0)


async def test_a_sink_ticket_is_answered_once_after_the_batch_is_described() -> None:
    """A ticket with a sink: no future per sample (asking for one is an error); the sink gets each outcome once,
    after the batch listener saw the batch (a sink may export spans that link to it); a cancelled ticket gets
    nothing; expiry reaches the sink."""
    events: list[object] = []
    rec = Recorder()
    rec.gate = asyncio.Event()
    b = DynamicBatcher(
        rec, BatcherConfig(max_batch_size=8, max_queue_delay_ms=0), on_batch=lambda i: events.append(i.sample_ids)
    )

    def sink(token: object, outcome: object) -> None:
        events.append((token, outcome if isinstance(outcome, BaseException) else outcome.batch_size))  # type: ignore[attr-defined]

    first = b.add(Ticket(inp("a"), sink=sink, token="tok-a"))  # computes alone, held at the gate
    with pytest.raises(TypeError, match="answers through a sink"):
        _ = first.future
    await eventually(lambda: rec.active == 1, "the first sample computes")
    queued = [b.add(Ticket(inp(sid), sink=sink, token=f"tok-{sid}")) for sid in ("b", "bad1", "c")]
    expired = b.add(Ticket(inp("late"), sink=sink, token="tok-late", deadline=time.monotonic() - 1))
    assert queued[2].cancel() and not queued[2].cancel()  # the first cancel drops it, a second is a no-op
    rec.gate.set()
    await eventually(lambda: len(events) >= 6, "every outcome delivered")
    assert first.done and expired.done
    assert events[:2] == [["a"], ("tok-a", 1)]
    late = [e for e in events if isinstance(e, tuple) and e[0] == "tok-late"]
    assert len(late) == 1 and isinstance(late[0][1], DeadlineExceeded)  # dropped before compute
    rest = [e for e in events[2:] if e not in late]
    assert rest[0] == ["b", "bad1"]  # the batch first, then its samples
    assert rest[1] == ("tok-b", 2)
    assert rest[2][0] == "tok-bad1" and isinstance(rest[2][1], SourceFailed)  # type: ignore[index]
    assert len(rest) == 3  # "c" was cancelled: never delivered, never computed
    await b.close()


# ------------------------------------------------------------------------------------------ capacity


class Apart:
    """A per-sample source's compute: each sample answered apart, by the test, through its future."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.futures: dict[str, asyncio.Future[Any]] = {}

    async def __call__(self, batch: list[RewardInput]) -> list[asyncio.Future[Any]]:
        loop = asyncio.get_running_loop()
        out = []
        for x in batch:
            self.started.append(x.sample_id)
            out.append(self.futures.setdefault(x.sample_id, loop.create_future()))
        return out

    def finish(self, sid: str) -> None:
        self.futures[sid].set_result(RewardOutput(1.0))


async def test_a_batch_holds_at_most_the_free_slots_and_a_sample_its_slot_until_answered() -> None:
    source = Apart()
    b = DynamicBatcher(
        source, BatcherConfig(max_batch_size=16, max_queue_delay_ms=50), limits=lambda: StartLimits(samples=2)
    )
    handed: list[list[str]] = []
    peak = [0]

    def on_start(batch: list[Any]) -> None:
        handed.append([t.inp.sample_id for t in batch])
        peak[0] = max(peak[0], b.in_flight_samples)

    b.on_start = on_start
    futures = [b.add(Ticket(inp(f"s{i}"))).future for i in range(6)]
    await eventually(lambda: len(source.started) == 2, "two samples start")
    await holds_for(lambda: len(source.started) == 2 and b.in_flight_samples == 2, "no third sample starts")
    source.finish("s1")  # one slot frees: exactly one more starts (the queue delay does not apply per sample)
    await eventually(lambda: len(source.started) == 3, "a third sample starts")
    assert (await futures[1]).batch_size == 1 and not futures[0].done()
    for sid in ("s0", "s2", "s3", "s4", "s5"):
        await eventually(lambda sid=sid: sid in source.futures, f"{sid} starts")  # type: ignore[misc]
        source.finish(sid)
    await asyncio.gather(*futures)
    assert handed[:2] == [["s0", "s1"], ["s2"]] and sorted(sum(handed, [])) == [f"s{i}" for i in range(6)]
    assert peak == [2] and b.in_flight_samples == 0
    await b.close()


async def test_a_paced_source_gets_one_sample_at_a_time_when_its_delay_allows() -> None:
    rec = Recorder()
    allowed = [0.0]
    b = DynamicBatcher(
        rec,
        BatcherConfig(max_batch_size=8, max_queue_delay_ms=0, max_concurrent_batches=4),
        limits=lambda: StartLimits(paced=True),
        start_delay=lambda: max(0.0, allowed[0] - time.monotonic()),
    )
    allowed[0] = time.monotonic() + 3600  # the next start is an hour away
    futures = [b.add(Ticket(inp(f"s{i}"))).future for i in range(3)]
    await holds_for(lambda: not rec.batches, "nothing starts before the source allows it")
    allowed[0] = 0.0
    b.wake()
    await asyncio.gather(*futures)
    assert rec.batches == [["s0"], ["s1"], ["s2"]]  # one at a time, never a batch queued in the source's limiter
    await b.close()


async def test_a_sample_that_can_no_longer_make_its_step_deadline_when_it_would_start_never_starts() -> None:
    """Checked where the work starts, with what scoring takes by then (it may have grown since the sample came)."""
    rec = Recorder()
    rec.gate = asyncio.Event()
    b = DynamicBatcher(rec, BatcherConfig(max_batch_size=1, max_queue_delay_ms=0))
    running = b.add(Ticket(inp("running"))).future
    await eventually(lambda: rec.active == 1, "one sample computes")
    later = b.add(Ticket(inp("later"), due=time.monotonic() + 30)).future  # fine when it comes: scoring took ~0 so far
    b.scheduler.service_s = 60.0  # scoring has come to take a minute
    rec.gate.set()
    with pytest.raises(DeadlineExceeded, match="step deadline cannot be met"):
        await later
    await running
    assert rec.batches == [["running"]]
    await b.close()


async def test_a_sample_answered_apart_teaches_its_time_before_its_slot_frees() -> None:
    """The first sample of a per-sample source to end frees its slot only once what it took is learnt: the sample
    queued behind it, whose step deadline is nearer than that, is answered DEADLINE_EXCEEDED and never starts."""
    source = Apart()
    b = DynamicBatcher(source, BatcherConfig(max_batch_size=1), limits=lambda: StartLimits(samples=1))
    first = b.add(Ticket(inp("first"))).future
    await eventually(lambda: source.started == ["first"], "the first sample starts")
    held = time.monotonic()
    await eventually(lambda: time.monotonic() - held >= 0.6, "the first sample has held its slot 0.6 s")
    hopeless = b.add(
        Ticket(inp("hopeless"), due=time.monotonic() + 0.5)
    ).future  # nothing has ended yet: scoring took ~0
    source.finish("first")
    await first
    await eventually(lambda: hopeless.done() or len(source.started) > 1, "the next sample answered or started")
    assert source.started == ["first"] and b.service_s >= 0.6
    with pytest.raises(DeadlineExceeded, match="step deadline cannot be met"):
        await hopeless
    await b.close()

"""DynamicBatcher behaviour with a recording compute function (no gRPC, no model)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from rewardmesh.common.errors import DeadlineExceeded, QueueFull, SourceFailed, Unavailable
from rewardmesh.reward_engine.batcher import BatcherConfig, BatchInfo, DynamicBatcher
from rewardmesh.reward_engine.types import BatchResult, RewardInput, RewardOutput
from tests.support.waiting import eventually


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
    results = await asyncio.gather(*(b.submit(inp(f"s{i}")) for i in range(10)))
    assert [len(x) for x in rec.batches] == [4, 4, 2]
    assert sorted(sum(rec.batches, [])) == sorted(f"s{i}" for i in range(10))  # each exactly once
    assert [r.batch_size for r in results] == [4] * 8 + [2] * 2
    await b.close()


async def test_waits_at_most_max_queue_delay_for_a_fuller_batch() -> None:
    rec = Recorder()
    # A delay far longer than the 10 ms gap, so the second joins even when a loaded machine wakes us late.
    b = DynamicBatcher(rec, BatcherConfig(max_batch_size=64, max_queue_delay_ms=300))
    t0 = time.monotonic()
    first = asyncio.create_task(b.submit(inp("a")))
    await asyncio.sleep(0.01)  # the scenario: the second sample arrives a moment after the first
    second = asyncio.create_task(b.submit(inp("b")))
    r1, r2 = await asyncio.gather(first, second)
    elapsed = time.monotonic() - t0
    assert rec.batches == [["a", "b"]]  # the second arrived within the delay and joined
    assert 0.29 <= elapsed < 30.0  # it waited for the delay (a lower bound), not for ever
    assert r1.queue_s >= 0.29 and r2.queue_s < r1.queue_s
    await b.close()


async def test_max_batch_tokens_counts_padding() -> None:
    rec = Recorder()
    b = DynamicBatcher(rec, BatcherConfig(max_batch_size=64, max_batch_tokens=40, max_queue_delay_ms=20))
    # Longest 20 tokens: at most 2 per batch (2 x 20 = 40); the short ones pack 10 to a batch of 4-token samples.
    samples = [inp("long0", 20), inp("long1", 20), inp("long2", 20)] + [inp(f"short{i}", 4) for i in range(10)]
    await asyncio.gather(*(b.submit(s) for s in samples))
    for batch in rec.batches:
        longest = max(20 if sid.startswith("long") else 4 for sid in batch)
        assert longest * len(batch) <= 40, batch
    assert sorted(sum(rec.batches, [])) == sorted(s.sample_id for s in samples)
    await b.close()


async def test_length_aware_grouping_keeps_oldest_and_groups_similar_lengths() -> None:
    rec = Recorder()
    rec.gate = asyncio.Event()
    b = DynamicBatcher(rec, BatcherConfig(max_batch_size=3, max_queue_delay_ms=0))
    blocker = asyncio.create_task(b.submit(inp("blocker")))
    await eventually(lambda: rec.active == 1, "the blocker computes; the queue now fills")
    lengths = {"x10": 10, "y100": 100, "x11": 11, "y101": 101, "x12": 12, "y102": 102}
    tasks = [asyncio.create_task(b.submit(inp(k, v))) for k, v in lengths.items()]
    await eventually(lambda: b.queue_depth == 6, "all six queued behind the blocker")
    rec.gate.set()
    await asyncio.gather(blocker, *tasks)
    assert rec.batches[1] == ["x10", "x11", "x12"]  # oldest (x10) plus its nearest lengths
    assert rec.batches[2] == ["y100", "y101", "y102"]
    await b.close()


async def test_next_batch_forms_while_one_computes() -> None:
    rec = Recorder()
    rec.gate = asyncio.Event()
    b = DynamicBatcher(rec, BatcherConfig(max_batch_size=8, max_queue_delay_ms=0, max_concurrent_batches=1))
    first = asyncio.create_task(b.submit(inp("first")))
    await eventually(lambda: rec.active == 1, "the first batch computes")
    rest = [asyncio.create_task(b.submit(inp(f"r{i}"))) for i in range(5)]
    await eventually(lambda: b.queue_depth == 5, "the rest queued meanwhile")
    assert rec.batches == [["first"]] and rec.peak == 1
    rec.gate.set()
    await asyncio.gather(first, *rest)
    assert rec.batches[1] == [f"r{i}" for i in range(5)]  # all queued meanwhile, one batch
    await b.close()


async def test_concurrent_batches_run_in_parallel() -> None:
    rec = Recorder(delay=0.05)
    b = DynamicBatcher(rec, BatcherConfig(max_batch_size=2, max_queue_delay_ms=0, max_concurrent_batches=3))
    await asyncio.gather(*(b.submit(inp(f"s{i}")) for i in range(6)))
    assert rec.peak == 3
    await b.close()


async def test_full_queue_rejects_at_once() -> None:
    rec = Recorder()
    rec.gate = asyncio.Event()
    b = DynamicBatcher(rec, BatcherConfig(max_batch_size=1, max_queue_delay_ms=0, max_queue_size=2))
    running = asyncio.create_task(b.submit(inp("running")))
    await eventually(lambda: rec.active == 1, "one sample computes")
    queued = [asyncio.create_task(b.submit(inp(f"q{i}"))) for i in range(2)]
    await eventually(lambda: b.queue_depth == 2, "the queue is full")
    with pytest.raises(QueueFull, match="queue is full"):
        await b.submit(inp("overflow"))
    rec.gate.set()
    await asyncio.gather(running, *queued)
    assert "overflow" not in sum(rec.batches, [])
    await b.close()


async def test_expired_samples_are_dropped_before_compute() -> None:
    rec = Recorder()
    rec.gate = asyncio.Event()
    b = DynamicBatcher(rec, BatcherConfig(max_batch_size=8, max_queue_delay_ms=0))
    running = asyncio.create_task(b.submit(inp("running")))
    await eventually(lambda: rec.active == 1, "one sample computes")
    late_deadline = time.monotonic() + 0.02
    late = asyncio.create_task(b.submit(inp("late"), deadline=late_deadline))
    ok = asyncio.create_task(b.submit(inp("ok"), deadline=time.monotonic() + 30))
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
    running = asyncio.create_task(b.submit(inp("running")))
    await eventually(lambda: rec.active == 1, "one sample computes")
    gone = asyncio.create_task(b.submit(inp("gone")))
    kept = asyncio.create_task(b.submit(inp("kept")))
    await eventually(lambda: b.queue_depth == 2, "both queued behind it")
    gone.cancel()
    rec.gate.set()
    await asyncio.gather(running, kept)
    assert "gone" not in sum(rec.batches, [])
    assert b.queue_depth == 0
    await b.close()


async def test_one_bad_sample_does_not_fail_its_batch_mates() -> None:
    b = DynamicBatcher(Recorder(), BatcherConfig(max_batch_size=8, max_queue_delay_ms=20))
    results = await asyncio.gather(b.submit(inp("good")), b.submit(inp("bad")), return_exceptions=True)
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
        await b.submit(inp("a"))
    assert (await b.submit(inp("b"))).output.score == 2.0
    await b.close()


async def test_batch_info_hook_and_close() -> None:
    seen: list[BatchInfo] = []
    b = DynamicBatcher(Recorder(), BatcherConfig(max_batch_size=8, max_queue_delay_ms=10), on_batch=seen.append)
    await asyncio.gather(b.submit(inp("a", 3), context="ctx-a"), b.submit(inp("b", 7), context="ctx-b"))
    assert len(seen) == 1
    info = seen[0]
    assert info.size == 2 and info.padded_tokens == 14 and info.real_tokens == 10
    assert info.sample_ids == ["a", "b"] and info.contexts == ["ctx-a", "ctx-b"]
    await b.close()
    with pytest.raises(Unavailable, match="shutting down"):
        await b.submit(inp("after"))


def test_config_validation_names_the_knob() -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        BatcherConfig(max_batch_size=0)
    with pytest.raises(ValueError, match="max_queue_size"):
        BatcherConfig(max_queue_size=0)


async def test_put_delivers_to_the_sink_once_after_the_batch_is_described() -> None:
    """put(): no future per sample; the sink gets each outcome once, after the batch listener saw the batch
    (a sink may export spans that link to it); a cancelled ticket gets nothing; expiry reaches the sink."""
    events: list[object] = []
    rec = Recorder()
    rec.gate = asyncio.Event()
    b = DynamicBatcher(
        rec, BatcherConfig(max_batch_size=8, max_queue_delay_ms=0), on_batch=lambda i: events.append(i.sample_ids)
    )

    def sink(token: object, outcome: object) -> None:
        events.append((token, outcome if isinstance(outcome, BaseException) else outcome.batch_size))  # type: ignore[attr-defined]

    first = b.put(inp("a"), sink, "tok-a")  # computes alone, held at the gate
    await eventually(lambda: rec.active == 1, "the first sample computes")
    queued = [b.put(inp(sid), sink, f"tok-{sid}") for sid in ("b", "bad1", "c")]
    expired = b.put(inp("late"), sink, "tok-late", deadline=time.monotonic() - 1)
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

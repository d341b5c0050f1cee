"""Work leaves the fair queue only when its source can start it, on every kind of real source: a function on real
worker processes, code in the real sandbox, a judge over HTTP against a slow local OpenAI-compatible server, the
tiny reward model and a rule inline on the event loop, each with its kind's default batching and with a user's.

In each, tenant A floods the pipeline while its source is held (its work cannot finish), two of A's samples wait with
deadlines they cannot make, then tenant B sends a small step and the source is let go. What decides B's latency is
asserted, not its latency: how many of A's samples started between B's arrival and each of B's starts (none before
B's first, then B's weighted half), that the source never had more started than its capacity (so what was handed
over is what ran: no queue of its own behind the fair queue), checked where the work really runs where that can be
seen (the function's worker processes log their starts, the judge server logs its requests), and that the samples
past their deadlines never took a worker.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch

from rewardmesh.common.errors import DeadlineExceeded
from rewardmesh.demo.tiny_models import TinyModelPaths
from rewardmesh.reward_engine.batcher import BatchInfo
from rewardmesh.reward_engine.engine import RewardEngine
from rewardmesh.reward_engine.fair_queue import BURST, Tenant
from rewardmesh.reward_engine.pipeline import RewardPipeline
from rewardmesh.reward_engine.sources.reward_model import layer_stack
from rewardmesh.reward_engine.sources.rules import RULES, register_rule
from rewardmesh.reward_engine.ticket import Scored, Ticket
from rewardmesh.reward_engine.types import Capacity, RewardInput
from tests.support.fake_openai import FakeOpenAI, Reply
from tests.support.sandbox import held_uids, needs_bwrap
from tests.support.servers import http_gateway, reward_server
from tests.support.waiting import eventually, holds_for

FNS = "tests/support/reward_fns.py"
# A user's batching, as a user wrote it for a function pipeline.
USER_BATCHING = {"max_batch_size": 16, "max_queue_delay_ms": 2, "max_queue_size": 4096}
BATCHINGS = pytest.mark.parametrize("batching", [None, USER_BATCHING], ids=["default", "user-batching"])
STEP = 8  # B's step: small, all at once

ONE_TEST = json.dumps({"inputs": ["1\n"], "outputs": ["1\n"]})  # a code sample's tests
ECHO = "```python\nprint(input())\n```"  # a program that passes them at once


def sleeping(seconds: float) -> str:
    """A program that passes ONE_TEST after holding its sandbox slot `seconds`."""
    return f"```python\nimport time\ntime.sleep({seconds})\nprint(input())\n```"


class Starts:
    """A pipeline's start log: each batch as it is handed to the source, and every moment the source had more
    started than its capacity, or than `workers()` says really run it (there must be none)."""

    def __init__(self, pipeline: RewardPipeline, workers: Callable[[], int] | None = None) -> None:
        self.pipeline = pipeline
        self.workers = workers
        self.batches: list[list[tuple[str, str]]] = []
        self.over: list[str] = []
        pipeline.batcher.on_start = self

    def __call__(self, batch: list[Ticket]) -> None:
        self.batches.append([(t.tenant.name, t.inp.sample_id) for t in batch])
        limits, batcher = self.pipeline.limits(), self.pipeline.batcher
        if limits.samples is not None and batcher.in_flight_samples > limits.samples:
            self.over.append(f"{batcher.in_flight_samples} samples started, capacity {limits.samples}")
        if self.workers is not None and batcher.in_flight_samples > self.workers():
            self.over.append(f"{batcher.in_flight_samples} samples started, {self.workers()} workers")
        ahead = 1 if limits.overtakes else 0  # one batch may run ahead of those in flight, which pause for it
        if limits.batches is not None and batcher.in_flight_batches > limits.batches + ahead:
            self.over.append(f"{batcher.in_flight_batches} batches started, capacity {limits.batches}")
        if limits.inline and batcher.in_flight_batches > 1:
            self.over.append(f"{batcher.in_flight_batches} inline batches started at once")

    @property
    def order(self) -> list[tuple[str, str]]:
        return [entry for batch in self.batches for entry in batch]

    def ids(self) -> set[str]:
        return {sid for _, sid in self.order}

    def of(self, tenant: str) -> Counter[str]:
        """How many times each of `tenant`'s samples started."""
        return Counter(sid for name, sid in self.order if name == tenant)


def a_before_each_b(order: list[str]) -> list[int]:
    """For each of B's samples, in start order: how many of A's started before it (in `order`, tenants' names)."""
    counts, a = [], 0
    for tenant in order:
        if tenant == "a":
            a += 1
        else:
            counts.append(a)
    return counts


def assert_b_goes_first_then_shares(order: list[str], first: int = 0) -> None:
    """From B's arrival on: at most `first` of A's samples before B's first, and B gets its weighted half after
    (B's k-th sample after at most k + 1 of A's): B never waits behind A's backlog."""
    counts = a_before_each_b(order)
    assert len(counts) == STEP, order
    assert counts[0] <= first, order
    assert all(c <= k + 1 + first for k, c in enumerate(counts)), (counts, order)


def sample(sid: str, response: str = "", ground_truth: str = "", tokens: int = 6, **extra: Any) -> RewardInput:
    return RewardInput(
        sid,
        np.arange(1, 3, dtype=np.int32),
        np.arange(3, 3 + tokens - 2, dtype=np.int32),
        response_text=response or sid,
        ground_truth=ground_truth or sid,
        extra_info=extra,
    )


@asynccontextmanager
async def pipeline_of(source: dict[str, Any], batching: dict[str, Any] | None) -> Any:
    engine = RewardEngine()
    engine.add_from_config({"p": {"sources": [source], **({"batching": batching} if batching else {})}})
    await engine.warmup()
    try:
        yield engine.pipelines["p"]
    finally:
        await engine.close(drain=False)


async def flood_then_step(
    pipeline: RewardPipeline,
    make: Callable[[str, int], RewardInput],
    flood: int,
    release: Callable[[], None],
    *,
    settled: Callable[[int], bool] = lambda held: True,
    on_arrival: Callable[[], None] = lambda: None,
    workers: Callable[[], int] | None = None,
) -> tuple[Starts, int, list[str]]:
    """A floods (`flood` samples) while the source is held (`settled(held)`: the `held` samples handed over are seen
    running where the work runs); two more of A's wait behind them with a deadline and a step deadline they cannot
    make, and are answered DEADLINE_EXCEEDED; B's step arrives (`on_arrival` marks it where the work runs); the
    source is let go (`release`). Returns the start log, where B arrived in it, and the two hopeless samples' ids."""
    starts = Starts(pipeline, workers)
    batcher = pipeline.batcher
    a, b = Tenant("a"), Tenant("b")
    flooding = [batcher.add(Ticket(make("a", i), tenant=a)).future for i in range(flood)]
    lim = pipeline.limits()

    def full() -> bool:
        if lim.samples is not None:
            return batcher.in_flight_samples >= lim.samples
        return batcher.in_flight_batches >= (lim.batches or batcher.config.max_concurrent_batches)

    await eventually(
        lambda: full() and batcher.queue_depth and settled(batcher.in_flight_samples),
        "A's flood holds every slot, the rest queued",
    )
    now = time.monotonic()
    late = batcher.add(Ticket(make("a", flood), tenant=a, deadline=now + 0.05)).future
    hopeless = batcher.add(Ticket(make("a", flood + 1), tenant=a, due=now + 0.2)).future
    for fut in (late, hopeless):
        with pytest.raises(DeadlineExceeded):
            await fut
    mark = len(starts.order)
    on_arrival()
    step = [batcher.add(Ticket(make("b", i), tenant=b)).future for i in range(STEP)]
    release()
    results: list[Scored] = await asyncio.wait_for(asyncio.gather(*step), 120)
    assert all(r.output.score is not None for r in results)
    await batcher.close(drain=False)
    await asyncio.gather(*flooding, return_exceptions=True)
    assert starts.over == [], starts.over
    return starts, mark, [make("a", flood).sample_id, make("a", flood + 1).sample_id]


@pytest.mark.parametrize(
    ("fields", "named"),
    [({"slots": -1}, "slots"), ({"per": "token"}, "per"), ({"held_elsewhere": -1}, "held_elsewhere"),
     ({"stop_cost_s": -0.1}, "stop_cost_s"), ({"stop_cost_s": float("nan")}, "stop_cost_s"),
     ({"slots": 2, "aside": 3}, "aside"), ({"slots": 2, "aside": -1}, "aside"),
     ({"slots": 2, "per": "sample", "overtakes": True}, "overtakes"), ({"overtakes": True}, "overtakes")],
)  # fmt: skip
def test_a_source_capacity_that_cannot_be_is_refused_by_name(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=f"capacity: {named}"):
        Capacity(**fields)


# ------------------------------------------------------------------------------ functions on worker processes


@BATCHINGS
async def test_a_function_pipeline_starts_a_small_step_next_on_its_worker_processes(
    batching: dict[str, Any] | None, tmp_path: Path
) -> None:
    log, gate = tmp_path / "starts.log", tmp_path / "gate"
    log.touch()
    source = {"type": "function", "function": f"{FNS}:logged_start", "max_workers": 2, "timeout_s": 60}

    def make(tenant: str, i: int) -> RewardInput:
        held: dict[str, Any] = {"gate": str(gate)} if tenant == "a" else {}
        return sample(f"{tenant}{i}", log=str(log), burn_ms=1, **held)

    processes: list[int] = []
    async with pipeline_of(source, batching) as pipeline:
        pool = pipeline.sources[0].source.pool
        pool.straggler_after_s = math.inf  # A's gated calls hold their workers until the gate opens, on any load
        starts, mark, hopeless = await flood_then_step(
            pipeline,
            make,
            60,
            gate.touch,
            settled=lambda held: len(log.read_text().split()) == held,
            on_arrival=lambda: processes.append(len(pool.pids)),
            workers=lambda: len(pool.pids),
        )
    assert_b_goes_first_then_shares([tenant for tenant, _ in starts.order[mark:]])
    # Where the work ran: the workers' own log. Each sample handed over started there, once (but for those still
    # waiting for a worker when the pipeline closed, at most one per worker), the hopeless ones never; and the
    # capacity the batcher kept to was the worker processes that ran them.
    in_workers = log.read_text().split()
    assert len(in_workers) == len(set(in_workers)) and set(in_workers) <= starts.ids()
    assert {f"b{i}" for i in range(STEP)} <= set(in_workers) and len(starts.ids() - set(in_workers)) <= 2
    assert not set(hopeless) & set(in_workers) and processes == [2]


@pytest.mark.parametrize("share", ["time", "samples"])
async def test_tenants_share_worker_time_not_sample_counts(share: str) -> None:
    """A's samples hold a worker 0.2 s, B's almost nothing; both keep a backlog on 2 real worker processes. Shares
    of time (the default): by the time A has 8 scored, B has had the workers as long, so several times as many
    samples. Shares counted in samples (`fair_share: samples`): one each, in turn."""
    source = {"type": "function", "function": f"{FNS}:sleepy", "max_workers": 2, "timeout_s": 60}
    a, b = Tenant("a"), Tenant("b")
    async with pipeline_of(source, {"fair_share": share}) as pipeline:
        batcher = pipeline.batcher
        heavy = [batcher.add(Ticket(sample(f"a{i}", sleep_s=0.2), tenant=a)).future for i in range(40)]
        light = [batcher.add(Ticket(sample(f"b{i}", sleep_s=0.002), tenant=b)).future for i in range(400)]
        await eventually(lambda: sum(f.done() for f in heavy) >= 8, "8 of A's scored", timeout_s=120)
        a_done, b_done = sum(f.done() for f in heavy), sum(f.done() for f in light)
        await batcher.close(drain=False)
        await asyncio.gather(*heavy, *light, return_exceptions=True)
    if share == "time":
        assert b_done >= 3 * a_done, (a_done, b_done)
    else:
        assert b_done <= a_done + 4, (a_done, b_done)


# ------------------------------------------------------------------------------------ code in the sandbox


@needs_bwrap
@BATCHINGS
async def test_a_code_pipeline_starts_a_small_step_next_in_its_sandbox_slots(batching: dict[str, Any] | None) -> None:
    source = {"type": "code", "workers": 2, "timeout_s": 10}

    def make(tenant: str, i: int) -> RewardInput:  # A's each hold a slot 0.3 s or more
        return sample(f"{tenant}{i}", response=sleeping(0.3) if tenant == "a" else ECHO, ground_truth=ONE_TEST)

    async with pipeline_of(source, batching) as pipeline:
        # Held by its own programs: none of A's ends before 0.3 s, so the two late ones cannot reach a slot in time.
        starts, mark, hopeless = await flood_then_step(pipeline, make, 24, lambda: None)
    assert_b_goes_first_then_shares([tenant for tenant, _ in starts.order[mark:]])
    assert not set(hopeless) & starts.ids()


@needs_bwrap
async def test_a_tenant_back_from_idle_takes_the_sandbox_slots_from_a_flooder_at_once() -> None:
    """A's programs hold both sandbox slots far longer than the test waits (as a program running out a long budget
    would). B's step, sent after A has had far more than its share, still runs at once on both slots: its half, and
    beyond it on its credit (its samples come before A's next in fair order). A's programs are stopped: a slot takes
    the warm spare at once, the sandbox it gave up becoming the spare once reset, the other's sandbox resets and
    serves B's samples (no sandbox retired, none started), and the stopped samples go back to the head of A's lane
    and start again once each. Every sample of both is answered exactly once."""
    source = {"type": "code", "workers": 2, "timeout_s": 300}
    async with pipeline_of(source, None) as pipeline:
        sandbox = pipeline.sources[0].source.sandbox
        sandbox.straggler_after_s = math.inf  # A's programs hold their slots (none steps aside)
        starts = Starts(pipeline, workers=lambda: sandbox.workers)
        batcher, a, b = pipeline.batcher, Tenant("a"), Tenant("b")
        # A has flooded a while (ten programs scored) before its programs hang.
        flooding = [batcher.add(Ticket(sample(f"a{i}", ECHO if i < 10 else sleeping(200), ONE_TEST), tenant=a)).future
                    for i in range(16)]  # fmt: skip
        await eventually(lambda: sum(f.done() for f in flooding) == 10 and len(sandbox._running) == 2,
                         "A's first programs scored, and its next run in both slots")  # fmt: skip
        started = sandbox.stats["started"]
        step = [batcher.add(Ticket(sample(f"b{i}", ECHO, ONE_TEST), tenant=b)).future for i in range(STEP)]
        results: list[Scored] = await asyncio.wait_for(asyncio.gather(*step), 120)
        assert [r.output.score for r in results] == [1.0] * STEP
        assert not any(f.done() for f in flooding[10:])  # scored while A's programs still run
        assert batcher.preemptions == 2 and sandbox.stats["jobs stopped"] == 2  # both slots, once each
        assert not [k for k in sandbox.stats if k.startswith("retired")], sandbox.stats
        assert sandbox.stats["stops that gave the slot the spare"] >= 1  # the spare was warm: taken at the first
        await eventually(lambda: sorted(starts.of("a").values()) == [1] * 10 + [2] * 2, "the stopped samples restarted")
        await eventually(lambda: len(sandbox._running) == 2, "A's programs run again in both slots")
        assert sandbox.stats["started"] == started and sandbox.warm.spare is not None  # the stopped one is the spare
        assert not [k for k in sandbox.stats if k.startswith("retired")], sandbox.stats
        await batcher.close(drain=False)
        await asyncio.gather(*flooding, return_exceptions=True)
    assert starts.of("b") == Counter(f"b{i}" for i in range(STEP))
    assert starts.over == [], starts.over


@needs_bwrap
async def test_programs_that_step_aside_run_on_beside_the_slots_and_are_never_stopped_for_another_tenant() -> None:
    """A's programs hang far past the straggler time (1 s here) with more of A's queued: each steps aside once past
    it (it runs on in its own sandbox, under a uid of its own, and the pool's capacity grows by one), up to the
    pool's stragglers, and A's next programs take the two slots. B's step, sent then, stops only A's programs in the
    two slots that serve, once each: the stragglers run on, unstopped, while B's samples are scored in the slots. No
    two live sandboxes share a uid, and the source never had more started than its slots at that moment."""
    source = {"type": "code", "workers": 2, "timeout_s": 300}
    async with pipeline_of(source, None) as pipeline:
        sandbox = pipeline.sources[0].source.sandbox
        starts = Starts(pipeline, workers=lambda: sandbox.slots)
        batcher, a, b = pipeline.batcher, Tenant("a"), Tenant("b")
        flooding = [batcher.add(Ticket(sample(f"a{i}", sleeping(200), ONE_TEST), tenant=a)).future for i in range(12)]
        most = sandbox.max_stragglers
        await eventually(lambda: sandbox.stragglers == most and len(sandbox._running) == most + 2,
                         "A's programs stepped aside, and A's next run in both slots")  # fmt: skip
        assert pipeline.limits().samples == pipeline.limits().aside + 2 == most + 2
        aside = [run for run in sandbox._running if run.aside]
        uids = held_uids(sandbox, *(run.uid for run in aside))
        assert uids == list(range(2 + 1 + most)), uids  # every uid held once, none shared
        step = [batcher.add(Ticket(sample(f"b{i}", ECHO, ONE_TEST), tenant=b)).future for i in range(STEP)]
        results: list[Scored] = await asyncio.wait_for(asyncio.gather(*step), 120)
        assert [r.output.score for r in results] == [1.0] * STEP
        assert batcher.preemptions == 2 and sandbox.stats["jobs stopped"] == 2  # the two serving slots, once each
        assert not any(run.ended or run.stop.is_set() for run in aside)  # the stragglers run on, unstopped
        assert sandbox.stats["jobs that stepped aside"] == most
        await eventually(lambda: sorted(starts.of("a").values()) == [1] * most + [2] * 2,
                         "the stopped samples restarted")  # fmt: skip
        await batcher.close(drain=False)
        await asyncio.gather(*flooding, return_exceptions=True)
    assert starts.of("b") == Counter(f"b{i}" for i in range(STEP))
    assert starts.over == [], starts.over


@needs_bwrap
async def test_a_sandbox_program_expected_to_end_soon_is_not_stopped_for_another_tenant() -> None:
    """Stopping a program costs its sandbox's reset. When that costs more than A's started programs can be
    expected still to run (their usual time less what they ran, or what they ran once past it), none is stopped:
    B's step waits for them to end."""
    source = {"type": "code", "workers": 2, "timeout_s": 60}
    async with pipeline_of(source, None) as pipeline:
        sandbox = pipeline.sources[0].source.sandbox
        batcher, a, b = pipeline.batcher, Tenant("a"), Tenant("b")
        flooding = [batcher.add(Ticket(sample(f"a{i}", sleeping(0.3), ONE_TEST), tenant=a)).future for i in range(12)]
        await eventually(lambda: sum(f.done() for f in flooding) >= 4 and len(sandbox._running) == 2,
                         "A's usual time is known, and its programs run in both slots")  # fmt: skip
        sandbox.stop_s = 600.0  # a stop that takes this long: no program of A's is worth stopping
        step = [batcher.add(Ticket(sample(f"b{i}", ECHO, ONE_TEST), tenant=b)).future for i in range(STEP)]
        results: list[Scored] = await asyncio.wait_for(asyncio.gather(*step), 120)
        assert [r.output.score for r in results] == [1.0] * STEP
        assert batcher.preemptions == 0 and sandbox.stats["jobs stopped"] == 0
        await asyncio.wait_for(asyncio.gather(*flooding), 120)


@needs_bwrap
async def test_what_a_started_program_has_left_is_read_from_its_own_tenants_programs() -> None:
    """A's programs take 1 s; B's many echoes make the pipeline's mean sample short. A stop costs 0.6 s here. A's
    programs 0.75 s into their usual second are left to end (a pipeline-wide mean would call them stragglers and
    stop them 0.25 s short of their end); A's programs just started are worth stopping, and are stopped for B."""
    source = {"type": "code", "workers": 2, "timeout_s": 60}
    async with pipeline_of(source, None) as pipeline:
        sandbox = pipeline.sources[0].source.sandbox
        batcher, a, b = pipeline.batcher, Tenant("a"), Tenant("b")

        def a_running(ran_s: Callable[[float], bool], every: bool = True) -> bool:
            now = time.monotonic()
            runs = [now - started for it, (_, started) in batcher.scheduler.apart.items() if it.tenant is a]
            return len(runs) == 2 and (all if every else any)(ran_s(r) for r in runs)

        async def b_step(tag: str) -> None:
            step = [batcher.add(Ticket(sample(f"{tag}{i}", ECHO, ONE_TEST), tenant=b)).future for i in range(STEP)]
            results: list[Scored] = await asyncio.wait_for(asyncio.gather(*step), 120)
            assert [r.output.score for r in results] == [1.0] * STEP

        first = [batcher.add(Ticket(sample(f"a{i}", sleeping(1.0), ONE_TEST), tenant=a)).future for i in range(2)]
        await asyncio.wait_for(asyncio.gather(*first), 120)
        for k in range(4):  # the pipeline's mean sample: B's echoes
            await b_step(f"warm{k}-")
        assert batcher.service_s < 0.5
        sandbox.stop_s = 0.6
        flooding = [
            batcher.add(Ticket(sample(f"a{i}", sleeping(1.0), ONE_TEST), tenant=a)).future for i in range(2, 12)
        ]
        await eventually(lambda: a_running(lambda r: r >= 0.75), "A's programs 0.75 s into their usual second")
        await b_step("late-")
        assert batcher.preemptions == 0
        # A's youngest program just started (on a loaded host the two may not start together): worth a stop, as is
        # the other if it started with it (B's credit covers both slots); one 0.4 s or more into its second is not
        await eventually(lambda: a_running(lambda r: r < 0.2, every=False), "A's next program just started")
        ran = [time.monotonic() - started for it, (_, started) in batcher.scheduler.apart.items() if it.tenant is a]
        await b_step("early-")
        # stopped in its sandbox, or taken back before its program began
        stopped = batcher.preemptions
        assert sum(r < 0.3 for r in ran) <= stopped <= sum(r < 0.45 for r in ran), (ran, stopped)
        await batcher.close(drain=False)
        await asyncio.gather(*flooding, return_exceptions=True)


@needs_bwrap
async def test_a_running_program_is_charged_to_its_tenant_while_it_runs() -> None:
    """A's program hangs in one slot while B's echoes pass through the other: A's share is charged for the time its
    program holds the slot as it runs (its virtual time grows with it, as B's does with B's echoes), not only once it
    ends."""
    source = {"type": "code", "workers": 2, "timeout_s": 300}
    async with pipeline_of(source, None) as pipeline:
        batcher, a, b = pipeline.batcher, Tenant("a"), Tenant("b")
        hanging = batcher.add(Ticket(sample("a0", sleeping(200), ONE_TEST), tenant=a)).future
        await eventually(lambda: len(batcher.scheduler.apart) == 1, "A's program runs")
        queue = batcher.scheduler.queue
        started_at = queue.lane(a).vtime  # its start's charge: 1
        for k in range(6):
            step = [batcher.add(Ticket(sample(f"b{k}-{i}", ECHO, ONE_TEST), tenant=b)).future for i in range(4)]
            await asyncio.wait_for(asyncio.gather(*step), 120)
        # B's 24 echoes ran in the other slot meanwhile, charged about 1 each: A's slot held as long is more than 5
        a_charged, b_charged = queue.lane(a).vtime - started_at, queue.lane(b).vtime
        assert a_charged > 5 and a_charged > b_charged / 4, (a_charged, b_charged)
        assert not hanging.done()
        await batcher.close(drain=False)
        await asyncio.gather(hanging, return_exceptions=True)


@needs_bwrap
@pytest.mark.slow
async def test_run_code_holds_slots_the_code_pipeline_counts() -> None:
    """/run_code takes slots of the code pipeline's own sandbox pool (one pool for both doors): while its calls hold
    them, the pipeline's samples wait in the fair queue, not in the pool, and start as those calls end; a call that
    comes while the pipeline holds every slot waits for the next one to free, and the pipeline starts no more
    until it has it. Checked where the slots are: no sample of the pipeline ever waited for a slot in the pool."""
    held = "import time\ntime.sleep(1.5)\nprint(input())\n"  # holds its slot 1.5 s or more
    pipelines = {"code": {"sources": [{"type": "code", "workers": 2, "timeout_s": 10}]}}
    async with reward_server(pipelines) as server, http_gateway(server) as gw, aiohttp.ClientSession() as http:
        pipeline = server.engine.pipelines["code"]
        sandbox = pipeline.sources[0].source.sandbox
        assert sandbox is not None
        starts = Starts(pipeline, workers=lambda: sandbox.workers - sandbox.held_outside)
        batcher, b = pipeline.batcher, Tenant("b")

        async def run_code() -> dict[str, Any]:
            async with http.post(f"{gw.url}/run_code", json={"code": held, "stdin": "1\n"}) as resp:
                return dict(await resp.json())

        # /run_code holds both slots: a step of the pipeline's waits in its fair queue.
        calls = [asyncio.ensure_future(run_code()) for _ in range(2)]
        await eventually(lambda: sandbox.held_outside == 2, "/run_code holds both slots")
        step = [batcher.add(Ticket(sample(f"b{i}", ECHO, ONE_TEST), tenant=b)).future for i in range(4)]
        queued_while_held = (sandbox.held_outside, batcher.queue_depth)
        assert [r["status"] for r in await asyncio.gather(*calls)] == ["Success", "Success"]
        assert all(r.output.score == 1.0 for r in await asyncio.gather(*step))
        # The pipeline holds both slots: a /run_code call waits in the pool for one, and gets the first to free.
        slow = [
            batcher.add(Ticket(sample(f"a{i}", f"```python\n{held}```", ONE_TEST), tenant=b)).future for i in range(2)
        ]
        await eventually(lambda: batcher.in_flight_samples == 2, "the pipeline holds both slots")
        late_call = asyncio.ensure_future(run_code())
        assert (await late_call)["status"] == "Success"
        assert all(r.output.score == 1.0 for r in await asyncio.gather(*slow))
    assert queued_while_held == (2, 4)
    assert starts.over == [], starts.over
    assert sandbox.stats["jobs that waited for a slot"] == 0, sandbox.stats
    assert sandbox.stats["outside jobs"] == 3 and sandbox.stats["outside jobs that waited for a slot"] == 1


# ------------------------------------------------------------------------------------- a judge over HTTP


@asynccontextmanager
async def judge_of(
    reply: Callable[[dict[str, Any]], Any], connections: int, batching: dict[str, Any] | None = None
) -> Any:
    """A judge pipeline against a local OpenAI-compatible server answering with `reply`."""
    async with FakeOpenAI(reply=reply) as server:
        source = {"type": "judge", "url": server.url, "model": "m", "prompt_template": "{response}",
                  "max_concurrency": connections}  # fmt: skip
        async with pipeline_of(source, batching) as pipeline:
            yield server, pipeline


@BATCHINGS
async def test_a_judge_pipeline_sends_a_small_step_next_to_its_server(batching: dict[str, Any] | None) -> None:
    gate = asyncio.Event()

    async def reply(body: dict[str, Any]) -> Reply:
        if body["messages"][-1]["content"].startswith("a"):
            await gate.wait()  # the judge holds A's requests until the test lets go
        return Reply("Score: 5", delay_s=0.05)  # a slow judge

    connections = 8
    arrived: list[int] = []
    async with judge_of(reply, connections, batching) as (server, pipeline):
        starts, mark, hopeless = await flood_then_step(
            pipeline,
            lambda t, i: sample(f"{t}{i}"),
            100,
            gate.set,
            settled=lambda held: len(server.requests) == held,
            on_arrival=lambda: arrived.append(len(server.requests)),
            workers=lambda: connections,
        )
    requested = [r.user_message for r in server.requests]
    assert_b_goes_first_then_shares([tenant for tenant, _ in starts.order[mark:]])
    # Where the work ran: the judge server's own log. After B arrived, before B's first request, at most the A's
    # requests sent beside it (one per other request in flight).
    assert not set(hopeless) & set(requested) and not set(hopeless) & starts.ids()
    assert a_before_each_b([sid[0] for sid in requested[arrived[0] :]])[0] <= connections - 1
    # B, under its share, took half of the slots from A's held requests at once: the server saw those requests
    # hung up on, beside the ones that replaced them, before it noticed.
    assert server.peak_in_flight <= connections + starts.pipeline.batcher.preemptions


def requests_per_sample(server: FakeOpenAI, tenant: str) -> Counter[str]:
    return Counter(r.user_message for r in server.requests if r.user_message.startswith(tenant))


def holding_a_from(first: int, gate: asyncio.Event) -> Callable[[dict[str, Any]], Awaitable[Reply]]:
    """A judge answering in 10 ms, but holding A's requests from its `first` on until the test sets `gate`."""

    async def reply(body: dict[str, Any]) -> Reply:
        message = body["messages"][-1]["content"]
        if message.startswith("a") and int(message[1:]) >= first:
            await gate.wait()
        return Reply("Score: 5", delay_s=0.01)

    return reply


@pytest.mark.parametrize(("scored_first", "stopped"), [(0, 4), (48, 8)], ids=["no-credit", "credit"])
async def test_a_tenant_under_its_share_takes_judge_slots_from_a_flooder_at_once(
    scored_first: int, stopped: int
) -> None:
    """A's requests hold every slot and would never end by themselves. B's step still runs at once, on slots taken
    from A's youngest requests: hung up on (the judge server drops them), queued again at the head of A's lane and
    sent again later. How many is B's credit: arriving while A has had no more than the slots it holds, B takes its
    weighted half (the rest of its step waits for A's requests); after A has had 48 more, B's samples all come
    before A's next in fair order, and B takes every slot its step fills. Every sample of both is answered exactly
    once."""
    gate = asyncio.Event()
    connections, flood = 8, 100
    reply = holding_a_from(scored_first, gate)

    # Shares counted in samples: each sample taken moves its tenant's virtual time by exactly one.
    async with judge_of(reply, connections, {"fair_share": "samples"}) as (server, pipeline):
        batcher = pipeline.batcher
        a, b = Tenant("a"), Tenant("b")
        flooding = [batcher.add(Ticket(sample(f"a{i}"), tenant=a)).future for i in range(flood)]
        await eventually(
            lambda: len(server.requests) == scored_first + connections and batcher.in_flight_samples == connections,
            "A's first samples scored, and its next hold every slot",
        )
        step = [batcher.add(Ticket(sample(f"b{i}"), tenant=b)).future for i in range(STEP)]
        # scored while every request of A's still hangs: as many of B's as slots were taken, the rest after A's
        await eventually(lambda: sum(f.done() for f in step) == stopped, "B's samples scored on the slots taken")
        assert batcher.preemptions == stopped
        await eventually(lambda: server.dropped == stopped, "the judge server dropped the stopped requests")
        gate.set()
        results: list[Scored] = await asyncio.wait_for(asyncio.gather(*step), 60)
        scored: list[Scored] = await asyncio.wait_for(asyncio.gather(*flooding), 60)
    assert {r.output.score for r in results + scored} == {results[0].output.score}
    sent = requests_per_sample(server, "a")
    assert len(sent) == flood and sorted(sent.values()) == [1] * (flood - stopped) + [2] * stopped, sent  # once each
    assert requests_per_sample(server, "b") == Counter({f"b{i}": 1 for i in range(STEP)})


async def test_a_tenant_takes_judge_slots_on_connections_of_its_own() -> None:
    """A stopped request loses its connection (HTTP/1.1 cannot abandon a response and keep the connection). The
    requests of B's step that took A's slots go out on B's own connections, warm from its step before, not on new
    ones (a new connection costs milliseconds on a busy loop): each tenant has its own pool."""
    gate = asyncio.Event()
    connections, scored_first = 8, 48
    reply = holding_a_from(scored_first, gate)

    async with judge_of(reply, connections, {"fair_share": "samples"}) as (server, pipeline):
        batcher = pipeline.batcher
        a, b = Tenant("a"), Tenant("b")
        await asyncio.gather(*(batcher.add(Ticket(sample(f"b{i}"), tenant=b)).future for i in range(STEP)))
        b_connections = {r.connection for r in server.requests}
        flooding = [batcher.add(Ticket(sample(f"a{i}"), tenant=a)).future for i in range(100)]
        await eventually(
            lambda: len(server.requests) == STEP + scored_first + connections, "A's next requests hold every slot"
        )
        step = [batcher.add(Ticket(sample(f"b{STEP + i}"), tenant=b)).future for i in range(STEP)]
        await eventually(lambda: batcher.preemptions and any(f.done() for f in step), "B scored on slots taken")
        gate.set()
        await asyncio.wait_for(asyncio.gather(*step, *flooding), 60)
    second = {f"b{STEP + i}" for i in range(STEP)}
    later = [r.connection for r in server.requests if r.user_message in second]
    assert len(later) == STEP and set(later) <= b_connections, (later, b_connections)


async def test_a_started_sample_near_its_step_deadline_is_not_stopped_for_another_tenant() -> None:
    """A's requests hold every slot, each with a step deadline less than two service times away: sent again, it
    could not make it, so none is stopped for B, which waits for them."""
    gate = asyncio.Event()
    connections = 8

    async def reply(body: dict[str, Any]) -> Reply:
        message = body["messages"][-1]["content"]
        if message.startswith("a") and int(message[1:]) >= connections:
            await gate.wait()
        return Reply("Score: 5", delay_s=0.2 if message.startswith("a") else 0.01)

    async with judge_of(reply, connections) as (server, pipeline):
        batcher = pipeline.batcher
        a, b = Tenant("a"), Tenant("b")
        await asyncio.gather(*(batcher.add(Ticket(sample(f"a{i}"), tenant=a)).future for i in range(connections)))
        due = time.monotonic() + 1.5 * batcher.service_s  # makeable now, not after a restart
        held = [
            batcher.add(Ticket(sample(f"a{connections + i}"), tenant=a, due=due)).future for i in range(connections)
        ]
        await eventually(lambda: len(server.requests) == 2 * connections, "A's requests hold every slot")
        step = [batcher.add(Ticket(sample(f"b{i}"), tenant=b)).future for i in range(STEP)]
        await holds_for(lambda: batcher.preemptions == 0 and not server.dropped, "none of A's requests is stopped")
        gate.set()
        await asyncio.wait_for(asyncio.gather(*held, *step), 60)


async def test_tenants_that_both_flood_a_judge_do_not_stop_each_others_requests() -> None:
    """Two backlogged tenants alternate on the slots: B takes its slots once, as it arrives, and from then on no
    request of either is stopped for the other's (a stopped request is work thrown away)."""
    connections, flood = 8, 60

    async def reply(body: dict[str, Any]) -> Reply:
        return Reply("Score: 5", delay_s=0.02)

    async with judge_of(reply, connections) as (server, pipeline):
        batcher = pipeline.batcher
        a, b = Tenant("a"), Tenant("b")
        flooding = [
            batcher.add(Ticket(sample(f"a{i}"), tenant=a)).future for i in range(3 * flood)
        ]  # still queued when B comes
        await eventually(  # however many of A's requests were answered by then
            lambda: batcher.in_flight_samples == connections and batcher.queue_depth, "A holds every slot"
        )
        flooding += [batcher.add(Ticket(sample(f"b{i}"), tenant=b)).future for i in range(flood)]
        scored: list[Scored] = await asyncio.wait_for(asyncio.gather(*flooding), 120)
    assert len(scored) == 4 * flood
    # As B arrived, its half, or every slot if A had had enough more (B's credit), and then no more than a half once
    # again: a sample far costlier than the mean on a loaded machine may shift a tenant's virtual time by a few
    # samples, rarely by the share of the slots that stopping needs.
    assert connections // 2 <= batcher.preemptions <= connections + connections // 2, batcher.preemptions
    assert max((requests_per_sample(server, "a") + requests_per_sample(server, "b")).values()) <= 2


# ------------------------------------------------------------------------------------------ a reward model


def cpu_model(tiny_models: TinyModelPaths) -> dict[str, Any]:
    """The tiny reward model's source, on the CPU (one batch in flight, which a batch sent first overtakes)."""
    return {"type": "model", "path": str(tiny_models.reward_model), "device": "cpu"}


@contextmanager
def model_held(pipeline: RewardPipeline) -> Iterator[Callable[[], None]]:
    """Holds the model: its forward passes take turns on it, and the test has it."""
    turn = pipeline.sources[0].source._turns.hold()  # type: ignore[attr-defined]
    turn.__enter__()
    held = [True]

    def release() -> None:
        if held[0]:
            held[0] = False
            turn.__exit__(None, None, None)

    try:
        yield release
    finally:
        release()


@BATCHINGS
async def test_a_reward_model_pipeline_puts_a_small_step_in_its_next_batch(
    batching: dict[str, Any] | None, tiny_models: TinyModelPaths
) -> None:
    source = cpu_model(tiny_models)
    async with pipeline_of(source, batching) as pipeline:
        assert pipeline.limits().batches == 1  # on the CPU: nothing to overlap, no batch staged behind the one held
        with model_held(pipeline) as release:
            starts, mark, hopeless = await flood_then_step(pipeline, lambda t, i: sample(f"{t}{i}"), 400, release)
    # On the CPU one batch in flight (on an accelerator two: one computing, one staged): B's whole step is the first
    # batch handed over after it arrived (run ahead of A's in flight), a batch of its own (it ends with B's queued
    # samples, none of A's filling it: B's step computes as it would alone); before it, only what was handed over
    # before B arrived.
    first = next(k for k, batch in enumerate(starts.batches) if any(tenant == "b" for tenant, _ in batch))
    assert sum(len(batch) for batch in starts.batches[:first]) == mark
    assert sorted(starts.batches[first]) == [("b", f"b{i}") for i in range(STEP)], starts.batches[first]
    assert not set(hopeless) & starts.ids()


def varied(tenant: str, i: int) -> RewardInput:
    """Samples of a few lengths: a pass that resumed with a wrong state would score them differently than alone."""
    return sample(f"{tenant}{i}", tokens=3 + i % 5)


def scored_alone(model: Any, flood: int) -> list[float]:
    """Each of A's `flood` varied samples and of B's step, scored by `model` on its own, in that order."""
    samples = [varied("a", i) for i in range(flood)] + [varied("b", i) for i in range(STEP)]
    return [model.score_tokens([np.concatenate([s.prompt_ids, s.response_ids])])[0] for s in samples]


@contextmanager
def first_pass_held(
    model: Any, on_start: Callable[[], None] = lambda: None
) -> Iterator[tuple[threading.Event, threading.Event]]:
    """The model's first forward pass waits before its first layer (`inside` says it is there) until `go` is set,
    as it is on leaving; `on_start` is called as every pass starts."""
    inside, go = threading.Event(), threading.Event()

    def hold(module: Any, args: Any) -> None:
        on_start()
        if not inside.is_set():
            inside.set()
            go.wait(60)

    layers = layer_stack(model._backbone)
    assert layers is not None
    hook = layers[0].register_forward_pre_hook(hold)
    try:
        yield inside, go
    finally:
        go.set()
        hook.remove()


async def test_a_tenant_back_from_idle_overtakes_the_reward_model_pass_in_flight(tiny_models: TinyModelPaths) -> None:
    """B's step arrives while A's batch is in its forward pass: B's batch is handed over at once, beyond the one batch
    in flight, and runs while A's pass waits before its next layer; A's pass then goes on where it stopped. B's
    results come before that batch's, no sample of A's starts in between, and every sample scores as it does alone
    (the paused pass resumed with its own state). B's batch is charged its own time, not its wait for A's pass to
    reach that layer (A's pass is held there meanwhile): that time was A's."""
    source = cpu_model(tiny_models)
    async with pipeline_of(source, None) as pipeline:
        model, batcher = pipeline.sources[0].source, pipeline.batcher
        assert pipeline.limits() == pipeline.limits()._replace(batches=1, overtakes=True)
        assert "gives way at its next layer), overtaken by a batch sent first" in pipeline.describe_capacity()
        layers = layer_stack(model._backbone)
        assert layers is not None and len(layers) >= 2  # a layer after the first, where A's pass gives way
        starts = Starts(pipeline)
        done: list[str] = []
        a, b = Tenant("a"), Tenant("b")
        batches: list[BatchInfo] = []
        described = batcher.runner.on_batch

        def describe(info: BatchInfo) -> None:  # the batches as the batcher charges them
            batches.append(info)
            if described is not None:
                described(info)

        batcher.runner.on_batch = describe

        def enqueue(tenant: Tenant, i: int) -> asyncio.Future[Scored]:
            fut = batcher.add(Ticket(varied(tenant.name, i), tenant=tenant)).future
            fut.add_done_callback(lambda _: done.append(f"{tenant.name}{i}"))
            return fut

        with first_pass_held(model) as (inside, go):  # A's first pass waits before its first layer
            flood = [enqueue(a, i) for i in range(100)]
            await eventually(inside.is_set, "A's first batch in its forward pass")
            step = [enqueue(b, i) for i in range(STEP)]
            await eventually(lambda: batcher.overtakes == 1, "B's step handed over ahead of A's batch in flight")
            await eventually(lambda: model._turns.waiting == 1, "B's batch waiting for A's pass to give way")
            held_from = time.monotonic()
            await holds_for(lambda: model._turns.waiting == 1, "B's batch waits while A's pass is held")
            held_s = time.monotonic() - held_from
            go.set()
            scored = await asyncio.wait_for(asyncio.gather(*flood, *step), 120)
        alone = scored_alone(model, 100)
    first_a = {sid for _, sid in starts.batches[0]}
    assert {t for t, _ in starts.batches[0]} == {"a"}
    assert sorted(starts.batches[1]) == [("b", f"b{i}") for i in range(STEP)], starts.batches[1]
    assert batcher.overtakes == 1  # later batches took their turns: B had nothing left to send
    assert sorted(done[:STEP]) == sorted(f"b{i}" for i in range(STEP)), done  # before A's batch it overtook
    assert first_a <= set(done[STEP:]), done
    assert max(starts.of("a").values()) == max(starts.of("b").values()) == 1  # none started twice
    assert starts.over == [], starts.over
    assert [r.output.score for r in scored] == pytest.approx(alone, abs=1e-4)
    b_batch = next(info for info in batches if info.sample_ids[0].startswith("b"))
    took_s = (b_batch.end_time_ns - b_batch.start_time_ns) / 1e9
    assert b_batch.compute_s <= took_s - held_s + 1e-3, (b_batch.compute_s, took_s, held_s)


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
)
async def test_a_tenant_back_from_idle_goes_before_the_reward_model_batch_staged(
    device: str, tiny_models: TinyModelPaths
) -> None:
    """Two batches in flight, as on an accelerator: one of A's in its forward pass, the other staged and waiting for
    the model. B's step, arriving meanwhile, is handed over at once, beyond them, and its pass comes before the staged
    batch's: B waits for (a layer of) the pass computing, not for two of A's batches. On the CPU the pass computing
    gives way at its next layer, on an accelerator between its passes; the paused batch then goes on before the staged
    one (batches take the model in turns, not pass by pass)."""
    source = {**cpu_model(tiny_models), "device": device, "batches_in_flight": 2}
    async with pipeline_of(source, None) as pipeline:
        model, batcher = pipeline.sources[0].source, pipeline.batcher
        assert pipeline.limits() == pipeline.limits()._replace(batches=2, overtakes=True)
        assert "overtaken by a batch sent first" in pipeline.describe_capacity()
        passes: list[str] = []  # each forward pass as it starts and ends: the first sample of its batch
        batch_of = threading.local()
        score_batch = model._score_batch_sync

        def tagged(batch: list[RewardInput]) -> Any:  # each batch computes in a thread: the thread knows it
            batch_of.first = batch[0].sample_id
            return score_batch(batch)

        def log_pass(*_: Any) -> None:
            passes.append(batch_of.first)

        layers = layer_stack(model._backbone)
        assert layers is not None
        ended = layers[-1].register_forward_hook(log_pass)
        model._score_batch_sync = tagged
        starts = Starts(pipeline)
        a, b = Tenant("a"), Tenant("b")
        try:
            with first_pass_held(model, log_pass) as (inside, go):  # A's first pass waits before its first layer
                flood = [batcher.add(Ticket(varied("a", i), tenant=a)).future for i in range(100)]
                await eventually(inside.is_set, "one of A's batches in its forward pass")
                await eventually(lambda: model._turns.waiting == 1, "A's other batch staged, waiting for the model")
                step = [batcher.add(Ticket(varied("b", i), tenant=b)).future for i in range(STEP)]
                await eventually(lambda: batcher.overtakes == 1, "B's step handed over ahead of A's batches in flight")
                await eventually(lambda: model._turns.waiting == 2, "B's batch staged, waiting for the model too")
                go.set()
                scored = await asyncio.wait_for(asyncio.gather(*flood, *step), 120)
        finally:
            ended.remove()
        alone = scored_alone(model, 100)
    assert {t for t, _ in starts.batches[0] + starts.batches[1]} == {"a"}
    assert sorted(starts.batches[2]) == [("b", f"b{i}") for i in range(STEP)], starts.batches[2]
    # The passes' starts and ends of A's batch computing when B arrived ("x"), of B's, of A's batch staged ("y"): B's
    # all come before the staged batch's, and the paused pass ends before the staged one starts.
    a_batches, b_batch = [batch[0][1] for batch in starts.batches[:2]], starts.batches[2][0][1]
    computing = passes[0]
    staged = next(sid for sid in a_batches if sid != computing)
    label = [{computing: "x", staged: "y", b_batch: "b"}.get(sid, "?") for sid in passes]
    last = {k: max(i for i, seen in enumerate(label) if seen == k) for k in "xb"}
    assert last["b"] < label.index("y") and last["x"] < label.index("y"), label
    assert all(label.count(k) % 2 == 0 for k in "xyb"), label  # every pass that started ended
    assert max(starts.of("a").values()) == max(starts.of("b").values()) == 1
    assert starts.over == [], starts.over
    assert [r.output.score for r in scored] == pytest.approx(alone, abs=1e-4)


async def test_tenants_that_both_flood_a_reward_model_never_overtake_each_other(tiny_models: TinyModelPaths) -> None:
    """Both tenants are backlogged when A's batch is handed over (lengths apart, so batches hold one tenant each): B,
    next in fair order, waits for it as it would for any batch in flight, since its queued samples were there before
    that batch started; more of both tenants' samples arriving changes nothing. Overtaking is for a tenant that
    arrives after the batch in flight started."""
    source = cpu_model(tiny_models)
    async with pipeline_of(source, None) as pipeline:
        batcher = pipeline.batcher
        starts = Starts(pipeline)
        a, b = Tenant("a"), Tenant("b")

        def both(i: int) -> list[asyncio.Future[Scored]]:
            return [batcher.add(Ticket(sample(f"a{i}", tokens=4), tenant=a)).future,
                    batcher.add(Ticket(sample(f"b{i}", tokens=12), tenant=b)).future]  # fmt: skip

        with model_held(pipeline) as release:
            futures = [fut for i in range(100) for fut in both(i)]
            await eventually(lambda: batcher.in_flight_batches == 1, "a batch handed over, waiting for the model")
            futures += [fut for i in range(100, 110) for fut in both(i)]  # arrivals: the scheduler looks again
            await holds_for(lambda: batcher.in_flight_batches == 1, "no batch runs ahead of the one in flight")
            release()
            await asyncio.wait_for(asyncio.gather(*futures), 120)
    assert batcher.overtakes == 0
    assert {t for t, _ in starts.batches[0]} == {"a"} and {t for t, _ in starts.batches[1]} == {"b"}
    assert starts.over == [], starts.over


async def test_a_reward_model_batch_near_its_step_deadline_is_not_overtaken(tiny_models: TinyModelPaths) -> None:
    """A's batch in flight holds samples whose step deadline is less than two service times away: B's step, arriving
    meanwhile, waits for it instead of pausing it, and is the next batch."""
    source = cpu_model(tiny_models)
    async with pipeline_of(source, None) as pipeline:
        batcher = pipeline.batcher
        starts = Starts(pipeline)
        a, b = Tenant("a"), Tenant("b")
        with model_held(pipeline) as release:
            due = time.monotonic() + 15
            flood = [batcher.add(Ticket(sample(f"a{i}"), tenant=a, due=due)).future for i in range(100)]
            await eventually(lambda: batcher.in_flight_batches == 1, "A's batch handed over, waiting for the model")
            batcher.scheduler.service_s = 10.0  # scoring takes 10 s: A's step deadline is nearer than two of that
            step = [batcher.add(Ticket(sample(f"b{i}"), tenant=b)).future for i in range(STEP)]
            await holds_for(lambda: batcher.in_flight_batches == 1, "B's step waits for A's batch near its deadline")
            release()
            await asyncio.wait_for(asyncio.gather(*step, *flood, return_exceptions=True), 120)
    assert batcher.overtakes == 0
    assert sorted(starts.batches[1]) == [("b", f"b{i}") for i in range(STEP)], starts.batches[1]


# ------------------------------------------------------------------------------- a rule inline on the event loop


@BATCHINGS
async def test_an_inline_rule_runs_one_short_batch_at_a_time_and_a_small_step_next(
    batching: dict[str, Any] | None,
) -> None:
    """The event loop is an inline rule's capacity: A's flood runs one batch at a time, each within the bound the
    measured cost per sample gives, so B's step, arriving while one of A's batches is started, waits for that one
    batch only; and B's batches hold B's samples only (an inline batch ends with its first tenant's queued samples),
    so they are handed back as soon as they are done."""
    async with pipeline_of({"type": "rule", "rule": "gsm8k"}, batching) as pipeline:
        batcher = pipeline.batcher
        assert pipeline.limits().inline
        starts = Starts(pipeline)
        bounds: list[int] = []  # the bound each batch was taken under
        arrival: list[tuple[int, int]] = []  # (batches started, batches in flight) when B's step arrived
        a, b = Tenant("a"), Tenant("b")
        step: list[asyncio.Future[Scored]] = []
        due: list[bool] = []  # B's arrival is scheduled

        def b_arrives() -> None:
            arrival.append((len(starts.batches), batcher.in_flight_batches))
            step.extend(batcher.add(Ticket(sample(f"b{i}", "#### 4", "4"), tenant=b)).future for i in range(STEP))

        def on_start(batch: list[Ticket]) -> None:
            bounds.append(batcher.inline_bound())
            starts(batch)
            # A's flood is running, its batch just handed over and not yet run, and A has had several times a
            # tenant's credit (a loaded machine's batches may hold a sample or two each): B, new, comes with its
            # whole credit, more than its step.
            if not due and len(starts.batches) >= 6 and sum(map(len, starts.batches)) >= 4 * BURST:
                due.append(True)
                asyncio.get_running_loop().call_soon(b_arrives)

        batcher.on_start = on_start
        flooding = [batcher.add(Ticket(sample(f"a{i}", "#### 4", "4"), tenant=a)).future for i in range(3000)]
        await eventually(lambda: len(step) == STEP, "B's step arrives during A's flood")
        results: list[Scored] = await asyncio.wait_for(asyncio.gather(*step), 60)
        assert all(r.output.score == 1.0 for r in results)
        await asyncio.gather(*flooding)
    assert starts.over == [], starts.over
    ((started, in_flight),) = arrival
    assert in_flight == 1  # the batch B arrived beside: the only one started
    first_b = next(k for k, batch in enumerate(starts.batches) if any(t == "b" for t, _ in batch))
    assert first_b == started  # none of A's batches started after B arrived and before B's first
    # B's step is the next batches, of B's samples only: one batch where the bound holds the step, more where a
    # loaded machine's measured cost per sample makes the bound smaller; no sample of A's among or between them.
    step_ids, seen = {f"b{i}" for i in range(STEP)}, set[str]()
    for batch in starts.batches[first_b:]:
        if seen == step_ids:
            break
        assert {t for t, _ in batch} == {"b"}, batch
        seen |= {sid for _, sid in batch}
    assert seen == step_ids
    max_batch = (batching or {}).get("max_batch_size", 256)
    sizes = [len(batch) for batch in starts.batches]
    assert all(size <= bound <= max_batch for size, bound in zip(sizes, bounds, strict=True)), (sizes, bounds)


async def test_an_inline_batch_is_bounded_by_its_measured_loop_time() -> None:
    """An inline rule that burns 0.25 ms of the loop's CPU per sample: at most 1 ms / 0.25 ms = 4 samples a batch
    (the measured cost per sample is never below what the rule burns, however loaded the machine)."""

    @register_rule("test_capacity_burn", isolate=False)
    def burn(data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None) -> float:
        until = time.thread_time() + 0.00025
        while time.thread_time() < until:
            pass
        return 1.0

    try:
        async with pipeline_of({"type": "rule", "rule": "test_capacity_burn"}, None) as pipeline:
            assert pipeline.limits().inline
            starts = Starts(pipeline)
            results = await asyncio.gather(*(pipeline.batcher.add(Ticket(sample(f"a{i}"))).future for i in range(200)))
    finally:
        RULES.pop("test_capacity_burn", None)
    assert all(r.output.score == 1.0 for r in results)
    assert starts.over == [] and len(starts.order) == 200
    assert max(len(batch) for batch in starts.batches) <= 4, [len(batch) for batch in starts.batches]


async def test_an_inline_batch_counts_the_loop_time_its_results_cost_while_backlogged() -> None:
    """A cheap inline rule, but each result costs the loop 0.1 ms where it is handed on (as writing a flooder's
    results and reading its next samples does): while the pipeline stays backlogged that time is the batch's too,
    and bounds it to about 1 ms / 0.1 ms = 10 samples, where the rule's own cost would allow its whole 256."""

    def spend(_: object) -> None:
        until = time.thread_time() + 0.0001
        while time.thread_time() < until:
            pass

    async with pipeline_of({"type": "rule", "rule": "gsm8k"}, None) as pipeline:
        starts = Starts(pipeline)
        futures = [pipeline.batcher.add(Ticket(sample(f"a{i}", "#### 4", "4"))).future for i in range(400)]
        for fut in futures:
            fut.add_done_callback(spend)
        results = await asyncio.gather(*futures)
    assert all(r.output.score == 1.0 for r in results)
    assert starts.over == [] and len(starts.order) == 400
    sizes = [len(batch) for batch in starts.batches]
    assert max(sizes[10:]) <= 10, sizes  # once the moving average has learned what a result costs

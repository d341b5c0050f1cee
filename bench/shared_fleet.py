"""One reward fleet shared by training jobs: does a job's latency hold while another floods the fleet?

    python -m bench.shared_fleet [--kinds function,code,hostile,judge,model,rule,rule_workers --steps 40] [--sizing]

Isolation (the default): a real `rewardmesh serve reward` process with two tenants of weight 1 (job-a, job-b, each
its own token) and, per source kind, two pipelines of real sources: the kind's default batching, and a user's
(`max_batch_size: 16, max_queue_delay_ms: 2, max_queue_size: 4096`). Tenant B runs a closed loop of small steps
(8 samples at once, wait for all); tenant A keeps many samples in flight. Measured side by side in one run, per
kind and batching: B's per-sample latency p50 and p99 alone, then while A floods, and the p99 ratio (target:
<= 1.2x), with what A got scored meanwhile. The kinds:

  function  a function burning 4 ms of CPU per sample on 2 worker processes; A keeps 3,000 in flight
  code      programs in the bubblewrap sandbox, 2 sandbox workers: A's burn 30 ms, B's echo; A keeps 200 in flight
  hostile   the same sandbox, A's programs hang until their 1 s budget ends them (B's echo); A keeps 200 in flight
  judge     a judge (max_concurrency 16: B's step fits its weighted half) against a local OpenAI-compatible server
            answering in 50 ms; A keeps 1,000
  model     the tiny reward model on the CPU; A keeps 3,000 in flight
  rule      the gsm8k rule, inline; A keeps 3,000 in flight
  rule_workers  the same rule in 2 worker processes (`isolation: process`); A keeps 3,000 in flight

Sizing (--sizing, a few minutes more): reward servers needed when training jobs share one fleet instead of each
having its own, and what step deadlines buy under saturation, on reward servers whose pipeline takes a fixed time
per batch (demo.paced_reward: a reward model's service time on an accelerator, without spending this machine's
CPU). Each simulated job runs steps: for --generate-s seconds its samples finish (at seeded random times) and each
is sent to the fleet at once; the step ends when its last sample is scored; then the job trains for --train-s
seconds. For J jobs: each job with a reward server of its own, against all J sharing m servers, m = 1, 2, ... until
every job's median step time is within --tolerance of its dedicated one. Then J jobs of one tenant on one
saturated server, half of them with tight step deadlines: the fraction of steps scored in time in arrival order
(FIFO: no deadlines sent) and earliest deadline first.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import yaml

from bench.common import machine_info, markdown_table, progress
from bench.mesh import quiet_logs
from rewardmesh.client.reward_client import RewardClient
from rewardmesh.common.gc_tuning import freeze_startup_heap
from rewardmesh.common.tensors import ids_tensor
from rewardmesh.demo.paced_reward import PIPELINE, paced_engine
from rewardmesh.demo.server_process import ServerProcess
from rewardmesh.reward_engine.fair_queue import Tenant
from rewardmesh.server.reward.server import RewardServer
from rewardmesh.server.reward.tenants import TenantTable
from rewardmesh.server.serving import ServerOptions
from rewardmesh.v1 import common_pb2, reward_pb2

# ---------------------------------------------------------------------------------------------------- isolation

KINDS = ("function", "code", "hostile", "judge", "model", "rule", "rule_workers")
USER_BATCHING = {"max_batch_size": 16, "max_queue_delay_ms": 2, "max_queue_size": 4096}
STEP = 8  # B's step: small, sent at once
TOKENS = {"job-a": "fleet-bench-token-a", "job-b": "fleet-bench-token-b"}
TARGET_RATIO = 1.2
B_SHARE = 0.5  # B's weighted share of a pipeline A floods (two tenants of weight 1)
FAST_STEPS = 400  # percent of --steps for kinds whose steps take milliseconds: p99 from more samples, in seconds
FLOOD_NICE = 10  # A's client process: a trainer on a host of its own (see _flood_main)
WARM_STEPS = 10  # B's steps before any is timed, alone and then under A's flood (first shapes, first connections)

_BURN = '''"""A reward function that burns extra_info['burn_ms'] of CPU (4 ms unless told), as a checker does."""
import time


def burn(data_source, solution_str, ground_truth, extra_info=None):
    until = time.perf_counter() + float((extra_info or {}).get("burn_ms", 4)) / 1000
    while time.perf_counter() < until:
        pass
    return 1.0
'''
_TESTS = json.dumps({"inputs": ["1\n"], "outputs": ["1\n"]})
_A_PROGRAM = (
    "```python\nimport time\nt = time.perf_counter()\nwhile time.perf_counter() - t < 0.03:\n    pass\n"
    "print(input())\n```"
)
_B_PROGRAM = "```python\nprint(input())\n```"
_HANGING_PROGRAM = "```python\nimport time\ntime.sleep(60)\n```"  # held until its 1 s budget kills it


@dataclass(frozen=True)
class Kind:
    """One source kind as the benchmark runs it: its pipeline's sources, A's flood and both tenants' samples."""

    name: str
    sources: list[dict[str, Any]]
    flood: int  # A's samples in flight
    a: Callable[[str], common_pb2.Sample]
    b: Callable[[str], common_pb2.Sample]
    step_share: int = 100  # percent of --steps B runs (kinds whose steps take milliseconds run more)
    gives_way: bool = False  # the source stops A's started work for B, or pauses it: no floor from A's unit
    slots: int | None = None  # samples the source runs at once, each answered apart (None: a batched source)
    batches: int | None = None  # batches a batched source runs at once (B's demand on it is counted per batch)


def _sample(sid: str, response: str = "#### 4", truth: str = "4", **extra: Any) -> common_pb2.Sample:
    s = common_pb2.Sample(sample_id=sid, group_id=sid, prompt_ids=ids_tensor([1, 2, 3]),
                          response_ids=ids_tensor([4, 5]), prompt_text="What is 2 + 2?", response_text=response,
                          ground_truth=truth)  # fmt: skip
    if extra:
        s.extra_info.update(extra)
    return s


def _a_program(sid: str) -> common_pb2.Sample:
    return _sample(sid, _A_PROGRAM, _TESTS)


def _b_program(sid: str) -> common_pb2.Sample:
    return _sample(sid, _B_PROGRAM, _TESTS)


def _hanging_program(sid: str) -> common_pb2.Sample:
    return _sample(sid, _HANGING_PROGRAM, _TESTS)


def _kinds(workdir: Path, judge_url: str, reward_model: Path | None, model_batches: int = 0) -> dict[str, Kind]:
    burn = workdir / "fleet_burn.py"
    burn.write_text(_BURN)
    kinds = {
        "function": Kind("function", [{"type": "function", "function": f"{burn}:burn", "max_workers": 2}], 3000,
                         _sample, _sample, slots=2),
        # A's programs (45 ms) are stopped for B's step: a stop costs its sandbox's reset, not a start.
        "code": Kind("code", [{"type": "code", "workers": 2, "timeout_s": 10}], 200, _a_program, _b_program,
                     gives_way=True, slots=2),
        "hostile": Kind("hostile", [{"type": "code", "workers": 2, "timeout_s": 1}], 200, _hanging_program,
                        _b_program, gives_way=True, slots=2),
        "judge": Kind("judge", [{"type": "judge", "url": judge_url, "model": "judge", "max_concurrency": 16,
                                 "prompt_template": "{response}"}], 1000, _sample, _sample, gives_way=True,
                      slots=16),
        "rule": Kind("rule", [{"type": "rule", "rule": "gsm8k"}], 3000, _sample, _sample, FAST_STEPS),
        # The same rule where its capacity is its workers, not the event loop every tenant's messages need.
        "rule_workers": Kind("rule_workers", [{"type": "rule", "rule": "gsm8k", "isolation": "process", "workers": 2}],
                             3000, _sample, _sample, FAST_STEPS, slots=2),
    }  # fmt: skip
    if reward_model is not None:
        # B's batch overtakes A's batches in flight: the pass computing waits before its next layer (on the CPU).
        # B's demand is counted on one batch however many are in flight: the model runs one pass at a time.
        model = {"type": "model", "path": str(reward_model), "device": "cpu", "batches_in_flight": model_batches}
        kinds["model"] = Kind("model", [model], 3000, _sample, _sample, FAST_STEPS, gives_way=True, batches=1)
    return kinds


@dataclass
class Flood:
    """Tenant A keeping `in_flight` samples on the server: each answer is replaced by a new sample at once."""

    client: RewardClient
    pipeline: str
    make: Callable[[str], common_pb2.Sample]
    in_flight: int
    scored: int = 0
    refused: int = 0
    computes: list[float] = field(default_factory=list)  # each scored result's reward compute time, seconds
    batch_sizes: list[int] = field(default_factory=list)  # and the size of the batch that scored it
    _live: set[asyncio.Future[reward_pb2.RewardResult]] = field(default_factory=set)
    _n: int = 0
    _stopping: bool = False

    def start(self) -> None:
        for _ in range(self.in_flight):
            self._send()

    def _send(self) -> None:
        self._n += 1
        fut = self.client.submit(self.make(f"a-{self._n}"), self.pipeline)
        self._live.add(fut)
        fut.add_done_callback(self._done)

    def _done(self, fut: asyncio.Future[reward_pb2.RewardResult]) -> None:
        self._live.discard(fut)
        if fut.cancelled():
            return
        result = fut.result()
        if result.HasField("error"):
            self.refused += 1
        else:
            self.scored += 1
            self.computes.append(result.timing.compute)
            self.batch_sizes.append(result.batch_size)
        if not self._stopping:
            self._send()

    def stop(self) -> None:
        self._stopping = True
        for fut in list(self._live):
            fut.cancel()  # the server drops them from its queue


@dataclass
class Steps:
    """What B's closed loop measured, in seconds: each sample's latency (sent to answered) and, as the server reports
    them, its wait in the server before its work started and its work's own time; and the loop's whole time."""

    latencies: list[float] = field(default_factory=list)
    queued: list[float] = field(default_factory=list)
    computes: list[float] = field(default_factory=list)
    step_computes: list[float] = field(default_factory=list)  # each step's longest: a batched source's one batch
    wall_s: float = 0.0

    def demand(self, slots: int, *, batched: bool = False) -> float:
        """The share of the source's `slots` B's own work held while it ran alone (pauses included): its samples'
        compute times, or a batched source's batches' (B's step is one batch)."""
        return sum(self.step_computes if batched else self.computes) / (self.wall_s * slots)


async def _steps(client: RewardClient, pipeline: str, make: Callable[[str], common_pb2.Sample], steps: int,
                 tag: str, pause_s: float = 0.0) -> Steps:  # fmt: skip
    """B's closed loop: `steps` steps of STEP samples sent at once, each step waiting for all, then `pause_s` (a
    trainer's training between steps)."""
    out = Steps()
    began = time.monotonic()
    for step in range(steps):
        sent = time.monotonic()
        futures = [client.submit(make(f"b-{tag}-{step}-{i}"), pipeline) for i in range(STEP)]
        done: list[float] = []
        for fut in futures:
            fut.add_done_callback(lambda _f, done=done: done.append(time.monotonic()))  # type: ignore[misc]
        results = await asyncio.gather(*futures)
        errors = [r.error.message for r in results if r.HasField("error")]
        if errors:
            raise RuntimeError(f"{pipeline}: B's sample failed: {errors[0]}")
        out.latencies += [t - sent for t in done]
        out.queued += [r.timing.queue for r in results]
        out.computes += [r.timing.compute for r in results]
        out.step_computes.append(max(r.timing.compute for r in results))
        if pause_s:
            await asyncio.sleep(pause_s)
    out.wall_s = time.monotonic() - began
    return out


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _flood_main(address: str, pipeline: str, make: Callable[[str], common_pb2.Sample], in_flight: int,
                conn: Connection) -> None:  # fmt: skip
    """Tenant A, in a process of its own (a job of its own): floods on "start", counts from "mark", reports what
    it got scored on "stop" (samples, seconds, and its results' median compute time and batch size), ends on
    "exit". It runs at a lower CPU priority, as if on a host of its own (a trainer's): it still saturates the
    server (the table's A scored/s), but on a 2-core machine it does not take B's client's turns on the cores, which
    would measure the host's scheduler, not the fleet."""
    os.nice(FLOOD_NICE)
    quiet_logs()

    async def run() -> None:
        loop = asyncio.get_running_loop()
        async with RewardClient([address], token=TOKENS["job-a"], result_timeout_s=600) as client:
            flood: Flood | None = None
            marked, since = 0, 0.0
            while (command := await loop.run_in_executor(None, conn.recv)) != "exit":
                if command == "start":
                    flood = Flood(client, pipeline, make, in_flight)
                    flood.start()
                elif command == "mark" and flood is not None:
                    marked, since = flood.scored, time.monotonic()
                    flood.computes.clear()
                    flood.batch_sizes.clear()
                elif command == "stop" and flood is not None:
                    computes, sizes = flood.computes or [0.0], flood.batch_sizes or [1]
                    conn.send((flood.scored - marked, time.monotonic() - since, statistics.median(computes),
                               statistics.median(sizes)))  # fmt: skip
                    flood.stop()
                    flood = None

    asyncio.run(run())


def _judge_main(conn: Connection) -> None:
    """A local OpenAI-compatible judge answering in 50 ms, in a process of its own; its port goes to `conn`."""
    from tests.support.fake_openai import FakeOpenAI, Reply

    async def run() -> None:
        # No per-request records, and the start-up heap out of the collector's scans, as a server's: a full
        # collection of a growing heap stalls the judge (100 ms after a few minutes), and B's step with it.
        async with FakeOpenAI(reply=Reply("Score: 5", delay_s=0.05), record=False) as judge:
            freeze_startup_heap()
            conn.send(judge.port)
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)

    asyncio.run(run())


async def _isolation_row(
    address: str, kind: Kind, batching: str, steps: int, rounds: int, settle_s: float, pause_s: float
) -> list[object]:
    """B alone, then B while A floods (from a process of its own), `rounds` times in turn (so both see the same
    machine, however loaded it is), `steps` steps each time: one row of the table."""
    pipeline = f"{kind.name}-{batching}"
    alone: list[float] = []
    shared: list[float] = []
    queued_alone: list[float] = []  # B's wait in the server before its work started
    queued_shared: list[float] = []
    round_ratios: list[float] = []  # each round's own p99 ratio: how far one round's verdict is from another's
    a_scored, a_time = 0, 0.0
    computes: list[float] = []  # per round: the median compute time of A's results
    sizes: list[float] = []  # and their median batch size
    demands: list[float] = []  # per round: the share of a per-sample source's slots B's work held alone
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    flooder = ctx.Process(target=_flood_main, args=(address, pipeline, kind.a, kind.flood, child), daemon=True)
    flooder.start()
    loop = asyncio.get_running_loop()

    async def flooded(cb: RewardClient, count: int, tag: str) -> tuple[Steps, tuple[int, float, float, float]]:
        """B's steps while A floods, and what A got scored meanwhile (samples, seconds, median compute time and
        batch size)."""
        conn.send("start")
        await asyncio.sleep(settle_s)  # A's flood fills the queue and every worker
        conn.send("mark")
        measured = await _steps(cb, pipeline, kind.b, count, tag, pause_s)
        conn.send("stop")
        a_got = await loop.run_in_executor(None, conn.recv)
        await asyncio.sleep(settle_s)  # A's cancelled samples leave the server before B runs alone again
        return measured, a_got

    try:
        async with RewardClient([address], token=TOKENS["job-b"], result_timeout_s=600) as cb:
            # Unmeasured: B alone, then B under A's flood, so that what happens once (a model's first batch of a shape,
            # the first connections, a sandbox pool filling) lands in no round, alone or flooded.
            await _steps(cb, pipeline, kind.b, WARM_STEPS, "warm")
            await flooded(cb, WARM_STEPS, "warm-flooded")
            freeze_startup_heap()  # B's client measures the server: its own collector's full scans must not stall it
            for r in range(rounds):
                progress(f"{pipeline}: B alone, {steps} steps (round {r + 1} of {rounds})")
                alone_r = await _steps(cb, pipeline, kind.b, steps, f"alone{r}", pause_s)
                alone += alone_r.latencies
                queued_alone += alone_r.queued
                if kind.slots is not None:
                    demands.append(alone_r.demand(kind.slots))
                elif kind.batches is not None:
                    demands.append(alone_r.demand(kind.batches, batched=True))
                progress(f"{pipeline}: B while A keeps {kind.flood} in flight, {steps} steps (round {r + 1})")
                shared_r, (scored, seconds, compute, size) = await flooded(cb, steps, f"shared{r}")
                shared += shared_r.latencies
                queued_shared += shared_r.queued
                round_ratios.append(_pct(shared_r.latencies, 0.99) / _pct(alone_r.latencies, 0.99))
                a_scored, a_time = a_scored + scored, a_time + seconds
                computes.append(compute)
                sizes.append(size)
    finally:
        conn.send("exit")
        await loop.run_in_executor(None, flooder.join, 30)
    rate = a_scored / a_time
    unit = _unit(statistics.median(computes), statistics.median(sizes), rate)
    alone_p99 = _pct(alone, 0.99)
    ratio = _pct(shared, 0.99) / alone_p99
    floor = 1.0 if kind.gives_way else (alone_p99 + unit) / alone_p99
    demand = statistics.median(demands) if demands else None
    if demand is not None:  # B asks for more than its weighted half: under A's flood it gets that half
        floor = max(floor, demand / B_SHARE)
    return [kind.name, batching, f"{_pct(alone, 0.5) * 1e3:.1f} / {alone_p99 * 1e3:.1f}",
            f"{_pct(shared, 0.5) * 1e3:.1f} / {_pct(shared, 0.99) * 1e3:.1f}", f"{ratio:.2f}x",
            "-".join(f"{r:.2f}" for r in (min(round_ratios), max(round_ratios))) + "x",
            f"{_pct(shared, 0.5) / _pct(alone, 0.5):.2f}x",
            f"{_pct(queued_alone, 0.99) * 1e3:.1f} / {_pct(queued_shared, 0.99) * 1e3:.1f}", f"{unit * 1e3:.1f}",
            "-" if demand is None else f"{demand:.0%}", "-" if floor == 1.0 else f"{floor:.2f}x", f"{rate:.0f}",
            "yes" if ratio <= TARGET_RATIO else "no",
            "yes" if ratio <= max(TARGET_RATIO, floor) else "no"]  # fmt: skip


def _unit(compute: float, batch_size: float, rate: float) -> float:
    """How long one unit of A's started work holds the source's capacity, from A's own results in the same run: a
    per-sample source's sample holds its slot for its compute time; a batched source (a model, an inline rule)
    holds its device or the event loop for one batch, and while A saturates it a batch ends every batch/rate
    seconds (its compute time would also count the wait of a staged batch for the one computing)."""
    return compute if batch_size <= 1 else batch_size / rate


async def isolation(args: argparse.Namespace) -> list[list[object]]:
    kinds = list(args.kinds)
    if shutil.which("bwrap") is None and (sandboxed := [k for k in ("code", "hostile") if k in kinds]):
        progress(f"bubblewrap is not installed (make install): skipping {', '.join(sandboxed)}")
        kinds = [k for k in kinds if k not in sandboxed]
    rows: list[list[object]] = []
    with tempfile.TemporaryDirectory(prefix="rewardmesh-fleet-") as tmp:
        workdir = Path(tmp)
        reward_model = None
        if "model" in kinds:
            from bench.mesh import tiny_policy
            from rewardmesh.server.cli import default_models_dir

            reward_model = tiny_policy(default_models_dir())[0].reward_model
        ctx = multiprocessing.get_context("spawn")
        judge_conn, judge_child = ctx.Pipe()
        judge = ctx.Process(target=_judge_main, args=(judge_child,), daemon=True)
        judge.start()
        try:
            judge_port = await asyncio.get_running_loop().run_in_executor(None, judge_conn.recv)
            catalog = _kinds(workdir, f"http://127.0.0.1:{judge_port}", reward_model, args.model_batches_in_flight)
            pipelines: dict[str, Any] = {}
            for name in kinds:
                pipelines[f"{name}-default"] = {"sources": catalog[name].sources}
                pipelines[f"{name}-user"] = {"sources": catalog[name].sources, "batching": USER_BATCHING}
            tenants = {name: {"token_env": f"FLEET_BENCH_{name[-1].upper()}"} for name in TOKENS}
            config = workdir / "reward.yaml"
            config.write_text(yaml.safe_dump({"pipelines": pipelines, "tenants": tenants}))
            os.environ.update({f"FLEET_BENCH_{name[-1].upper()}": token for name, token in TOKENS.items()})
            argv = [sys.executable, "-m", "rewardmesh.server.cli", "serve", "reward", "--host", "127.0.0.1",
                    "--port", "0", "--config", str(config)]  # fmt: skip
            server = ServerProcess("reward", argv, workdir)
            progress(f"starting a reward server with {len(pipelines)} pipelines")
            server.start()
            try:
                await server.wait_serving()
                for name in kinds:
                    steps = max(1, args.steps * catalog[name].step_share // 100)
                    for batching in ("default", "user"):
                        rows.append(await _isolation_row(server.address, catalog[name], batching, steps,
                                                         args.rounds, args.settle_s, args.pause_ms / 1000))  # fmt: skip
            finally:
                server.stop()
        finally:
            judge_conn.send("exit")
            judge.join(10)
    return rows


# ------------------------------------------------------------------------------------------------------- sizing


@dataclass(frozen=True)
class Workload:
    steps: int
    samples: int
    generate_s: float
    train_s: float
    batch: int
    batch_s: float


def _table(jobs: int) -> TenantTable:
    return TenantTable([(Tenant(f"job{j}"), f"token-job{j}") for j in range(jobs)])


@contextlib.asynccontextmanager
async def _fleet(count: int, work: Workload, table: TenantTable) -> AsyncIterator[list[RewardServer]]:
    options = ServerOptions(host="127.0.0.1", port=0)
    engines = [paced_engine(work.batch_s, work.batch, max_queue_size=65536) for _ in range(count)]
    servers = [RewardServer(engine, options, tenants=table) for engine in engines]
    for server in servers:
        await server.start()
    try:
        yield servers
    finally:
        for server in servers:
            await server.stop(grace=1.0)


async def _job(client: RewardClient, name: str, work: Workload, seed: int, deadline_s: float | None = None) -> list[
    tuple[float, bool]
]:  # fmt: skip
    """One training job's steps: (step time, scored by its deadline) each."""
    rng = random.Random(seed)
    await asyncio.sleep(rng.uniform(0, work.generate_s + work.train_s))  # jobs start out of phase
    steps = []
    for step in range(work.steps):
        started = time.monotonic()
        due = None if deadline_s is None else started + deadline_s
        finish = sorted(rng.uniform(0, work.generate_s) for _ in range(work.samples))
        futures = []
        for k, at in enumerate(finish):
            await asyncio.sleep(max(0.0, started + at - time.monotonic()))
            futures.append(client.submit(_sample(f"{name}-{step}-{k}"), PIPELINE, step_deadline=due))
        results = await asyncio.gather(*futures)
        scored = time.monotonic()
        ok = all(not r.HasField("error") for r in results) and (due is None or scored <= due)
        await asyncio.sleep(work.train_s)
        steps.append((time.monotonic() - started, ok))
    return steps


async def _run(jobs: int, servers_per_job: int | None, shared: int, work: Workload) -> list[float]:
    """Median step time of each job: with `servers_per_job` of its own, or all on `shared` servers."""
    table = _table(jobs)
    count = jobs * servers_per_job if servers_per_job else shared
    async with _fleet(count, work, table) as fleet:
        clients = []
        for j in range(jobs):
            mine = fleet[j * servers_per_job : (j + 1) * servers_per_job] if servers_per_job else fleet
            clients.append(RewardClient([s.address for s in mine], token=f"token-job{j}"))
        try:
            runs = await asyncio.gather(*(_job(c, f"job{j}", work, seed=j) for j, c in enumerate(clients)))
        finally:
            for c in clients:
                await c.close()
    return [statistics.median(t for t, _ in steps) for steps in runs]  # a stall of this busy machine is one step


async def _deadlines(jobs: int, work: Workload) -> dict[str, float]:
    """J jobs of one tenant on one saturated server (each step's samples at once), odd jobs with tight step
    deadlines: the fraction of steps scored in time, with deadlines sent (EDF) and without (FIFO)."""
    burst = Workload(work.steps, work.samples, 0.0, 0.0, work.batch, work.batch_s)
    whole = jobs * work.samples / (work.batch / work.batch_s)  # seconds to score one step of every job
    made: dict[str, float] = {}
    for mode in ("fifo", "edf"):
        async with _fleet(1, burst, _table(jobs)) as fleet:
            clients = [RewardClient([fleet[0].address], token="token-job0") for _ in range(jobs)]  # one tenant
            try:
                tight = 0.75 * whole  # a tight step fits if it goes first, not behind everyone's
                runs = await asyncio.gather(*(
                    _job_deadline(c, f"job{j}", burst, tight if j % 2 else 4 * whole, mode == "edf")
                    for j, c in enumerate(clients)))  # fmt: skip
            finally:
                for c in clients:
                    await c.close()
        tight_steps = [ok for j, steps in enumerate(runs) if j % 2 for ok in steps]
        all_steps = [ok for steps in runs for ok in steps]
        made[f"{mode}_tight"] = sum(tight_steps) / len(tight_steps)
        made[f"{mode}_all"] = sum(all_steps) / len(all_steps)
    return made


async def _job_deadline(client: RewardClient, name: str, work: Workload, deadline_s: float, send: bool) -> list[bool]:
    """Steps sent all at once, one after another; each judged against its deadline (sent to the server or not)."""
    out = []
    for step in range(work.steps):
        started = time.monotonic()
        due = started + deadline_s
        futures = [client.submit(_sample(f"{name}-{step}-{k}"), PIPELINE, step_deadline=due if send else None)
                   for k in range(work.samples)]  # fmt: skip
        results = await asyncio.gather(*futures)
        out.append(all(not r.HasField("error") for r in results) and time.monotonic() <= due)
    return out


def _within(shared: Sequence[float], dedicated: Sequence[float], tolerance: float) -> bool:
    return all(s <= d * (1 + tolerance) for s, d in zip(shared, dedicated, strict=True))


async def sizing(args: argparse.Namespace) -> None:
    work = Workload(args.job_steps, args.samples, args.generate_s, args.train_s, args.batch, args.batch_s)
    rows = []
    for jobs in args.jobs:
        progress(f"{jobs} jobs, each with its own reward server")
        dedicated = await _run(jobs, 1, 0, work)
        needed, times, tried = jobs, dedicated, []
        for m in range(1, jobs + 1):
            progress(f"{jobs} jobs sharing {m} reward server(s)")
            shared = await _run(jobs, None, m, work)
            tried.append(f"{m}: {max(s / d for s, d in zip(shared, dedicated, strict=True)):.2f}")
            if _within(shared, dedicated, args.tolerance):
                needed, times = m, shared
                break
        rows.append([jobs, jobs, f"{statistics.mean(dedicated):.2f}", needed, f"{statistics.mean(times):.2f}",
                     ", ".join(tried), f"{jobs / needed:.2f}x"])  # fmt: skip
    capacity = args.batch / args.batch_s
    print(
        f"workload: {args.job_steps} steps of {args.samples} samples per job, generating {args.generate_s:g}s then "
        f"training {args.train_s:g}s; reward server: {args.batch} samples per {args.batch_s:g}s batch "
        f"({capacity:g}/s); same step times: each job within {args.tolerance:.0%} of its dedicated one\n"
    )
    print(markdown_table(["jobs", "dedicated servers", "dedicated step s", "shared servers needed",
                          "shared step s", "worst job's step time ratio (servers: ratio)",
                          "servers saved"], rows))  # fmt: skip
    drows = []
    for jobs in args.jobs:
        progress(f"deadlines: {jobs} jobs on one saturated server, FIFO then EDF")
        made = await _deadlines(jobs, work)
        drows.append([jobs, f"{made['fifo_tight']:.0%}", f"{made['edf_tight']:.0%}", f"{made['fifo_all']:.0%}",
                      f"{made['edf_all']:.0%}"])  # fmt: skip
    print("\nsteps scored by their step deadline, jobs of one tenant on one saturated server (odd jobs tight, even "
          "jobs loose):\n")  # fmt: skip
    print(markdown_table(["jobs", "tight steps FIFO", "tight steps EDF", "all steps FIFO", "all steps EDF"], drows))


async def main_async(args: argparse.Namespace) -> None:
    quiet_logs()
    info = machine_info()
    rows = await isolation(args) if args.kinds else []
    print(f"\nmachine: {info['cpu']}, {info['usable_cpus']} usable cores, {info['device']}; python {info['python']}")
    if rows:
        print(
            f"\nB: closed loop of steps of {STEP} samples at once, {args.pause_ms:g} ms apart ({args.rounds} rounds of "
            f"{args.steps} steps alone and {args.steps} while A floods, in turn; model and rules: 400%); A "
            "floods (samples kept in flight: function 3000, code and hostile 200, judge 1000, model 3000, rules "
            f"3000); two tenants of weight 1 on one real reward server over gRPC; user batching: {USER_BATCHING}\n"
        )
        header = ["kind", "batching", "B alone p50 / p99 ms", "B while A floods p50 / p99 ms", "p99 ratio",
                  "p99 ratio by round", "p50 ratio", "B queued p99 ms alone / flooded", "A's unit ms",
                  "B's demand alone", "floor", "A scored/s meanwhile", f"p99 <= {TARGET_RATIO}x",
                  f"p99 <= max({TARGET_RATIO}x, floor)"]  # fmt: skip
        print(markdown_table(header, rows))
        print(
            "\nA's unit: how long one unit of A's started work holds the capacity (a per-sample source: the median "
            "compute time of A's results; a batched one: one batch, A's median batch size / A's rate). B's demand "
            "alone: the share of the source's slots (a model's: its batch in flight) B's own work held while B ran "
            "alone, pauses included (the sum of B's compute times, a model's batches', over the phase's time and the "
            "slots; median of the rounds; -: an inline rule, whose capacity is the event loop). floor: the least "
            "p99 ratio a fair queue can give, the larger of two: (B alone p99 + A's unit) "
            "/ B alone p99 where the source does not preempt started work (B's sample cannot start before the unit "
            "that was running when it arrived ends; the sources that stop A's work for B, under its share, at once, "
            "or pause it have none: a judge's requests, programs, a model's pass on the CPU), and B's demand alone / "
            "its weighted share (1/2) where B asks for more than that share (B then gets its share, no more: the "
            "rest is A's; -: neither). p99 ratio by round: the least and the most of the rounds' own p99 ratios "
            "(each round's B alone against its B flooded), how much the verdict moves from one round to the next on "
            "this machine. B queued: how long B's "
            "samples waited in the server before their work started (the fair queue and the sources' capacity decide "
            "it), as the server reports it; the rest of B's latency is the work itself and the way to it and back."
        )
    if args.sizing:
        await sizing(args)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--kinds",
        type=lambda s: [k for k in s.split(",") if k],
        default=list(KINDS),
        help=f"source kinds to measure isolation on (comma-separated; empty: none), of {KINDS}",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=75,
        help="B's steps per phase and round (isolation; model and rules run 4 times as many)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="rounds of (B alone, B while A floods), in turn")
    parser.add_argument(
        "--pause-ms",
        type=float,
        default=0.0,
        help="B's pause after each step, as a trainer's while it trains (0: steps back to back, so that B alone keeps "
        "a pool of 2 workers busy, and under contention gets its fair half once its credit is spent)",
    )
    parser.add_argument(
        "--model-batches-in-flight",
        type=int,
        default=0,
        help="the reward model's batches in flight (0: the CPU's own, 1; 2: an accelerator's, one computing and one "
        "staged)",
    )
    parser.add_argument("--job-steps", type=int, default=5, help="each simulated job's steps (sizing)")
    parser.add_argument("--settle-s", type=float, default=2.0, help="seconds A floods before B's steps are timed")
    parser.add_argument("--sizing", action="store_true", help="also measure fleet sizing and step deadlines")
    parser.add_argument("--jobs", type=lambda s: [int(x) for x in s.split(",")], default=[2, 3, 4])
    parser.add_argument("--samples", type=int, default=64, help="samples per step")
    parser.add_argument("--generate-s", type=float, default=1.0)
    parser.add_argument("--train-s", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=8, help="reward batch size")
    parser.add_argument("--batch-s", type=float, default=0.05, help="seconds per reward batch")
    parser.add_argument("--tolerance", type=float, default=0.05, help="allowed step-time increase when sharing")
    asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    main()

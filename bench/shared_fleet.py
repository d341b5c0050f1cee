"""Reward servers needed when training jobs share one fleet instead of each having its own, and what step
deadlines buy under saturation.

    python -m bench.shared_fleet [--jobs 2,3,4 --steps 5 --samples 64 --generate-s 1.0 --train-s 1.0]

Each simulated training job runs steps: for --generate-s seconds its samples finish (at seeded random times)
and each is sent to the reward fleet at once, as a rollout server does; the step ends when its last sample is
scored; then the job trains for --train-s seconds, sending nothing. Jobs start at random offsets. A reward server
scores a batch of up to --batch samples in --batch-s seconds (demo.paced_reward: the service time of a reward
model on an accelerator, without spending this machine's CPU), so its capacity is batch / batch_s samples per
second. Every server is a real reward server on 127.0.0.1 and every job a RewardClient with its tenant's token.

Measured side by side in one run, for each number of jobs J:
  dedicated  every job with one reward server of its own (J servers): the median step time each job gets;
  shared     the J jobs as tenants of m servers, m = 1, 2, ... until every job's median step time is within
             --tolerance of its dedicated one: the servers a shared fleet needs for the same step times.
Then deadlines: J jobs of one tenant (one team's token) on one saturated server, each sending its steps back to
back, half of them with tight step deadlines; the fraction of steps scored by their deadline in arrival order
(FIFO: no deadlines sent) and earliest deadline first (deadlines sent). Across tenants the share is by weight;
within a tenant, deadlines decide.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from bench.common import machine_info, markdown_table, progress
from rewardmesh.client.reward_client import RewardClient
from rewardmesh.common.tensors import ids_tensor
from rewardmesh.demo.paced_reward import PIPELINE, paced_engine
from rewardmesh.reward_engine.fair_queue import Tenant
from rewardmesh.server.reward.server import RewardServer
from rewardmesh.server.reward.tenants import TenantTable
from rewardmesh.server.serving import ServerOptions
from rewardmesh.v1 import common_pb2


@dataclass(frozen=True)
class Workload:
    steps: int
    samples: int
    generate_s: float
    train_s: float
    batch: int
    batch_s: float


def _sample(sid: str) -> common_pb2.Sample:
    return common_pb2.Sample(sample_id=sid, group_id=sid, prompt_ids=ids_tensor([1, 2, 3]),
                             response_ids=ids_tensor([4, 5]), response_text="#### 4", ground_truth="4")  # fmt: skip


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


async def main_async(args: argparse.Namespace) -> None:
    work = Workload(args.steps, args.samples, args.generate_s, args.train_s, args.batch, args.batch_s)
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
    info = machine_info()
    print(f"\nmachine: {info['cpu']}, {info['usable_cpus']} usable cores, {info['device']}; python {info['python']}")
    print(
        f"workload: {args.steps} steps of {args.samples} samples per job, generating {args.generate_s:g}s then "
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=lambda s: [int(x) for x in s.split(",")], default=[2, 3, 4])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--samples", type=int, default=64, help="samples per step")
    parser.add_argument("--generate-s", type=float, default=1.0)
    parser.add_argument("--train-s", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=8, help="reward batch size")
    parser.add_argument("--batch-s", type=float, default=0.05, help="seconds per reward batch")
    parser.add_argument("--tolerance", type=float, default=0.05, help="allowed step-time increase when sharing")
    asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    main()

"""How much reward time the streaming mesh hides behind generation: synchronous vs streaming vs an ideal queue.

    python -m bench.reward_overlap [--prompts 16 --n 4 --latency uniform:0.2:2.0 --repeats 15] [--reward-model]

Workload: B prompts x n samples on the real hf backend with the tiny policy, one Generate call per prompt, all
in one micro-batch. Lengths vary per sample: a few extra stop token ids make each decode step end a sample with
a small probability (the random tiny policy's next-token distribution is nearly uniform), so response lengths
are geometric (mean ~60 tokens, long tail up to --max-tokens), as right-skewed as RL response lengths are;
--length-spread also varies max_tokens per prompt. Generation is seeded, so every mode of a repeat generates
the same responses and the judge gives each sample the same latency.

Reward: a pipeline with finite capacity, a simulated remote judge (an async verl-style function written to a
temp .py file and loaded by the `function` source type) that sleeps a per-sample latency drawn from a
configurable distribution, in multiples of the mean generation time of one sample (verl's
timing_s/agent_loop/generate_sequences/mean, measured in calibration runs first), with at most C calls in
flight (batching max_batch_size=1, max_concurrent_batches=C). By default C = total reward work / generation
makespan, so reward work roughly equals generation time: the case where overlap matters most.
`--reward-model` scores with the real tiny reward model instead (the targets are for the judge).

Measured side by side in one run, repeated with the order of (a) and (b) alternating (medians reported):
  (a) synchronous: Generate without reward, then ScoreBatch everything on the same reward service;
  (b) streaming: Generate with reward=pipeline, each sample streamed into the reward service as it finishes;
  (c) ideal: from (b)'s own generation finish times (arrival at the client minus the reward wait) and reward
      compute times, as if each sample entered a C-slot FIFO reward queue the instant it finished (simulated).
Targets: (a)/(b) >= 1.5 and (b)/(c) <= 1.15.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import markdown_table, progress
from bench.mesh import (
    LatencyDist,
    PromptJob,
    SampleRecord,
    batched_finish_times,
    fifo_finish_times,
    judge_pipeline,
    machine_table,
    make_jobs,
    median,
    reward_model_pipeline,
    run_generate,
    spread_max_tokens,
    stop_token_ids,
    tiny_policy,
    verdict,
    write_judge,
)
from rewardmesh.client.reward_client import RewardClient
from rewardmesh.demo.mesh import Mesh, local_mesh
from rewardmesh.demo.rl_demo import addition_prompts
from rewardmesh.server.cli import default_models_dir

PIPELINE = "sim_judge"
RM_PIPELINE = "tiny_rm"
SPEEDUP_TARGET = 1.5
IDEAL_TARGET = 1.15


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.reward_overlap",
        description="Synchronous vs streaming rewards vs the ideal overlap, on the hf backend with the tiny policy.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--prompts", type=int, default=16, help="B: prompts per batch (one Generate call each)")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=480, help="max_tokens (the cap of every response)")
    p.add_argument(
        "--stop-tokens",
        type=int,
        default=6,
        help="extra stop token ids: each step ends a sample with probability ~(K+2)/vocab on the random tiny "
        "policy, so lengths are geometric per sample (mean ~60 tokens at K=6, long tail up to --max-tokens)",
    )
    p.add_argument(
        "--length-spread",
        choices=["none", "loguniform", "uniform", "linear"],
        default="none",
        help="also vary max_tokens per prompt between --min-tokens and --max-tokens",
    )
    p.add_argument("--min-tokens", type=int, default=32, help="smallest per-prompt max_tokens with --length-spread")
    p.add_argument(
        "--latency",
        default="uniform:0.2:2.0",
        help="judge latency per sample in multiples of the mean generation time of one sample: "
        "uniform:LO:HI, lognormal:MEDIAN:SIGMA, exp:MEAN or fixed:X",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=0,
        help="C: judge calls in flight; 0 = total reward work / generation makespan (at least 1)",
    )
    p.add_argument("--reward-model", action="store_true", help="score with the real tiny reward model instead")
    p.add_argument("--repeats", type=int, default=15, help="runs of (a)+(b); medians are reported")
    p.add_argument("--calibration-runs", type=int, default=5, help="generation-only runs to calibrate (medians)")
    p.add_argument("--max-num-seqs", type=int, default=0, help="hf backend: most rows decoded together (0: B x n)")
    p.add_argument(
        "--batch-wait-ms",
        type=float,
        default=50.0,
        help="hf backend micro-batch collection window: long enough that all B Generate calls share one "
        "micro-batch (the backend has no continuous batching: a late request waits for the whole running batch)",
    )
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--models", type=Path, default=default_models_dir(), help="tiny models (built if missing)")
    return p


@dataclass
class Workload:
    """What every Generate call of the run shares."""

    specs: list[Any]
    lengths: list[int]
    n: int
    stops: list[int]
    temperature: float

    def jobs(self, seed: int, tag: str) -> list[PromptJob]:
        return make_jobs(self.specs, self.lengths, seed=seed, tag=tag)

    async def generate(
        self, address: str, jobs: list[PromptJob], reward: str = "", keep: bool = False
    ) -> list[SampleRecord]:
        records, _t0 = await run_generate(
            address,
            jobs,
            self.n,
            reward=reward,
            temperature=self.temperature,
            stop_token_ids=self.stops,
            keep_samples=keep,
        )
        return records


@dataclass
class Repeat:
    sync_s: float
    sync_gen_s: float
    stream_s: float
    stream_gen_s: float
    ideal_s: float
    ideal_alone_s: float  # (c'): the ideal queue fed by (a)'s (undisturbed) generation finish times
    reward_work_s: float
    mean_generate_s: float
    mean_length: float
    max_length: int
    same_latencies: bool
    errors: int
    micro_batches: int  # hf micro-batches one generation took (1: all samples decoded together)


@dataclass
class Calibration:
    mean_generate_s: float
    makespan_s: float
    mean_length: float
    max_length: int


async def calibrate(address: str, work: Workload, seed: int, runs: int) -> Calibration:
    """Mean generation time of one sample and the makespan for this workload without rewards (medians)."""
    records: list[list[SampleRecord]] = []
    await work.generate(address, work.jobs(seed, "warm")[:2])  # warm the channel and the decode path
    for i in range(runs):
        records.append(await work.generate(address, work.jobs(seed + 7919 * (i + 1), f"calib{i}")))
    return Calibration(
        mean_generate_s=median([statistics.fmean(r.generate_s for r in recs) for recs in records]),
        makespan_s=median([max(r.arrived for r in recs) for recs in records]),
        mean_length=statistics.fmean(r.response_length for recs in records for r in recs),
        max_length=max(r.response_length for recs in records for r in recs),
    )


async def one_repeat(
    mesh: Mesh,
    rewards: RewardClient,
    work: Workload,
    jobs: list[PromptJob],
    pipeline: str,
    slots: int,
    batched: bool,
    order: str,
) -> Repeat:
    address = mesh.rollout_addresses[0]
    backend: Any = mesh.rollouts[0].backend  # an HFBackend (it counts its micro-batches)
    sync: tuple[float, float, list[Any]] | None = None
    sync_records: list[SampleRecord] = []
    stream: list[SampleRecord] = []
    micro_batches = 0
    for mode in order:
        before = backend.num_batches
        if mode == "a":  # generate everything, then score everything
            t0 = time.perf_counter()
            sync_records = records = await work.generate(address, jobs, keep=True)
            gen_end = time.perf_counter() - t0
            scored = await rewards.score_batch([r.sample for r in records], pipeline)
            sync = (time.perf_counter() - t0, gen_end, scored)
        else:  # each sample streamed into the reward service the moment it finishes
            stream = await work.generate(address, jobs, reward=pipeline)
        micro_batches = max(micro_batches, backend.num_batches - before)
    assert sync is not None
    sync_s, sync_gen_s, scored = sync
    ready = [r.generated for r in stream]
    service = [r.compute_s for r in stream]
    # (c') the same queue fed by (a)'s generation finish times (same seeds, same samples): generation undisturbed
    # by the streaming reward work running beside it.
    by_id = {r.sample_id: r.arrived for r in sync_records}
    ready_alone = [by_id.get(r.sample_id, r.generated) for r in stream]
    if batched:
        ends = batched_finish_times(ready, service, max_batch=32, slots=slots)
        ends_alone = batched_finish_times(ready_alone, service, max_batch=32, slots=slots)
    else:
        ends = fifo_finish_times(ready, service, slots)
        ends_alone = fifo_finish_times(ready_alone, service, slots)
    sync_lat = sorted(round(r.extras.get("judge_latency", 0.0), 6) for r in scored)
    stream_lat = sorted(round(r.judge_latency, 6) for r in stream)
    errors = sum(1 for r in scored if r.HasField("error")) + sum(1 for r in stream if r.error)
    return Repeat(
        sync_s=sync_s,
        sync_gen_s=sync_gen_s,
        stream_s=max(r.arrived for r in stream),
        stream_gen_s=max(ready),
        ideal_s=max(ends),
        ideal_alone_s=max(ends_alone),
        reward_work_s=sum(service),
        mean_generate_s=statistics.fmean(r.generate_s for r in stream),
        mean_length=statistics.fmean(r.response_length for r in stream),
        max_length=max(r.response_length for r in stream),
        same_latencies=sync_lat == stream_lat,
        errors=errors,
        micro_batches=micro_batches,
    )


async def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    models, policy, tokenizer = tiny_policy(args.models)
    rng = random.Random(args.seed)
    specs = addition_prompts(tokenizer, args.prompts, rng)
    for i, spec in enumerate(specs):
        spec.extra_info = {"prompt": i}
    lengths = spread_max_tokens(args.prompts, args.min_tokens, args.max_tokens, rng, args.length_spread)
    work = Workload(specs, lengths, args.n, stop_token_ids(tokenizer, args.stop_tokens), args.temperature)
    total = args.prompts * args.n
    max_batch = args.max_num_seqs or total
    dist = LatencyDist.parse(args.latency)

    reps: list[Repeat] = []
    with tempfile.TemporaryDirectory(prefix="rewardmesh-bench-") as tmp:
        async with local_mesh(policy, None, max_num_seqs=max_batch, batch_wait_ms=args.batch_wait_ms) as mesh:
            address = mesh.rollout_addresses[0]
            progress(
                f"calibrating: {args.prompts} prompts x {args.n} samples, max_tokens {sorted(set(lengths))}, "
                f"{len(work.stops)} extra stop tokens"
            )
            calib = await calibrate(address, work, args.seed + 1, args.calibration_runs)
            unit = calib.mean_generate_s
            progress(
                f"calibration: mean generation time of one sample {unit:.3f}s, makespan {calib.makespan_s:.3f}s, "
                f"response length mean {calib.mean_length:.0f} max {calib.max_length}"
            )
            # The pipeline is added to the running reward server now that its capacity and latencies are known.
            if args.reward_model:
                pipeline, batched, slots = RM_PIPELINE, True, 1
                config = {RM_PIPELINE: reward_model_pipeline(models.reward_model)}
                reward_desc = "tiny reward model (dynamic batches <= 32, 1 batch in flight)"
            else:
                pipeline, batched = PIPELINE, False
                expected = total * dist.mean * unit
                slots = args.concurrency or max(1, round(expected / calib.makespan_s))
                config = {PIPELINE: judge_pipeline(write_judge(Path(tmp), dist, unit, args.seed), slots)}
                reward_desc = (
                    f"simulated judge: latency {dist} x {unit:.3f}s (mean {dist.mean * unit:.3f}s), C={slots} calls "
                    f"in flight (expected reward work {expected:.1f}s / makespan {calib.makespan_s:.2f}s)"
                )
            mesh.reward.engine.add_from_config(config)
            await mesh.reward.engine.pipelines[pipeline].warmup()
            progress(f"reward: {reward_desc}")
            async with RewardClient([mesh.reward.address]) as rewards:
                warm = work.jobs(args.seed + 2, "warm")[:2]
                await work.generate(address, warm, reward=pipeline)
                recs = await work.generate(address, warm, keep=True)
                await rewards.score_batch([r.sample for r in recs], pipeline)
                for rep in range(args.repeats):
                    jobs = work.jobs(args.seed + 100_003 * (rep + 1), f"r{rep}")
                    order = "ab" if rep % 2 == 0 else "ba"
                    r = await one_repeat(mesh, rewards, work, jobs, pipeline, slots, batched, order)
                    reps.append(r)
                    progress(
                        f"repeat {rep + 1}/{args.repeats} ({order}): sync {r.sync_s:.2f}s (gen {r.sync_gen_s:.2f}s), "
                        f"streaming {r.stream_s:.2f}s (gen {r.stream_gen_s:.2f}s), ideal {r.ideal_s:.2f}s "
                        f"-> {r.sync_s / r.stream_s:.2f}x, {r.stream_s / r.ideal_s:.3f}x of ideal"
                    )
    wall = time.perf_counter() - started
    print(report(args, reps, work, calib, slots, reward_desc, wall))
    return 0


def report(
    args: argparse.Namespace,
    reps: list[Repeat],
    work: Workload,
    calib: Calibration,
    slots: int,
    reward_desc: str,
    wall: float,
) -> str:
    sync = median([r.sync_s for r in reps])
    stream = median([r.stream_s for r in reps])
    ideal = median([r.ideal_s for r in reps])
    speedup = median([r.sync_s / r.stream_s for r in reps])
    vs_ideal = median([r.stream_s / r.ideal_s for r in reps])
    best = median([r.sync_s / r.ideal_s for r in reps])
    slowdown = median([r.stream_gen_s / r.sync_gen_s for r in reps])
    ideal_alone = median([r.ideal_alone_s for r in reps])
    best_alone = median([r.sync_s / r.ideal_alone_s for r in reps])
    default = not args.reward_model
    config = {
        "workload": f"{args.prompts} prompts x n={args.n} = {args.prompts * args.n} samples, hf backend, tiny policy",
        "lengths": lengths_desc(args, work, reps),
        "hf backend": f"max_num_seqs {args.max_num_seqs or args.prompts * args.n}, "
        f"batch_wait_ms {args.batch_wait_ms:g}, 1 decode thread",
        "calibration (no reward, medians)": f"{args.calibration_runs} runs: mean generation time of one sample "
        f"{calib.mean_generate_s:.3f}s, makespan {calib.makespan_s:.3f}s",
        "reward": reward_desc,
        "repeats": f"{len(reps)} (modes alternate order; medians)",
        "same judge latencies in (a) and (b)": "n/a" if args.reward_model else str(all(r.same_latencies for r in reps)),
        "errors": str(sum(r.errors for r in reps)),
        "hf micro-batches per generation (max)": str(max(r.micro_batches for r in reps)),
        "wall time": f"{wall:.0f}s",
    }
    rows = [
        ["(a) synchronous: generate, then score", f"{sync:.3f}", f"{median([r.sync_gen_s for r in reps]):.3f}", ""],
        ["(b) streaming rewards", f"{stream:.3f}", f"{median([r.stream_gen_s for r in reps]):.3f}", ""],
        ["(c) ideal (C-slot queue on (b)'s times)", f"{ideal:.3f}", "", ""],
        [
            "(a)/(b) speedup",
            f"{speedup:.2f}x",
            "",
            f">= {SPEEDUP_TARGET}x: "
            + (verdict(speedup >= SPEEDUP_TARGET) if default else "n/a (target is for the default judge)"),
        ],
        ["(b)/(c) vs ideal", f"{vs_ideal:.3f}x", "", f"<= {IDEAL_TARGET}x: {verdict(vs_ideal <= IDEAL_TARGET)}"],
        ["(a)/(c): the most any streaming could gain, given (b)'s generation", f"{best:.2f}x", "", ""],
        ["generation slowdown while streaming ((b) gen / (a) gen)", f"{slowdown:.2f}x", "", ""],
        ["(c') ideal queue on (a)'s undisturbed generation times", f"{ideal_alone:.3f}", "", ""],
        ["(a)/(c'): the most streaming could gain if generation did not slow", f"{best_alone:.2f}x", "", ""],
    ]
    per_rep = [
        [
            i + 1,
            f"{r.sync_s:.3f}",
            f"{r.stream_s:.3f}",
            f"{r.ideal_s:.3f}",
            f"{r.sync_s / r.stream_s:.2f}x",
            f"{r.stream_s / r.ideal_s:.3f}x",
            f"{r.reward_work_s:.1f}",
            f"{r.mean_generate_s:.3f}",
        ]
        for i, r in enumerate(reps)
    ]
    return "\n\n".join(
        [
            "## bench.reward_overlap",
            machine_table(config),
            markdown_table(["mode", "time (s, median)", "generation done at (s)", "target"], rows),
            markdown_table(
                ["repeat", "(a) s", "(b) s", "(c) s", "(a)/(b)", "(b)/(c)", "reward work s", "mean gen s"], per_rep
            ),
        ]
    )


def lengths_desc(args: argparse.Namespace, work: Workload, reps: list[Repeat]) -> str:
    spread = (
        f"max_tokens per prompt {args.length_spread} {args.min_tokens}..{args.max_tokens}"
        if args.length_spread != "none"
        else f"max_tokens {args.max_tokens}"
    )
    mean = median([r.mean_length for r in reps])
    longest = max(r.max_length for r in reps)
    return f"{spread}, {len(work.stops)} extra stop tokens; response length mean {mean:.0f}, max {longest}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.prompts < 1 or args.n < 1 or args.repeats < 1 or not 1 <= args.min_tokens <= args.max_tokens:
        raise SystemExit("--prompts, --n, --repeats must be >= 1 and 1 <= --min-tokens <= --max-tokens")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())

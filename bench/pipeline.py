"""Step time of the same GRPO training steps run three ways: synchronous, streaming rewards, and streaming plus
mini-batch pipelining with one-step off-policy rollouts.

    python -m bench.pipeline [--steps 6 --prompts 16 --n 4 --rounds 2]

Setup: the demo's in-process mesh (one reward server and two hf rollout servers on 127.0.0.1, tiny policy,
one decode thread each), the demo's task (single-digit additions), the reference GRPO learner of `client/`
training in a worker thread, weights synced to both rollout servers after every step. Responses are sampled
with a few extra stop tokens, so their lengths vary per sample (geometric, long tail up to --max-tokens), and
the reward is a simulated remote judge with real cost: an async verl-style function that sleeps a per-sample
latency drawn uniformly from 0.2x..2x the mean generation time of one sample (calibrated first), at most C
calls in flight, C chosen so the step's reward work roughly equals its generation time (as bench.reward_overlap).
Every step trains on the same number of mini-batches (--minibatches optimizer steps per batch, complete groups).

  (a) synchronous: generate (no reward), then score everything with ScoreBatch, then train, then sync weights;
  (b) streaming rewards: generate_batch(reward=judge) (each sample scored as it finishes), then train, then sync;
  (c) streaming rewards + mini-batch pipeline + one-step off-policy: stream_minibatches() per step, training on
      each mini-batch the moment it is complete, with the next step's rollouts already running (the same
      one-step window as batches(off_policy_steps=1); groups older than one policy version are dropped).

Step time is the steady-state interval between weight syncs (first step excluded), median over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import markdown_table, progress
from bench.mesh import (
    LatencyDist,
    judge_pipeline,
    machine_table,
    median,
    stop_token_ids,
    tiny_policy,
    verdict,
    write_judge,
)
from rewardmesh.client.batch import RolloutBatch, ScoredSample, assemble_batch, set_group_advantages
from rewardmesh.client.grpo import GRPOLearner
from rewardmesh.client.reward_client import RewardClient
from rewardmesh.client.trainer import PromptSpec, Sampling, TrainerClient
from rewardmesh.common.tensors import ids_tensor
from rewardmesh.demo.mesh import local_mesh
from rewardmesh.demo.rl_demo import addition_prompts
from rewardmesh.server.cli import default_models_dir
from rewardmesh.v1 import common_pb2, rollout_pb2

PIPELINE = "sim_judge"
MODES = {
    "a": "(a) synchronous: generate, score, train",
    "b": "(b) streaming rewards, then train",
    "c": "(c) streaming + mini-batches + 1-step off-policy",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.pipeline",
        description="GRPO step time: synchronous vs streaming rewards vs streaming + mini-batch pipeline + "
        "one-step off-policy, on the demo's in-process mesh.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=6, help="training steps per mode and round")
    p.add_argument("--rounds", type=int, default=2, help="rounds of (a), (b), (c) (order rotates); medians")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (GRPO group size)")
    p.add_argument("--minibatches", type=int, default=4, help="mini-batches (optimizer steps) per step")
    p.add_argument("--max-tokens", type=int, default=256, help="response cap")
    p.add_argument("--stop-tokens", type=int, default=6, help="extra stop token ids (geometric lengths, mean ~60)")
    p.add_argument("--latency", default="uniform:0.2:2.0", help="judge latency in mean generation times")
    p.add_argument("--concurrency", type=int, default=0, help="judge calls in flight; 0: reward work ~= generation")
    p.add_argument("--rollout-servers", type=int, default=2)
    p.add_argument("--batch-wait-ms", type=float, default=50.0, help="hf backend micro-batch collection window")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--models", type=Path, default=default_models_dir(), help="tiny models (built if missing)")
    return p


@dataclass
class StopSampling(Sampling):
    """Sampling plus stop token ids (the trainer's Sampling has stop strings only)."""

    stop_token_ids: list[int] = field(default_factory=list)

    def to_proto(self) -> rollout_pb2.SamplingParams:
        p = super().to_proto()
        p.stop_token_ids.extend(self.stop_token_ids)
        return p


@dataclass
class ModeRun:
    mode: str
    step_ends: list[float]  # perf_counter at each weight sync
    started: float
    train_s: float = 0.0
    sync_s: float = 0.0
    gen_s: list[float] = field(default_factory=list)  # rollout start -> last sample generated, per step
    exposed_s: list[float] = field(default_factory=list)  # reward time after the step's last generation
    scores: list[float] = field(default_factory=list)
    samples: int = 0
    errors: int = 0
    dropped_stale: int = 0
    max_staleness: int = 0

    @property
    def steady_step_s(self) -> float:
        ends = self.step_ends
        if len(ends) < 2:
            return ends[0] - self.started if ends else float("nan")
        return (ends[-1] - ends[0]) / (len(ends) - 1)

    @property
    def wall_s(self) -> float:
        return self.step_ends[-1] - self.started if self.step_ends else float("nan")


class Trainer:
    """The GRPO learner plus weight sync; training runs in a worker thread (as in the demo)."""

    def __init__(self, policy: str, lr: float, seed: int, client: TrainerClient, run: ModeRun) -> None:
        self.learner = GRPOLearner(policy, lr=lr, seed=seed)
        self.client = client
        self.run = run

    async def train(self, batch: RolloutBatch) -> None:
        t = time.perf_counter()
        await asyncio.to_thread(self.learner.step, batch)
        self.run.train_s += time.perf_counter() - t

    async def sync(self) -> None:
        t = time.perf_counter()
        await self.client.update_weights(self.learner.state_dict())
        self.run.step_ends.append(time.perf_counter())
        self.run.sync_s += self.run.step_ends[-1] - t


def split_minibatches(batch: RolloutBatch, count: int, pad: int) -> list[RolloutBatch]:
    """The batch as `count` mini-batches of complete groups, in arrival order (what (c) trains on)."""
    groups: dict[str, list[ScoredSample]] = collections.OrderedDict()
    for s in batch.samples:
        groups.setdefault(s.group_id, []).append(s)
    chunks: list[list[ScoredSample]] = [[] for _ in range(max(1, count))]
    for i, group in enumerate(groups.values()):
        chunks[i * len(chunks) // len(groups)].extend(group)
    return [assemble_batch(c, pad_token_id=pad, metrics=batch.metrics) for c in chunks if c]


def note(run: ModeRun, batch: RolloutBatch) -> None:
    run.samples += len(batch)
    run.errors += int(batch.metrics.get("rollout/num_errors", 0))
    run.scores.append(float(batch.scores.mean()))


async def mode_sync(
    client: TrainerClient, rewards: RewardClient, trainer: Trainer, steps: list[list[PromptSpec]], n: int, mbs: int
) -> None:
    """(a): Generate without reward, ScoreBatch everything, GRPO advantages, train, sync."""
    truth = {s.group_id: s for prompts in steps for s in prompts}
    for prompts in steps:
        t0 = time.perf_counter()
        batch = await client.generate_batch(prompts, n, reward="")
        trainer.run.gen_s.append(time.perf_counter() - t0)
        protos = [to_sample(s, truth[s.group_id]) for s in batch.samples]
        t1 = time.perf_counter()
        results = {r.sample_id: r for r in await rewards.score_batch(protos, PIPELINE)}
        trainer.run.exposed_s.append(time.perf_counter() - t1)
        for s in batch.samples:
            r = results[s.sample_id]
            s.error = r.error.message if r.HasField("error") else ""
            s.score, s.extras = (0.0, {}) if s.error else (r.score, dict(r.extras))
        groups: dict[str, list[ScoredSample]] = collections.defaultdict(list)
        for s in batch.samples:
            groups[s.group_id].append(s)
        for group in groups.values():
            set_group_advantages(group, normalize_std=client.normalize_adv_std)
        scored = assemble_batch(batch.samples, pad_token_id=client.pad_token_id, metrics=batch.metrics)
        scored.metrics["rollout/num_errors"] = float(sum(1 for s in batch.samples if s.error))
        note(trainer.run, scored)
        for mb in split_minibatches(scored, mbs, client.pad_token_id):
            await trainer.train(mb)
        await trainer.sync()


def to_sample(s: ScoredSample, spec: PromptSpec) -> common_pb2.Sample:
    """The proto a rollout server would have sent to the reward service for this sample."""
    return common_pb2.Sample(
        sample_id=s.sample_id,
        group_id=s.group_id,
        prompt_ids=ids_tensor(s.prompt_ids.tolist()),
        response_ids=ids_tensor(s.response_ids.tolist()),
        response_mask=ids_tensor(s.response_mask.tolist()),
        response_text=s.response_text,
        data_source=spec.data_source,
        ground_truth=spec.ground_truth,
        policy_version=s.policy_version,
    )


async def mode_streaming(
    client: TrainerClient, trainer: Trainer, steps: list[list[PromptSpec]], n: int, mbs: int
) -> None:
    """(b): generate_batch with the reward streamed per sample, then train, then sync."""
    for prompts in steps:
        batch = await client.generate_batch(prompts, n, reward=PIPELINE)
        exposed = batch.metrics["timing_s/reward_exposed"]
        trainer.run.gen_s.append(batch.metrics["timing_s/gen"] - exposed)
        trainer.run.exposed_s.append(exposed)
        note(trainer.run, batch)
        for mb in split_minibatches(batch, mbs, client.pad_token_id):
            await trainer.train(mb)
        await trainer.sync()


async def mode_pipelined(
    client: TrainerClient,
    trainer: Trainer,
    steps: list[list[PromptSpec]],
    n: int,
    mbs: int,
    *,
    off_policy: int = 1,
) -> None:
    """(c): stream_minibatches per step, train on each as it arrives, the next step's rollouts already running.

    The window is batches()'s: off_policy + 1 steps in flight; step k+off_policy+1 is launched when step k's
    weights are synced. Groups made by a policy older than policy_version - off_policy are dropped.
    """
    per_step = len(steps[0]) * n
    size = max(n, per_step // max(1, mbs))
    it = iter(steps)
    in_flight: collections.deque[tuple[asyncio.Queue[RolloutBatch | None], asyncio.Task[None]]] = collections.deque()

    async def pump(prompts: list[PromptSpec], out: asyncio.Queue[RolloutBatch | None]) -> None:
        try:
            async for mb in client.stream_minibatches(prompts, n, minibatch_size=size, reward=PIPELINE):
                out.put_nowait(mb)
        finally:
            out.put_nowait(None)

    def launch() -> None:
        prompts = next(it, None)
        if prompts is not None:
            queue: asyncio.Queue[RolloutBatch | None] = asyncio.Queue()
            in_flight.append((queue, asyncio.create_task(pump(prompts, queue))))

    try:
        while len(in_flight) < off_policy + 1:
            before = len(in_flight)
            launch()
            if len(in_flight) == before:
                break
        while in_flight:
            queue, task = in_flight.popleft()
            scores: list[float] = []
            last: RolloutBatch | None = None
            while (mb := await queue.get()) is not None:
                fresh = drop_stale(mb, client.policy_version - off_policy, client.pad_token_id, trainer.run)
                if fresh is not None:
                    scores.append(float(fresh.scores.mean()))
                    trainer.run.samples += len(fresh)
                    trainer.run.errors += int(fresh.metrics.get("rollout/num_errors", 0))
                    await trainer.train(fresh)
                last = mb
            await task
            if last is not None:  # the step's last mini-batch saw all of its samples
                exposed = last.metrics["timing_s/reward_exposed"]
                trainer.run.gen_s.append(last.metrics["timing_s/gen"] - exposed)
                trainer.run.exposed_s.append(exposed)
            trainer.run.scores.append(statistics.fmean(scores) if scores else float("nan"))
            await trainer.sync()
            launch()
    finally:
        for _, task in in_flight:
            task.cancel()


def drop_stale(mb: RolloutBatch, oldest: int, pad: int, run: ModeRun) -> RolloutBatch | None:
    stale = {s.group_id for s in mb.samples if s.policy_version < oldest}
    run.max_staleness = max(run.max_staleness, *(oldest + 1 - s.policy_version for s in mb.samples))
    if not stale:
        return mb
    kept = [s for s in mb.samples if s.group_id not in stale]
    run.dropped_stale += len(mb.samples) - len(kept)
    return assemble_batch(kept, pad_token_id=pad, metrics=mb.metrics) if kept else None


async def run_mode(
    mode: str,
    addresses: list[str],
    reward_address: str,
    policy: str,
    args: argparse.Namespace,
    steps: list[list[PromptSpec]],
    sampling: Sampling,
    pad: int,
) -> ModeRun:
    async with TrainerClient(addresses, sampling=sampling, pad_token_id=pad) as client:
        run = ModeRun(mode, [], 0.0)
        trainer = Trainer(policy, args.lr, args.seed, client, run)
        await client.update_weights(trainer.learner.state_dict())  # every mode starts from the same weights
        run.started = time.perf_counter()
        if mode == "a":
            async with RewardClient([reward_address]) as rewards:
                await mode_sync(client, rewards, trainer, steps, args.n, args.minibatches)
        elif mode == "b":
            await mode_streaming(client, trainer, steps, args.n, args.minibatches)
        else:
            await mode_pipelined(client, trainer, steps, args.n, args.minibatches)
        return run


def prompt_steps(tokenizer: Any, args: argparse.Namespace, tag: str) -> list[list[PromptSpec]]:
    rng = random.Random(args.seed)
    out = []
    for k in range(args.steps):
        prompts = addition_prompts(tokenizer, args.prompts, rng)
        for i, p in enumerate(prompts):
            p.group_id = f"{tag}-s{k}-{i}"
        out.append(prompts)
    return out


async def calibrate(addresses: list[str], prompts: list[PromptSpec], n: int, sampling: Sampling) -> tuple[float, float]:
    """Mean generation time of one sample and the generation time of a step, without rewards (median of 3)."""
    unit: list[float] = []
    gen: list[float] = []
    async with TrainerClient(addresses, sampling=sampling) as client:
        await client.generate_batch(prompts[:2], 2)
        for _ in range(3):
            batch = await client.generate_batch(prompts, n)
            unit.append(batch.metrics["timing_s/agent_loop/generate_sequences/mean"])
            gen.append(batch.metrics["timing_s/gen"])
    return median(unit), median(gen)


async def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    _, policy, tokenizer = tiny_policy(args.models)
    pad = tokenizer.pad_token_id or 0
    sampling = StopSampling(temperature=1.0, max_tokens=args.max_tokens)
    sampling.stop_token_ids = stop_token_ids(tokenizer, args.stop_tokens)
    dist = LatencyDist.parse(args.latency)
    per_step = args.prompts * args.n
    max_batch = 2 * per_step  # two steps in flight under (c)
    runs: dict[str, list[ModeRun]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="rewardmesh-bench-") as tmp:
        async with local_mesh(
            policy,
            None,
            rollout_servers=args.rollout_servers,
            max_num_seqs=max_batch,
            batch_wait_ms=args.batch_wait_ms,
        ) as mesh:
            addresses = mesh.rollout_addresses
            calib_prompts = prompt_steps(tokenizer, args, "calib")[0]
            progress(f"calibrating: {args.prompts} prompts x {args.n} samples over {len(addresses)} rollout servers")
            unit, gen = await calibrate(addresses, calib_prompts, args.n, sampling)
            expected = per_step * dist.mean * unit
            slots = args.concurrency or max(1, round(expected / gen))
            spec = write_judge(Path(tmp), dist, unit, args.seed)
            mesh.reward.engine.add_from_config({PIPELINE: judge_pipeline(spec, slots)})
            reward_desc = (
                f"simulated judge: latency {dist} x {unit:.3f}s (mean {dist.mean * unit:.3f}s), C={slots} calls in "
                f"flight (expected reward work {expected:.1f}s / step generation {gen:.2f}s)"
            )
            progress(f"calibration: mean generation time of one sample {unit:.3f}s, step generation {gen:.3f}s")
            progress(f"reward: {reward_desc}")
            for rnd in range(args.rounds):
                order = "abc"[rnd % 3 :] + "abc"[: rnd % 3]
                for mode in order:
                    steps = prompt_steps(tokenizer, args, f"r{rnd}{mode}")
                    r = await run_mode(mode, addresses, mesh.reward.address, policy, args, steps, sampling, pad)
                    runs[mode].append(r)
                    progress(
                        f"round {rnd + 1}/{args.rounds} {MODES[mode]}: step {r.steady_step_s:.2f}s "
                        f"(wall {r.wall_s:.1f}s for {args.steps} steps; per step: generation "
                        f"{statistics.fmean(r.gen_s):.2f}s, reward after it {statistics.fmean(r.exposed_s):.2f}s, "
                        f"train {r.train_s / args.steps:.2f}s, sync {r.sync_s / args.steps:.2f}s)"
                    )
    wall = time.perf_counter() - started
    print(report(args, runs, unit, gen, reward_desc, wall))
    return 0


def report(
    args: argparse.Namespace, runs: dict[str, list[ModeRun]], unit: float, gen: float, reward_desc: str, wall: float
) -> str:
    step = {m: median([r.steady_step_s for r in rs]) for m, rs in runs.items()}
    config = {
        "mesh": f"in-process: 1 reward server + {args.rollout_servers} hf rollout servers (tiny policy, 1 decode "
        f"thread each, batch_wait_ms {args.batch_wait_ms:g})",
        "task": f"single-digit additions, {args.prompts} prompts x n={args.n} = {args.prompts * args.n} samples/step, "
        f"max_tokens {args.max_tokens}, {args.stop_tokens} extra stop tokens",
        "training": f"GRPOLearner (reference GRPO, lr {args.lr:g}) in a worker thread, {args.minibatches} mini-batches "
        "per step, weights synced to every rollout server after each step",
        "calibration": f"mean generation time of one sample {unit:.3f}s, step generation {gen:.3f}s",
        "reward": reward_desc,
        "measurement": f"{args.steps} steps per mode, {args.rounds} rounds (order rotates); step time = interval "
        "between weight syncs after the first step, median over rounds",
        "wall time": f"{wall:.0f}s",
    }
    rows = []
    for m, label in MODES.items():
        rs = runs[m]
        rows.append(
            [
                label,
                f"{step[m]:.3f}",
                f"{median([statistics.fmean(r.gen_s) for r in rs]):.3f}",
                f"{median([statistics.fmean(r.exposed_s) for r in rs]):.3f}",
                f"{median([r.train_s / args.steps for r in rs]):.3f}",
                f"{median([r.sync_s / args.steps for r in rs]):.3f}",
                f"{median([statistics.fmean(r.scores) for r in rs]):.3f}",
                f"{sum(r.samples for r in rs)}",
                f"{sum(r.errors for r in rs)}",
                f"{sum(r.dropped_stale for r in rs)} / {max(r.max_staleness for r in rs)}",
            ]
        )
    ratios = [
        ["(a)/(b): streaming rewards", f"{step['a'] / step['b']:.2f}x"],
        ["(b)/(c): + mini-batch pipeline + 1-step off-policy", f"{step['b'] / step['c']:.2f}x"],
        ["(a)/(c): all together", f"{step['a'] / step['c']:.2f}x"],
        ["ordering (a) > (b) > (c)", verdict(step["a"] > step["b"] > step["c"])],
    ]
    return "\n\n".join(
        [
            "## bench.pipeline",
            machine_table(config),
            markdown_table(
                [
                    "mode",
                    "step s (median)",
                    "generation s",
                    "reward after generation s",
                    "train s",
                    "weight sync s",
                    "mean score",
                    "samples",
                    "errors",
                    "dropped stale / max staleness",
                ],
                rows,
            ),
            "Per-step columns are means. In (c) a step's generation is timed from its launch, while the previous "
            "step still generates and trains, so its columns overlap and do not add up to the step time.",
            markdown_table(["ratio", "value"], ratios),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.steps, args.rounds, args.prompts, args.n, args.minibatches) < 1 or args.steps < 2:
        raise SystemExit("--steps must be >= 2; --rounds, --prompts, --n, --minibatches >= 1")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())

"""`rewardmesh demo`: RL post-training end to end on the mesh, on a CPU, in a few minutes.

One reward server and two rollout servers (hf backend) start in-process on 127.0.0.1 (or the
flags point at real ones); a minimal GRPO loop trains the tiny policy to continue a count ("4 5 6" -> "7")
with one token (or, `--task addition`, to answer single-digit additions), scored by a rule, syncing weights
to every rollout server after each step.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from rewardmesh.client.batch import RolloutBatch
from rewardmesh.client.grpo import GRPOLearner, PolicyLossConfig
from rewardmesh.client.trainer import PromptSpec, Sampling, TrainerClient
from rewardmesh.demo.mesh import local_mesh
from rewardmesh.demo.tiny_models import build_tiny_models
from rewardmesh.server.reward.server import load_tokenizer

COLUMNS = ("step", "score", "acc", "step_s", "gen_s", "rw_hidden", "rw_exposed", "slow_gen", "slow_rw", "stale")


def addition_prompts(tokenizer: Any, count: int, rng: random.Random) -> list[PromptSpec]:
    """ "7+5=" -> "12": the answer depends on two earlier tokens, so the policy must learn to attend back."""
    out = []
    for _ in range(count):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        out.append(PromptSpec(token_ids=tokenizer.encode(f"{a}+{b}="), ground_truth=str(a + b), data_source="addition"))
    return out


def count_prompts(tokenizer: Any, count: int, rng: random.Random) -> list[PromptSpec]:
    """ "4 5 6" -> "7": continue the count (answers 3..18, each one token); the answer follows the last token."""
    out = []
    for _ in range(count):
        a = rng.randint(0, 15)
        text = f"{a} {a + 1} {a + 2}"
        out.append(PromptSpec(token_ids=tokenizer.encode(text), ground_truth=str(a + 3), data_source="count"))
    return out


TASKS = {"count": count_prompts, "addition": addition_prompts}


def row(step: int, batch: RolloutBatch, step_s: float) -> dict[str, float]:
    m = batch.metrics
    return {
        "step": step,
        "score": m["critic/score/mean"],
        "acc": m.get("reward_extra/acc/mean", float("nan")),
        "step_s": step_s,
        "gen_s": m["timing_s/gen"],
        "rw_hidden": m["timing_s/reward_hidden"],
        "rw_exposed": m["timing_s/reward_exposed"],
        "slow_gen": m["timing_s/agent_loop/slowest/generate_sequences"],
        "slow_rw": m["timing_s/agent_loop/slowest/reward"],
        "stale": m.get("off_policy/max_staleness", 0.0),
    }


def summary(history: list[dict[str, float]], wall_s: float) -> str:
    """The line a user reads: elapsed time, steps/s, and first-k vs last-k mean score and accuracy (k <= 10)."""
    if not history:
        return f"0 steps in {wall_s:.1f}s"
    scores, accs = [h["score"] for h in history], [h["acc"] for h in history]
    k = min(10, len(scores) // 2) or 1
    first, final = statistics.fmean(scores[:k]), statistics.fmean(scores[-k:])
    acc_first, acc_final = statistics.fmean(accs[:k]), statistics.fmean(accs[-k:])
    return (f"{len(history)} steps in {wall_s:.1f}s ({len(history) / max(wall_s, 1e-9):.2f} steps/s); "
            f"mean score first {k} steps {first:.3f} -> last {k} steps {final:.3f}; "
            f"accuracy first {k} steps {acc_first:.3f} -> last {k} steps {acc_final:.3f}")  # fmt: skip


def plot(history: list[dict[str, float]], path: Path, task: str = "count") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = range(1, len(history) + 1)
    ax.plot(steps, [h["score"] for h in history], marker=".", label="mean score")
    ax.plot(steps, [h["acc"] for h in history], marker=".", label="accuracy")
    ax.legend(loc="lower right")
    ax.set_xlabel("step")
    ax.set_title(f"rewardmesh demo: GRPO on the {task} task")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


async def run_demo(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per model load would drown the step table
    models = build_tiny_models(args.models)
    policy = str(args.model or models.policy)
    tokenizer = load_tokenizer(policy)
    rng = random.Random(args.seed)
    learner = GRPOLearner(
        policy,
        lr=args.lr,
        seed=args.seed,
        temperature=args.temperature,
        loss=PolicyLossConfig(
            clip_ratio_low=args.clip_ratio_low, clip_ratio_high=args.clip_ratio_high, tis_imp_ratio_cap=args.tis_cap
        ),
        betas=(0.9, args.beta2),
        ppo_epochs=args.ppo_epochs,
        ppo_mini_batches=args.ppo_mini_batches,
        entropy_coeff=args.entropy_coeff,
        total_steps=args.steps,
        min_lr_ratio=args.min_lr_ratio,
        require_rollout_log_probs=args.off_policy_steps > 0,  # the correction is never silently skipped
    )

    def steps() -> Iterator[list[PromptSpec]]:
        for _ in range(args.steps):
            yield TASKS[args.task](tokenizer, args.prompts_per_step, rng)

    servers = args.rollout_servers or (1 if args.backend == "vllm" else 2)
    mesh: Any = (
        contextlib.nullcontext()
        if args.rollout_target
        else local_mesh(policy, rollout_servers=servers, max_num_seqs=args.max_num_seqs, backend_name=args.backend)
    )
    history: list[dict[str, float]] = []
    started = time.perf_counter()
    async with mesh as local:
        targets = local.rollout_addresses if local is not None else args.rollout_target.split(",")
        sampling = Sampling(temperature=args.temperature, max_tokens=1)
        async with TrainerClient(targets, reward=args.reward, sampling=sampling, normalize_adv_std=args.norm_adv_by_std,
                                 pad_token_id=tokenizer.pad_token_id or 0) as client:  # fmt: skip
            resolved = await client.pool.wait_for_members()  # dns:/// targets: the addresses they resolve to
            print(f"rollout servers: {', '.join(t.address for t in resolved)}; reward pipeline '{args.reward}'")
            print("  ".join(f"{c:>10}" for c in COLUMNS))
            last = time.perf_counter()
            bar = tqdm(total=args.steps, desc="training", unit="step", leave=False)
            step = 0
            async for batch in client.batches(steps(), n=args.n, off_policy_steps=args.off_policy_steps):
                step += 1
                t_learn = time.perf_counter()
                stats = await asyncio.to_thread(learner.step, batch)  # servers keep generating meanwhile
                stats["timing_s/update_actor"] = time.perf_counter() - t_learn
                await client.update_weights(learner.state_dict())
                now = time.perf_counter()
                r = row(step, batch, now - last)
                last = now
                history.append({**r, **stats})
                bar.update(1)
                tqdm.write("  ".join(f"{r[c]:>10.3f}" if c != "step" else f"{int(r[c]):>10d}" for c in COLUMNS))
            bar.close()
    wall = time.perf_counter() - started
    print("\n" + summary(history, wall))
    if args.plot:
        plot(history, args.plot, args.task)
        print(f"score curve: {args.plot}")
    if args.metrics_out:
        args.metrics_out.write_text(json.dumps(history, indent=1))
    memory = getattr(args, "trace_memory", None)
    if memory is not None:
        print(f"spans: {args.trace_out}")
        print(slowest_sample_tree(list(memory.get_finished_spans())))
    return 0


def slowest_sample_tree(spans: list[Any]) -> str:
    """The last step's slowest sample as an indented span tree with durations, from its step span's event."""
    steps = [s for s in spans if s.name == "trainer.step" and s.events]
    if not steps:
        return "no traced step"
    step = max(steps, key=lambda s: s.end_time or 0)
    event = next(e for e in step.events if e.name == "slowest_sample")
    span_id = event.attributes.get("span_id")
    children: dict[int, list[Any]] = {}
    for s in spans:
        if s.parent is not None:
            children.setdefault(s.parent.span_id, []).append(s)
    root = next((s for s in spans if f"{s.context.span_id:016x}" == span_id), None)
    if root is None:
        return f"slowest sample {event.attributes.get('rewardmesh.sample_id')}: its spans were not recorded"
    lines = [f"slowest sample of step {step.attributes.get('rewardmesh.step')}: "
             f"{event.attributes.get('rewardmesh.sample_id')} (trace {event.attributes.get('trace_id')})"]  # fmt: skip

    def walk(span: Any, depth: int) -> None:
        ms = (span.end_time - span.start_time) / 1e6
        lines.append(f"{'  ' * depth}{span.name:<{28 - 2 * depth}} {ms:9.2f} ms")
        for child in sorted(children.get(span.context.span_id, []), key=lambda c: c.start_time):
            walk(child, depth + 1)

    walk(root, 1)
    return "\n".join(lines)

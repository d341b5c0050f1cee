"""`rewardmesh reward-demo`: the reward service alone, end to end in one process on 127.0.0.1.

A real reward server (a GSM8K rule plus the tiny reward model, weighted) and a real client stream a
few hundred GSM8K-style samples through `Score`, as a rollout server would the moment each sample
finishes, and report scores, per-sample reward latency and the batch sizes the batcher formed.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass

from tqdm import tqdm

from rewardmesh.client.reward_client import RewardClient
from rewardmesh.common.tensors import ids_tensor
from rewardmesh.demo.tiny_models import build_tiny_models
from rewardmesh.reward_engine.engine import RewardEngine
from rewardmesh.server.reward.server import RewardServer, load_tokenizer
from rewardmesh.server.serving import ServerOptions
from rewardmesh.v1 import common_pb2, reward_pb2

NAMES = ["Janet", "Tom", "Aisha", "Mateo", "Li", "Priya", "Olu", "Sven"]
ITEMS = ["apples", "marbles", "books", "coins", "stamps", "shells"]


@dataclass
class DemoSample:
    question: str
    answer: int
    response: str
    kind: str  # correct | wrong | unformatted


def make_samples(n: int, seed: int) -> list[DemoSample]:
    """GSM8K-shaped word problems with responses of varying length and quality."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, c = rng.randint(2, 40), rng.randint(2, 40), rng.randint(1, 9)
        who, what = rng.choice(NAMES), rng.choice(ITEMS)
        answer = (a + b) * c
        question = f"{who} has {a} {what} and finds {b} more. Each is worth {c} dollars. How many dollars in all?"
        steps = [f"{who} has {a} + {b} = {a + b} {what}.", f"Each is worth {c}, so {a + b} * {c} = {answer}."]
        steps += ["Let me double-check the arithmetic step by step."] * rng.randint(0, 6)
        kind = rng.choices(["correct", "wrong", "unformatted"], weights=[6, 3, 1])[0]
        final = answer if kind != "wrong" else answer + rng.randint(1, 9)
        tail = f"#### {final}" if kind != "unformatted" else f"The answer is {final}."
        out.append(DemoSample(question, answer, " ".join([*steps, tail]), kind))
    return out


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run_reward_demo(args: argparse.Namespace) -> int:
    print(f"building tiny models in {args.models} (no download) ...")
    models = build_tiny_models(args.models)
    tokenizer = load_tokenizer(str(models.policy))
    engine = RewardEngine()
    engine.add_from_config(
        {
            "gsm8k_rm": {
                "description": "GSM8K strict rule plus 0.1 x the tiny reward model",
                "batching": {"max_batch_size": 32, "max_queue_delay_ms": 5},
                "sources": [
                    {"type": "rule", "name": "gsm8k", "rule": "gsm8k", "weight": 1.0},
                    {"type": "model", "name": "rm", "path": str(models.reward_model), "weight": 0.1},
                ],
            }
        }
    )
    engine.add_builtin_rules()
    server = RewardServer(engine, ServerOptions(host="127.0.0.1", port=0))
    await server.start()
    print(f"reward server on {server.address}; pipelines: {', '.join(sorted(engine.pipelines))}")

    samples = make_samples(args.samples, args.seed)
    protos = [
        common_pb2.Sample(
            sample_id=f"s{i}",
            group_id=f"g{i // 4}",
            prompt_ids=ids_tensor(tokenizer.encode(s.question)),
            response_ids=ids_tensor(tokenizer.encode(s.response)),
            prompt_text=s.question,
            response_text=s.response,
            data_source="openai/gsm8k",
            ground_truth=str(s.answer),
        )
        for i, s in enumerate(samples)
    ]
    latencies: dict[str, float] = {}
    results: list[reward_pb2.RewardResult] = []
    start = time.perf_counter()
    async with RewardClient([server.address]) as client:
        # Samples arrive one by one, as generation would finish them, not as one batch.
        sent: dict[str, float] = {}
        futures = []
        for p in protos:
            sent[p.sample_id] = time.perf_counter()
            futures.append(client.submit(p, "gsm8k_rm"))
            await asyncio.sleep(random.Random(p.sample_id).uniform(0, 0.004))
        for fut in tqdm(asyncio.as_completed(futures), total=len(futures), desc="scoring", unit="sample"):
            r = await fut
            latencies[r.sample_id] = time.perf_counter() - sent[r.sample_id]
            results.append(r)
    wall = time.perf_counter() - start
    await server.stop(grace=1)

    ok = [r for r in results if not r.HasField("error")]
    by_kind = {f"s{i}": s.kind for i, s in enumerate(samples)}
    lat_ms = [v * 1000 for v in latencies.values()]
    sizes = Counter(r.batch_size for r in ok)
    print()
    print(
        f"scored {len(ok)}/{len(results)} samples in {wall:.2f}s ({len(results) / wall:.0f} samples/s), "
        f"{len(results) - len(ok)} errors"
    )
    for kind in ("correct", "wrong", "unformatted"):
        group = [r for r in ok if by_kind[r.sample_id] == kind]
        if group:
            print(
                f"  {kind:<12} n={len(group):<4} mean score {statistics.fmean(r.score for r in group):+.3f}  "
                f"gsm8k acc {statistics.fmean(r.extras['gsm8k/acc'] for r in group):.2f}"
            )
    print(
        f"reward latency per sample (ms): p50 {_pct(lat_ms, 0.5):.1f}  p95 {_pct(lat_ms, 0.95):.1f}  "
        f"max {max(lat_ms):.1f}"
    )
    print(
        f"server side (ms): queue mean {statistics.fmean(r.timing.queue for r in ok) * 1000:.1f}  "
        f"compute mean {statistics.fmean(r.timing.compute for r in ok) * 1000:.1f}"
    )
    hist = ", ".join(f"{size}x{count}" for size, count in sorted(sizes.items()))
    print(f"batch sizes (size x samples): {hist}")
    return 0 if len(ok) == len(results) else 1

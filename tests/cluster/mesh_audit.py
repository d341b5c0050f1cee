"""Runs inside a pod of the live node (a Job the cluster tests create): rollouts through the mesh, step by step,
with an account of every sample the trainer receives.

One JSON line per step: how many samples came back, how many distinct sample ids, how many failed (and why), and
which rollout pods served them; then a last line {"done": true, ...}. The tests read the Job's log and assert on
it (no sample missing, none twice, none failed), so this is the trainer's view of the mesh while pods go away.
It uses the project's TrainerClient against the same dns:/// names as the trainer Job.

    python mesh_audit.py --target dns:///rollout.NS.svc.cluster.local:50061 --steps 40 [--until-file /tmp/stop]

With --until-file it goes on past --steps until that file exists (the test creates it with kubectl exec once the
pods it disturbed are back), so the disturbance falls inside the run however slow the machine is.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from rewardmesh.client.trainer import PromptSpec, Sampling, TrainerClient


def prompts(count: int, rng: random.Random) -> list[PromptSpec]:
    """Token-id prompts (no tokenizer needed): what is scored does not matter here, only that it is."""
    return [
        PromptSpec(token_ids=[rng.randint(5, 200) for _ in range(4)], ground_truth=str(rng.randint(0, 9)))
        for _ in range(count)
    ]


async def audit(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)

    def steps() -> Iterator[list[PromptSpec]]:
        count = 0
        while count < args.steps or (args.until_file is not None and not args.until_file.exists()):
            count += 1
            yield prompts(args.prompts, rng)

    sampling = Sampling(temperature=1.0, max_tokens=args.max_tokens)
    totals: Counter[str] = Counter()
    started = time.monotonic()
    async with TrainerClient(args.target, reward=args.reward, sampling=sampling) as client:
        step = 0
        async for batch in client.batches(steps(), n=args.n, off_policy_steps=0):
            step += 1
            failed = Counter(s.error_name for s in batch.samples if s.failed)
            line = {
                "step": step,
                "expected": args.prompts * args.n,
                "samples": len(batch.sample_ids),
                "groups": len(set(batch.group_ids)),
                "unique": len(set(batch.sample_ids)),
                "failed": sum(failed.values()),
                "failed_by": dict(failed),
                "t": round(time.monotonic() - started, 1),
            }
            totals.update(samples=line["samples"], failed=line["failed"])
            print(json.dumps(line), flush=True)
        print(
            json.dumps(
                {
                    "done": True,
                    "steps": step,
                    **totals,
                    "resent": client.resent_samples,
                    "behind": client.behind_samples,
                }
            ),
            flush=True,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", required=True)
    parser.add_argument("--reward", default="first_number")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", dest="max_tokens", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--until-file", dest="until_file", type=Path, help="after --steps, go on until it exists")
    return asyncio.run(audit(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())

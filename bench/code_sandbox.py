"""The code sandbox's cost and what streaming buys for code rewards.

    python -m bench.code_sandbox [--executions 48 --samples 256 --tests 2 --generation-s 30]

Part 1, executions: the same programs (the shipped test set's canonical Python stdin/stdout solutions with their
inputs) run (a) bare with subprocess.run (no isolation), (b) one sandbox start per execution, (c) one sandbox
start per 16 executions (a sample's tests batched), first one at a time (per-execution latency; the overhead is
its difference from bare), then with as many at once as the pool has workers (executions per second).

Part 2, a step of --samples code samples whose programs have long-tailed run times (CPU-bound, lognormal, capped
at 1 s) and whose generation finishes spread over --generation-s seconds (also long-tailed): (a) every sample
scored by the code pipeline the moment it finishes (streaming, as the mesh does), (b) all scored after the last
one is generated. Reported: the step's time from the first generation to the last score, and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench.common import markdown_table, progress
from bench.mesh import machine_table
from rewardmesh.demo.code_problems import PROBLEMS
from rewardmesh.reward_engine.engine import RewardEngine
from rewardmesh.reward_engine.sandbox.executor import Job, Sandbox
from rewardmesh.reward_engine.sandbox.grading import plan
from rewardmesh.reward_engine.types import RewardInput

BATCH = 16


def _programs() -> list[tuple[str, str]]:
    """(program, stdin) pairs of the shipped stdio Python problems."""
    pairs = []
    for p in PROBLEMS:
        if p.form == "stdio" and p.language == "python":
            pl = plan(p.canonical, p.ground_truth)
            pairs += [(pl.program, s) for s in pl.stdins]
    return pairs


def _bare(python: str, program: str, stdin: str) -> float:
    with tempfile.TemporaryDirectory() as work:
        Path(work, "main.py").write_text(program)
        start = time.perf_counter()
        done = subprocess.run(
            [python, "-I", "main.py"], input=stdin.encode(), cwd=work, capture_output=True, timeout=30
        )
        elapsed = time.perf_counter() - start
    assert done.returncode == 0, done.stderr
    return elapsed


async def _sandboxed(sandbox: Sandbox, program: str, stdins: list[str]) -> float:
    start = time.perf_counter()
    result = await sandbox.run(Job({"main.py": program}, [sandbox.python, "-I", "main.py"], stdins))
    elapsed = time.perf_counter() - start
    assert all(r.status == "exited" and r.exit_code == 0 for r in result.runs), result.runs
    return elapsed


async def executions(n: int) -> list[list[object]]:
    sandbox = Sandbox()
    await sandbox.start()
    workers = sandbox.workers
    pairs = _programs()
    work = [pairs[i % len(pairs)] for i in range(n)]
    python = sandbox.python
    rows: list[list[object]] = []

    progress(f"part 1: {n} executions each way, one at a time, then {workers} at once")
    bare_lat = statistics.median(_bare(python, prog, stdin) for prog, stdin in work)
    one_lat = statistics.median([await _sandboxed(sandbox, prog, [stdin]) for prog, stdin in work])
    batched = [await _sandboxed(sandbox, work[0][0], [work[0][1]] * BATCH) for _ in range(max(1, n // BATCH))]
    batch_lat = statistics.median(batched) / BATCH

    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda w: _bare(python, *w), work))
    bare_rate = n / (time.perf_counter() - start)
    start = time.perf_counter()
    await asyncio.gather(*(_sandboxed(sandbox, prog, [stdin]) for prog, stdin in work))
    one_rate = n / (time.perf_counter() - start)
    start = time.perf_counter()
    chunks = max(1, n // BATCH)
    await asyncio.gather(*(_sandboxed(sandbox, work[0][0], [work[0][1]] * BATCH) for _ in range(chunks)))
    batch_rate = chunks * BATCH / (time.perf_counter() - start)

    level = sandbox.level.name if sandbox.level else "?"
    rows.append(["bare subprocess.run", f"{bare_lat * 1e3:.1f}", "-", f"{bare_rate:.1f}", "1.00"])
    rows.append(
        [
            f"{level}, 1 execution per start",
            f"{one_lat * 1e3:.1f}",
            f"{(one_lat - bare_lat) * 1e3:.1f}",
            f"{one_rate:.1f}",
            f"{one_rate / bare_rate:.2f}",
        ]
    )
    rows.append(
        [
            f"{level}, {BATCH} executions per start",
            f"{batch_lat * 1e3:.1f}",
            f"{(batch_lat - bare_lat) * 1e3:.1f}",
            f"{batch_rate:.1f}",
            f"{batch_rate / bare_rate:.2f}",
        ]
    )
    return rows


_BURN = (
    "import time, sys\nd = float(sys.stdin.readline())\nend = time.process_time() + d\n"
    "while time.process_time() < end:\n    pass\nprint('ok')"
)


def _step_samples(n: int, tests: int, generation_s: float, seed: int) -> list[tuple[float, RewardInput]]:
    rng = random.Random(seed)
    empty = np.zeros(0, np.int32)
    out = []
    for i in range(n):
        run_s = min(1.0, rng.lognormvariate(np.log(0.01), 1.3))
        finish = min(generation_s, generation_s * rng.betavariate(2.0, 1.2))
        truth = json.dumps({"inputs": [f"{run_s / tests:.4f}\n"] * tests, "outputs": ["ok\n"] * tests})
        response = f"```python\n{_BURN}\n```"
        out.append((finish, RewardInput(f"s{i}", empty, empty, response_text=response, ground_truth=truth)))
    out.sort(key=lambda x: x[0])
    return out


async def step(n: int, tests: int, generation_s: float, seed: int) -> tuple[float, float]:
    engine = RewardEngine()
    engine.add_builtin_rules()
    pipeline = engine.get("code")
    await pipeline.warmup()
    work = _step_samples(n, tests, generation_s, seed)

    async def streaming() -> float:
        start = time.perf_counter()

        async def one(at: float, inp: RewardInput) -> None:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            scored = await pipeline.score(inp)
            assert scored.output.score == 1.0, scored

        await asyncio.gather(*(one(at, inp) for at, inp in work))
        return time.perf_counter() - start

    async def after() -> float:
        start = time.perf_counter()
        await asyncio.sleep(work[-1][0])
        results = await asyncio.gather(*(pipeline.score(inp) for _, inp in work))
        assert all(r.output.score == 1.0 for r in results)
        return time.perf_counter() - start

    progress(f"part 2: a step of {n} samples, generation over {generation_s:g}s, streaming then after generation")
    streamed = await streaming()
    batched = await after()
    await engine.close()
    return streamed, batched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--executions", type=int, default=48)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--tests", type=int, default=2)
    parser.add_argument("--generation-s", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = asyncio.run(executions(args.executions))
    streamed, after = asyncio.run(step(args.samples, args.tests, args.generation_s, args.seed))
    print(machine_table({"sandbox workers": len(os.sched_getaffinity(0))}))
    print()
    print(
        markdown_table(["mode", "latency per execution (ms)", "overhead vs bare (ms)", "executions/s", "vs bare"], rows)
    )
    print()
    print(
        markdown_table(
            ["step of code samples", "time (s)"],
            [
                [f"streaming ({args.samples} samples, {args.tests} tests each)", f"{streamed:.2f}"],
                ["after generation", f"{after:.2f}"],
                ["after / streaming", f"{after / streamed:.2f}"],
                ["generation alone", f"{args.generation_s:.2f}"],
            ],
        )
    )


if __name__ == "__main__":
    main()

"""Continuous batching in the hf backend: a stream of requests arriving over time vs the same requests at once.

    python -m bench.hf_backend [--requests 48 --min-tokens 16 --max-tokens 96 --window 0.5 --rounds 3 --threads 1]

Workload: R requests on the tiny policy (seeded sampling at temperature 1, so every mode generates the same
tokens), max_tokens drawn uniformly in [min, max] per request, so rows finish at different steps.
  (a) offline: all R requests submitted at once (one batch, max_num_seqs >= R): the throughput limit;
  (b) stream: the same requests arriving as a Poisson process spread over `--window` x (a)'s makespan, each
      joining the running batch at the next step boundary. (a)'s makespan is the median of every offline run so
      far (3 calibration runs, then each round's), so a slow or fast moment of a shared machine does not stretch
      or squeeze the window against the runs it is compared with.
  (c) ideal stream (computed): each request of (b) decodes from the instant it arrives at (a)'s mean step
      time; a stream spread over W steps needs about W more steps than (a), which bounds (b)/(a) below 1.
Throughput is generated tokens / (last finish - first arrival); latency is each request's finish - arrival.
Also printed: the most steps any request of (b) waited from its arrival to its first token (target <= 2).
Modes alternate over `--rounds`; medians are reported. Target: (b)/(a) throughput >= 0.8.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import machine_info, markdown_table, progress
from rewardmesh.demo.tiny_models import build_tiny_models
from rewardmesh.server.cli import default_models_dir
from rewardmesh.server.rollout.backends.base import GenerationRequest
from rewardmesh.server.rollout.backends.hf import HFBackend

TEXTS = [
    "What is 2 + 2?",
    "Tell me a short story about a cat.",
    "7 + 8 =",
    "The teacher checks the answer again and again, with care.",
    "Add 9 and 9, then explain.",
    "List three colours.",
]


@dataclass
class Run:
    seconds: float  # first arrival -> last finish
    tokens: int
    latencies: list[float]
    max_wait_steps: int
    steps: int
    lengths: list[int]  # tokens per request
    arrivals: list[float]

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds


def workload(backend: HFBackend, n: int, lo: int, hi: int, seed: int) -> list[GenerationRequest]:
    rng = random.Random(seed)
    return [
        GenerationRequest(
            prompt_ids=list(backend.tokenizer.encode(TEXTS[i % len(TEXTS)])),
            max_tokens=rng.randint(lo, hi),
            temperature=1.0,
            seed=seed * 1000 + i,
        )
        for i in range(n)
    ]


async def run(backend: HFBackend, requests: list[GenerationRequest], arrivals: list[float]) -> Run:
    """Submit request i at arrivals[i] seconds after the start; wait for all."""
    waits_before = len(backend.admission_waits)
    steps_before = backend.steps
    start = time.perf_counter()
    latencies: list[float] = [0.0] * len(requests)
    lengths: list[int] = [0] * len(requests)
    tokens = 0

    async def one(i: int) -> None:
        nonlocal tokens
        delay = start + arrivals[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        arrived = time.perf_counter()
        out = await backend.generate(requests[i])
        latencies[i] = time.perf_counter() - arrived
        lengths[i] = len(out.token_ids)
        tokens += len(out.token_ids)

    await asyncio.gather(*(one(i) for i in range(len(requests))))
    seconds = time.perf_counter() - start
    waits = list(backend.admission_waits)[waits_before:]
    return Run(seconds, tokens, latencies, max(waits, default=0), backend.steps - steps_before, lengths, list(arrivals))


def poisson(n: int, window: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    gaps = [rng.expovariate(1.0) for _ in range(n)]
    scale = window / sum(gaps[:-1]) if n > 1 else 0.0
    times, t = [], 0.0
    for g in gaps:
        times.append(t)
        t += g * scale
    return times


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def main_async(args: argparse.Namespace) -> int:
    models = build_tiny_models(args.models)
    backend = HFBackend(
        str(models.policy),
        device="cpu",
        max_num_seqs=max(args.requests, 1),
        num_threads=args.threads,
        batch_wait_ms=5,
    )
    await backend.start()
    try:
        requests = workload(backend, args.requests, args.min_tokens, args.max_tokens, seed=1)
        progress("warm-up and calibration")
        await run(backend, requests[:4], [0.0] * 4)
        at_once = [0.0] * len(requests)
        makespans = [(await run(backend, requests, at_once)).seconds for _ in range(3)]
        results: dict[str, list[Run]] = {"offline": [], "stream": []}
        for r in range(args.rounds):
            order = ["offline", "stream"] if r % 2 == 0 else ["stream", "offline"]
            for mode in order:
                progress(f"round {r + 1}/{args.rounds}: {mode}")
                if mode == "offline":
                    results[mode].append(await run(backend, requests, at_once))
                    makespans.append(results[mode][-1].seconds)
                else:
                    window = args.window * statistics.median(makespans)
                    results[mode].append(await run(backend, requests, poisson(len(requests), window, seed=2)))
    finally:
        await backend.close()

    def med(mode: str, f: str) -> float:
        runs = results[mode]
        if f == "throughput":
            return statistics.median(x.throughput for x in runs)
        if f == "seconds":
            return statistics.median(x.seconds for x in runs)
        q = 0.5 if f == "p50" else 0.99
        return statistics.median(pct(x.latencies, q) for x in runs)

    rows = []
    for mode, label in (("offline", "(a) offline: all at once"), ("stream", "(b) stream: Poisson arrivals")):
        rows.append(
            [label, f"{med(mode, 'seconds'):.2f}", f"{med(mode, 'throughput'):.0f}",
             f"{med(mode, 'p50'):.2f}", f"{med(mode, 'p99'):.2f}"]
        )  # fmt: skip
    # (c) ideal stream: every request starts decoding the instant it arrives, at the offline batch's mean
    # step time (the stream cannot beat that: a step costs about the same at any batch size here).
    ideal = []
    for off, stream in zip(results["offline"], results["stream"], strict=True):
        step = off.seconds / off.steps
        ideal.append(max(a + n * step for a, n in zip(stream.arrivals, stream.lengths, strict=True)))
    ideal_s = statistics.median(ideal)
    rows.append(["(c) ideal stream: each request decodes from its arrival at (a)'s step time",
                 f"{ideal_s:.2f}", f"{results['stream'][0].tokens / ideal_s:.0f}", "", ""])  # fmt: skip
    ratio = med("stream", "throughput") / med("offline", "throughput")
    to_ideal = statistics.median(i / x.seconds for i, x in zip(ideal, results["stream"], strict=True))
    max_wait = max(x.max_wait_steps for x in results["stream"])
    # (b)/(a) throughput = (a)'s steps / (b)'s steps x (b)'s time per step / (a)'s time per step, per round
    pairs = list(zip(results["offline"], results["stream"], strict=True))
    step_ratio = statistics.median(o.steps / s.steps for o, s in pairs)
    per_step = statistics.median((s.seconds / s.steps) / (o.seconds / o.steps) for o, s in pairs)
    info = machine_info()
    print(
        f"\n{args.requests} requests, max_tokens {args.min_tokens}-{args.max_tokens}, stream arrivals over "
        f"{args.window:g} x the offline makespan (median {args.window * statistics.median(makespans):.2f} s), "
        f"{args.rounds} rounds "
        f"alternating, medians; {info['cpu']}, {info['usable_cpus']} usable cores, torch {info['torch']}, "
        f"{args.threads} decode thread(s)\n"
    )
    print(markdown_table(["mode", "makespan (s)", "tokens/s", "p50 latency (s)", "p99 latency (s)"], rows))
    print()
    checks = [
        ["(b)/(a) throughput", ">= 0.8", f"{ratio:.2f}", "PASS" if ratio >= 0.8 else "FAIL"],
        ["  steps (a)/(b): set by the arrival spread", "", f"{step_ratio:.2f}", ""],
        ["  time per step (b)/(a): the engine's cost of rows joining and leaving", "", f"{per_step:.2f}", ""],
        ["(b) vs its ideal (c): makespan (c)/(b)", "", f"{to_ideal:.2f}", ""],
        ["steps from arrival to first token, max", "<= 2", str(max_wait), "PASS" if max_wait <= 2 else "FAIL"],
    ]
    print(markdown_table(["check", "target", "measured", "result"], checks))
    return 0 if ratio >= 0.8 and max_wait <= 2 else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--min-tokens", dest="min_tokens", type=int, default=16)
    p.add_argument("--max-tokens", dest="max_tokens", type=int, default=96)
    p.add_argument("--window", type=float, default=0.5, help="arrival window as a fraction of the offline makespan")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the decode thread (default 1)")
    p.add_argument("--models", type=Path, default=default_models_dir(), help="tiny models (built if missing)")
    return asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())

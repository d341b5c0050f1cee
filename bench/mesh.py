"""Helpers shared by the mesh benchmarks (reward_overlap, pipeline, tracing_overhead).

- a simulated remote judge: an async verl-style reward function written to a temp .py file and loaded by the
  `function` source type, sleeping a per-sample latency drawn from a configurable distribution,
- driving `Generate` streams directly (per-prompt sampling params, client-side arrival times),
- the C-slot FIFO reward-queue simulation used for the "ideal" overlap,
- the machine/config table.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import textwrap
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import machine_info, markdown_table
from rewardmesh.v1 import rollout_pb2, rollout_pb2_grpc

if TYPE_CHECKING:
    from rewardmesh.client.trainer import PromptSpec
    from rewardmesh.demo.tiny_models import TinyModelPaths

# ------------------------------------------------------------------------------------------ latency model


@dataclass(frozen=True)
class LatencyDist:
    """Per-sample judge latency in multiples of a unit (the mean generation time of one sample).

    `uniform:LO:HI` (default uniform:0.2:2.0), `lognormal:MEDIAN:SIGMA`, `exp:MEAN`, `fixed:X`.
    """

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> LatencyDist:
        parts = text.split(":")
        kind = parts[0].strip().lower()
        try:
            nums = [float(p) for p in parts[1:]]
        except ValueError:
            raise ValueError(f"latency distribution {text!r}: parameters must be numbers") from None
        want = {"uniform": 2, "lognormal": 2, "exp": 1, "fixed": 1}
        if kind not in want:
            raise ValueError(f"latency distribution {text!r}: kind must be one of {', '.join(want)}")
        if len(nums) != want[kind]:
            raise ValueError(f"latency distribution {text!r}: {kind} takes {want[kind]} parameter(s)")
        if any(x < 0 for x in nums) or (kind == "uniform" and nums[1] < nums[0]):
            raise ValueError(f"latency distribution {text!r}: parameters must be >= 0 (and LO <= HI)")
        return cls(kind, nums[0], nums[1] if len(nums) > 1 else 0.0)

    @property
    def mean(self) -> float:
        """Mean in units."""
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        if self.kind == "lognormal":
            return self.a * math.exp(self.b**2 / 2)
        return self.a

    def __str__(self) -> str:
        if self.kind in ("uniform", "lognormal"):
            return f"{self.kind}:{self.a:g}:{self.b:g}"
        return f"{self.kind}:{self.a:g}"


_JUDGE_TEMPLATE = '''\
"""Simulated remote judge written by rewardmesh's benchmarks: sleeps a per-sample latency, then scores.

The latency is a pure function of (seed, prompt, response text), so the same sample gets the same
latency in every mode of one benchmark run (seeded generation makes the same responses).
"""

import asyncio
import hashlib
import json
import math

KIND = {kind!r}
A = {a!r}
B = {b!r}
UNIT_S = {unit_s!r}
SEED = {seed!r}


def _uniforms(key):
    digest = hashlib.sha256(f"{{SEED}}|{{key}}".encode()).digest()
    return (int.from_bytes(digest[:8], "big") + 0.5) / 2**64, (int.from_bytes(digest[8:16], "big") + 0.5) / 2**64


def latency_s(solution_str, ground_truth, extra_info):
    u, v = _uniforms(json.dumps([solution_str, ground_truth, extra_info], sort_keys=True, default=str))
    if KIND == "uniform":
        x = A + (B - A) * u
    elif KIND == "lognormal":
        x = A * math.exp(B * math.sqrt(-2.0 * math.log(u)) * math.cos(2.0 * math.pi * v))
    elif KIND == "exp":
        x = -A * math.log(u)
    else:
        x = A
    return x * UNIT_S


async def judge(data_source, solution_str, ground_truth, extra_info=None):
    delay = latency_s(solution_str, ground_truth, extra_info or {{}})
    await asyncio.sleep(delay)
    correct = bool(ground_truth) and solution_str.strip().startswith(ground_truth)
    return {{"score": 1.0 if correct else 0.0, "judge_latency": delay}}
'''


def write_judge(directory: Path, dist: LatencyDist, unit_s: float, seed: int) -> str:
    """Write the judge module; returns its `path.py:judge` function spec."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"sim_judge_{seed}_{int(unit_s * 1e6)}.py"
    path.write_text(_JUDGE_TEMPLATE.format(kind=dist.kind, a=dist.a, b=dist.b, unit_s=unit_s, seed=seed))
    return f"{path}:judge"


def judge_pipeline(function: str, concurrency: int, timeout_s: float = 120.0) -> dict[str, Any]:
    """One-sample "batches", at most `concurrency` judge calls in flight (a remote judge's capacity)."""
    return {
        "description": f"simulated remote judge, {concurrency} calls in flight",
        "sources": [
            {
                "type": "function",
                "function": function,
                "executor": "auto",
                "timeout_s": timeout_s,
                "max_concurrency": concurrency,
            }
        ],
        "batching": {"max_batch_size": 1, "max_concurrent_batches": concurrency, "max_queue_delay_ms": 0},
    }


def reward_model_pipeline(model: Path) -> dict[str, Any]:
    """The tiny sequence-classifier reward model with the engine's default model batching."""
    return {"description": "tiny reward model", "sources": [{"type": "model", "path": str(model), "device": "cpu"}]}


def tiny_policy(models_dir: Path) -> tuple[TinyModelPaths, str, Any]:
    """Quiet the logs, build (or reuse) the tiny models: their paths, the policy directory and its tokenizer."""
    from rewardmesh.demo.tiny_models import build_tiny_models
    from rewardmesh.server.reward.server import load_tokenizer

    quiet_logs()
    models = build_tiny_models(models_dir)
    policy = str(models.policy)
    return models, policy, load_tokenizer(policy)


def quiet_logs() -> None:
    """Keep the servers' per-model-load progress bars and info lines out of the benchmark output."""
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


# ------------------------------------------------------------------------------------ driving Generate


@dataclass
class PromptJob:
    """One Generate call: a prompt, its own max_tokens and seed, n samples."""

    spec: PromptSpec
    max_tokens: int
    seed: int
    group_id: str
    stop_token_ids: list[int] = field(default_factory=list)  # beside run_generate's own


@dataclass
class SampleRecord:
    """One sample as the benchmark client saw it (times in seconds; `arrived` since the run started)."""

    sample_id: str
    group_id: str
    arrived: float
    generate_s: float
    reward_s: float
    queue_s: float
    compute_s: float
    response_length: int
    score: float = 0.0
    judge_latency: float = 0.0
    error: str = ""
    sample: Any = field(default=None, repr=False)  # common_pb2.Sample, kept for the synchronous mode

    @property
    def generated(self) -> float:
        """When its generation finished on the client's clock (its reward wait subtracted)."""
        return self.arrived - self.reward_s


def make_jobs(specs: Sequence[PromptSpec], max_tokens: Sequence[int], *, seed: int, tag: str) -> list[PromptJob]:
    return [
        PromptJob(spec, int(m), seed + 1000 * i, f"{tag}-p{i}")
        for i, (spec, m) in enumerate(zip(specs, max_tokens, strict=True))
    ]


def stop_token_ids(tokenizer: Any, k: int) -> list[int]:
    """k ordinary (non-special) token ids, evenly spread over the vocabulary, to use as extra stop tokens.

    The tiny random policy's next-token distribution is close to uniform, so each decode step then ends a
    sample with probability about (k + its own eos ids) / vocab: response lengths become geometric (many short,
    a long tail), varying per sample, as RL response lengths do.
    """
    if k <= 0:
        return []
    special = set(tokenizer.all_special_ids)
    ordinary = [i for i in range(len(tokenizer)) if i not in special]
    step = max(1, len(ordinary) // k)
    return ordinary[step // 2 :: step][:k]


def spread_max_tokens(count: int, lo: int, hi: int, rng: random.Random, shape: str = "loguniform") -> list[int]:
    """Per-prompt max_tokens: `none` (all hi), `loguniform` (right-skewed), `uniform` or `linear`."""
    if count <= 0:
        return []
    if shape == "none":
        return [hi] * count
    if shape == "linear":
        return [round(lo + (hi - lo) * i / max(count - 1, 1)) for i in range(count)]
    if shape == "uniform":
        return [rng.randint(lo, hi) for _ in range(count)]
    if shape == "loguniform":
        return [round(math.exp(rng.uniform(math.log(lo), math.log(hi)))) for _ in range(count)]
    raise ValueError(f"unknown length shape {shape!r} (none, loguniform, uniform, linear)")


async def run_generate(
    address: str,
    jobs: Sequence[PromptJob],
    n: int,
    *,
    reward: str = "",
    temperature: float = 1.0,
    stop_token_ids: Sequence[int] = (),
    keep_samples: bool = False,
    started: float | None = None,
) -> tuple[list[SampleRecord], float]:
    """One concurrent Generate stream per job on the rollout server at `address`.

    Returns the records (in arrival order) and the start time (perf_counter) their `arrived` is relative to.
    """
    from grpc import aio

    options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    async with aio.insecure_channel(address, options=options) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        await channel.channel_ready()
        records: list[SampleRecord] = []
        t0 = time.perf_counter() if started is None else started

        async def one(job: PromptJob) -> None:
            sample_ids = [f"{job.group_id}/{k}" for k in range(n)]
            request = rollout_pb2.GenerateRequest(
                prompts=[job.spec.to_proto(job.group_id, sample_ids)],
                n=n,
                reward=reward,
                sampling=rollout_pb2.SamplingParams(
                    temperature=temperature,
                    max_tokens=job.max_tokens,
                    seed=job.seed,
                    stop_token_ids=[*stop_token_ids, *job.stop_token_ids],
                ),
            )
            async for response in stub.Generate(request):
                records.append(to_record(response, time.perf_counter() - t0, keep_samples))

        await asyncio.gather(*(one(job) for job in jobs))
    return records, t0


def to_record(response: rollout_pb2.GenerateResponse, arrived: float, keep_sample: bool) -> SampleRecord:
    s = response.sample
    result = response.result if response.HasField("result") else None
    error = result.error.message if result is not None and result.HasField("error") else ""
    return SampleRecord(
        sample_id=s.sample_id,
        group_id=s.group_id,
        arrived=arrived,
        generate_s=s.timing.generate_sequences,
        reward_s=s.timing.reward,
        queue_s=s.timing.reward_queue,
        compute_s=s.timing.reward_compute,
        response_length=s.timing.response_length,
        score=result.score if result is not None else 0.0,
        judge_latency=result.extras.get("judge_latency", 0.0) if result is not None else 0.0,
        error=error,
        sample=s if keep_sample else None,
    )


# ---------------------------------------------------------------------------------------- queue simulation


def fifo_finish_times(ready: Sequence[float], service: Sequence[float], slots: int) -> list[float]:
    """Each job enters a FIFO queue served by `slots` servers the instant it is ready; its finish times."""
    import heapq

    order = sorted(range(len(ready)), key=lambda i: ready[i])
    free = [0.0] * max(1, slots)
    heapq.heapify(free)
    out = [0.0] * len(ready)
    for i in order:
        slot_free = heapq.heappop(free)
        end = max(slot_free, ready[i]) + service[i]
        out[i] = end
        heapq.heappush(free, end)
    return out


def batched_finish_times(
    ready: Sequence[float], service: Sequence[float], max_batch: int, slots: int = 1
) -> list[float]:
    """A dynamic batcher with `slots` batches in flight: a free slot takes every ready job (up to max_batch);
    a simulated batch takes the mean of its members' measured batch times."""
    order = sorted(range(len(ready)), key=lambda i: ready[i])
    out = [0.0] * len(ready)
    free = [0.0] * max(1, slots)
    pos = 0
    while pos < len(order):
        k = min(range(len(free)), key=lambda j: free[j])
        start = max(free[k], ready[order[pos]])
        batch = [i for i in order[pos : pos + max_batch] if ready[i] <= start] or [order[pos]]
        pos += len(batch)
        end = start + statistics.fmean(service[i] for i in batch)
        for i in batch:
            out[i] = end
        free[k] = end
    return out


# ------------------------------------------------------------------------------------------------- output


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def machine_table(extra: Mapping[str, object] | None = None) -> str:
    info = machine_info()
    rows: list[list[object]] = [[k, v] for k, v in info.items()]
    rows += [[k, v] for k, v in (extra or {}).items()]
    return markdown_table(["machine / config", "value"], rows)


def dedent(text: str) -> str:
    return textwrap.dedent(text).strip()

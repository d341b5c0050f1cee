"""Benchmark: does the reward server's dynamic batching reach the model's offline throughput?

    python -m bench.reward_batching [--samples N] [--model DIR] [--json-out FILE]

One run measures, side by side, on the same N samples (random token ids, --seq-len tokens each):

(a) offline limit: the N samples in full batches of --max-batch-size through `ModelSource.score_tokens`
    in this process, no server involved;
(b) dynamic batching: the N samples submitted one by one, --concurrency in flight, on one Score stream
    (`RewardClient`) to a reward server in its own process (`rewardmesh serve reward`), whose batcher
    forms the batches;
(c) serial: N/4 of the samples sent one at a time, each awaited before the next, same server;

and, for the transport alone, the server's built-in `noop` pipeline against a bare grpc.aio echo server
(bench/common.py, its own process too), both driven by the same RewardClient code with the same
messages and the same number of samples in flight.

(a) and (b) alternate over --rounds rounds, as do the two transport targets, and the best round of each
is reported: a burst of load from another process on the machine slows a round down, never speeds it
up. The CPU load of other processes during each phase is measured and printed as a noise indicator.

Prints a markdown table (machine, configuration, numbers, ratios, PASS/FAIL per target) and exits 0
whether or not the targets are met: it is a measurement. Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (
    CpuUsage,
    RunStats,
    cpu_snapshot,
    cpu_usage,
    drive_concurrent,
    drive_serial,
    echo_server_argv,
    fmt_rate,
    machine_info,
    markdown_table,
    progress,
)
from rewardmesh.demo.model_shapes import SHAPES
from rewardmesh.demo.server_process import ServerProcess

# Targets the benchmark checks.
TARGET_BATCHING_VS_OFFLINE = 0.8  # (b)/(a), any machine
TARGET_BATCHING_VS_OFFLINE_GPU = 0.85  # (b)/(a) with --device cuda
TARGET_BATCHING_VS_SERIAL = 5.0  # (b)/(c), on a GPU
TARGET_TRANSPORT_VS_ECHO = 0.75  # rewardmesh noop / bare echo
TARGET_NOOP_RATE = 4000.0  # rewardmesh noop samples/s, on the 2-core CPU reference machine
TARGET_FULL_BATCH_MS = 20.0  # the model must be big enough for batching to matter

# A round during which other processes kept more than this many cores busy is "noisy": rounds are added
# (up to --max-extra-rounds) until each measurement has at least one quiet round.
QUIET_CORES = 0.25

PIPELINE = "bench_rm"
SERVICE = "rewardmesh.v1.RewardService"
MODEL_SEED = 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.reward_batching",
        description="Measure the reward server's dynamic batching against the model's offline limit and "
        "serial scoring, and rewardmesh's Score transport against a bare grpc.aio echo server. "
        "The reward server and the echo server run as subprocesses; this process generates the load.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    model = p.add_argument_group("model")
    model.add_argument(
        "--model",
        type=Path,
        help="local sequence-classifier reward model directory (default: a random tiny Llama RM of "
        "--layers x --hidden, built once into --cache-dir)",
    )
    model.add_argument(
        "--shape",
        choices=sorted(name for name, shape in SHAPES.items() if shape.kind == "reward_model"),
        help="a random bf16 reward model of a real shape (e.g. Qwen2.5-0.5B's), built once under --cache-dir/shapes",
    )
    model.add_argument("--layers", type=int, default=4, help="layers of the default tiny reward model")
    model.add_argument("--hidden", type=int, default=256, help="hidden size of the default tiny reward model")
    model.add_argument(
        "--cache-dir",
        type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rewardmesh" / "bench",
        help="where the default tiny reward model is built and reused",
    )
    model.add_argument("--device", default="auto", help="reward model device, for (a) and the server: auto, cpu, cuda")
    model.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="torch intra-op threads of (a) and of the reward server (OMP_NUM_THREADS); 0: torch's default",
    )

    load = p.add_argument_group("batching benchmark")
    load.add_argument("--samples", type=int, default=1536, help="samples N in (a) and (b)")
    load.add_argument("--seq-len", type=int, default=128, help="tokens per sample, prompt + response (half each)")
    load.add_argument("--max-batch-size", type=int, default=32, help="batch size of (a) and of the server's batcher")
    load.add_argument("--max-queue-delay-ms", type=float, default=2.0, help="the server batcher's max_queue_delay_ms")
    load.add_argument("--concurrency", type=int, help="samples in flight in (b) (default: 4 x --max-batch-size)")
    load.add_argument("--serial-samples", type=int, help="samples in (c) (default: N/4)")
    load.add_argument("--rounds", type=int, default=3, help="alternating (a)/(b) rounds; the best of each counts")
    p.add_argument(
        "--max-extra-rounds",
        type=int,
        default=2,
        help=f"rounds added while no round of a measurement was quiet (other processes < {QUIET_CORES} cores)",
    )

    transport = p.add_argument_group("transport benchmark")
    transport.add_argument("--transport-samples", type=int, default=20000, help="samples per transport round")
    transport.add_argument(
        "--transport-concurrency", type=int, default=1024, help="samples in flight, the same for both servers"
    )
    transport.add_argument(
        "--transport-rounds",
        type=int,
        default=4,
        help="alternating rewardmesh/echo rounds; the target is judged on client + server CPU per sample, medians",
    )
    transport.add_argument(
        "--transport-only", action="store_true", help="measure only the transport (no reward model, no (a)-(c))"
    )

    transport.add_argument(
        "--servicer-only",
        action="store_true",
        help="measure only the reward servicer's own CPU per sample in this process (no sockets): noop samples "
        "in messages of --servicer-items through RewardServicer.Score, parsed from bytes, answers serialized",
    )
    transport.add_argument("--servicer-items", type=int, default=256, help="samples per Score message")

    iso = p.add_argument_group("isolation benchmark")
    iso.add_argument(
        "--isolation-only",
        action="store_true",
        help="measure only the per-sample cost of running a rule in isolated worker processes vs inline",
    )
    iso.add_argument("--isolation-samples", type=int, default=4096, help="samples per isolation round and mode")
    iso.add_argument("--isolation-rounds", type=int, default=5, help="interleaved inline/process rounds (median)")

    p.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    p.add_argument("--json-out", type=Path, help="also write every number to this JSON file")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (progress lines remain)")
    return p


# ------------------------------------------------------------------------------------------------------ inputs


def ensure_model(args: argparse.Namespace) -> Path:
    """The reward model directory: --model, a model of --shape, or the default tiny RM, built once and reused."""
    if args.model is not None:
        if not (args.model / "config.json").is_file():
            raise SystemExit(f"--model {args.model}: no config.json there; pass a local reward model directory")
        return Path(args.model)
    from rewardmesh.demo.tiny_models import BUILD_VERSION, build_reward_model, build_shaped_models, build_tokenizer

    if args.shape:
        progress(f"the {args.shape} shape, built once under {args.cache_dir / 'shapes'} (bf16, random)")
        return build_shaped_models(args.cache_dir / "shapes", [args.shape])[args.shape]

    heads = max(1, args.hidden // 64)
    out = args.cache_dir / f"reward_model-l{args.layers}-h{args.hidden}-a{heads}-s{MODEL_SEED}-v{BUILD_VERSION}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    progress(f"building a {args.layers}-layer, {args.hidden}-wide tiny reward model in {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=out.parent))
    try:
        tokenizer = build_tokenizer()
        build_reward_model(
            staging / "m", tokenizer, layers=args.layers, hidden=args.hidden, heads=heads, seed=MODEL_SEED
        )
        try:
            (staging / "m").rename(out)  # atomic: a run never sees a half-written model
        except OSError:
            if not (out / "config.json").is_file():  # not just a concurrent run that finished first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def token_ids(n: int, seq_len: int, vocab: int, seed: int) -> np.ndarray:
    """[n, seq_len] random int32 ids, avoiding the special tokens at the start of the vocabulary."""
    rng = np.random.default_rng(seed)
    return rng.integers(min(3, vocab - 1), vocab, size=(n, seq_len), dtype=np.int32)


def to_samples(ids: np.ndarray, prefix: str, prompt_len: int) -> list[Any]:
    """Sample protos (ids only, as a rollout server sends them), built before any timing starts."""
    from rewardmesh.common.tensors import ids_tensor
    from rewardmesh.v1 import common_pb2

    return [
        common_pb2.Sample(
            sample_id=f"{prefix}-{i}",
            group_id=f"{prefix}-g{i // 8}",
            prompt_ids=ids_tensor(row[:prompt_len]),
            response_ids=ids_tensor(row[prompt_len:]),
        )
        for i, row in enumerate(ids)
    ]


# --------------------------------------------------------------------------------------------------- offline (a)


@dataclass
class OfflineStats:
    samples: int
    elapsed_s: float
    batch_times_s: list[float]
    cpu: CpuUsage | None = None

    @property
    def other_cores(self) -> float | None:
        return self.cpu.other_cores if self.cpu is not None else None

    @property
    def throughput(self) -> float:
        return self.samples / self.elapsed_s

    @property
    def median_batch_ms(self) -> float:
        return float(np.median(self.batch_times_s) * 1000.0)


def time_full_batch(source: Any, ids: np.ndarray, batch_size: int, repeats: int = 3) -> list[float]:
    """One warmup batch, then `repeats` timed full batches."""
    batch = list(ids[:batch_size])
    source.score_tokens(batch)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        source.score_tokens(batch)
        times.append(time.perf_counter() - t)
    return times


def run_offline(source: Any, ids: np.ndarray, batch_size: int, desc: str, show_progress: bool) -> OfflineStats:
    from tqdm import tqdm

    rows = list(ids)
    times: list[float] = []
    with tqdm(
        total=len(rows), desc=desc, unit="sample", file=sys.stderr, disable=not show_progress, leave=False
    ) as bar:
        start = time.perf_counter()
        for lo in range(0, len(rows), batch_size):
            t = time.perf_counter()
            source.score_tokens(rows[lo : lo + batch_size])
            times.append(time.perf_counter() - t)
            bar.update(min(batch_size, len(rows) - lo))
        elapsed = time.perf_counter() - start
    return OfflineStats(len(rows), elapsed, times)


# ----------------------------------------------------------------------------------------------------- the run


def reward_server_config(args: argparse.Namespace, model: Path, concurrency: int) -> dict[str, Any]:
    return {
        "server": {"grace_s": 10},
        "pipelines": {
            PIPELINE: {
                "description": "benchmark reward model",
                "sources": [{"type": "model", "path": str(model), "device": args.device}],
                "batching": {
                    "max_batch_size": args.max_batch_size,
                    "max_queue_delay_ms": args.max_queue_delay_ms,
                    "max_queue_size": max(4096, 2 * concurrency),
                },
            }
        },
    }


def reward_server_argv(cfg_path: Path) -> list[str]:
    """`rewardmesh serve reward` on a free port of 127.0.0.1, as a subprocess of this interpreter."""
    cli = [sys.executable, "-m", "rewardmesh.server.cli", "serve", "reward"]
    return [*cli, "--host", "127.0.0.1", "--port", "0", "--config", str(cfg_path)]


async def run_transport_only(args: argparse.Namespace) -> dict[str, Any]:
    """The noop pipeline against the echo server, nothing else (a quick check of the Score path's cost)."""
    t_start = time.perf_counter()
    report: dict[str, Any] = {"machine": machine_info(), "loadavg_at_start": os.getloadavg()[0]}
    ids = token_ids(args.transport_samples, args.seq_len, 512, args.seed + 1)
    samples_t = to_samples(ids, "t", args.seq_len // 2)
    samples_tw = to_samples(ids[: min(1000, len(ids))], "tw", args.seq_len // 2)
    with tempfile.TemporaryDirectory(prefix="rewardmesh-bench-") as tmp:
        workdir = Path(tmp)
        cli = [sys.executable, "-m", "rewardmesh.server.cli", "serve", "reward", "--host", "127.0.0.1", "--port", "0"]
        reward_server = ServerProcess("reward-server", cli, workdir)
        echo_server = ServerProcess("echo-server", echo_server_argv(), workdir)
        try:
            reward_server.start()
            echo_server.start()
            await reward_server.wait_serving(SERVICE)
            await echo_server.wait_serving(SERVICE)
            report["transport"] = await run_transport(args, reward_server, echo_server, samples_t, samples_tw)
        finally:
            reward_server.stop()
            echo_server.stop()
    report["runtime_s"] = time.perf_counter() - t_start
    return report


async def run_servicer_only(args: argparse.Namespace) -> dict[str, Any]:
    """CPU per sample of RewardServicer.Score itself, gRPC left out: requests parsed from bytes (as gRPC hands
    them over), every response serialized (as gRPC would), thread CPU time, median of --transport-rounds."""
    from rewardmesh.reward_engine.engine import RewardEngine
    from rewardmesh.server.reward.service import RewardServicer
    from rewardmesh.v1 import reward_pb2

    engine = RewardEngine()
    engine.add_builtin_rules()
    servicer = RewardServicer(engine)
    per = max(1, args.servicer_items)
    samples = to_samples(token_ids(args.transport_samples, args.seq_len, 512, args.seed + 1), "s", args.seq_len // 2)
    wire = [
        reward_pb2.ScoreRequest(
            items=[reward_pb2.ScoreRequest(sample=x, reward="noop") for x in samples[lo : lo + per]],
            max_results_per_message=per,
        ).SerializeToString()
        for lo in range(0, len(samples), per)
    ]

    async def requests(data: list[bytes]) -> Any:
        for raw in data:
            yield reward_pb2.ScoreRequest.FromString(raw)
            await asyncio.sleep(0)  # as a stream would: the next message arrives in a later loop iteration

    async def one_round(data: list[bytes]) -> int:
        answered = 0
        async for response in servicer.Score(requests(data), None):  # type: ignore[arg-type]
            response.SerializeToString()
            answered += len(response.results) or 1
        return answered

    await one_round(wire[:2])  # warm up
    rounds = []
    for _ in range(args.transport_rounds):
        t = time.thread_time()
        answered = await one_round(wire)
        rounds.append((time.thread_time() - t) / answered * 1e6)
    await engine.close()
    return {"machine": machine_info(), "samples": len(samples), "per_message": per, "rounds_us": rounds}


def render_servicer(report: dict[str, Any]) -> str:
    m, rounds = report["machine"], report["rounds_us"]
    return (
        f"Reward servicer alone (no sockets; {m['cpu']}, Python {m['python']}; shared machine): "
        f"{statistics.median(rounds):.1f} µs CPU per sample, median of {len(rounds)} rounds "
        f"({', '.join(f'{x:.1f}' for x in rounds)}); {report['samples']} noop samples, "
        f"{report['per_message']} per message"
    )


def render_transport(report: dict[str, Any]) -> str:
    m, t = report["machine"], report["transport"]
    rm, echo = t["rewardmesh"], t["echo"]
    ratio = rm["throughput"] / echo["throughput"]
    rows = [
        [name, fmt_rate(x["throughput"]), _rounds(x["rounds"]), _us(x["server_cpu_us_per_sample"]),
         _us(x["client_cpu_us_per_sample"]), _cores(x["other_cores"])]
        for name, x in (("rewardmesh `noop`", rm), ("bare grpc.aio echo", echo))
    ]  # fmt: skip
    return "\n".join(
        [
            f"## Score transport ({m['cpu']}, {m['usable_cpus']} usable cores, Python {m['python']}, "
            f"grpcio {m['grpcio']}; shared machine)",
            "",
            markdown_table(
                ["server", "samples/s", "all rounds", "server CPU/sample", "client CPU/sample", "other cores"], rows
            ),
            "",
            f"rewardmesh / echo = {ratio:.2f} best rounds, {_median_ratio(t):.2f} median rounds, "
            f"{_cpu_ratio(t):.2f} by client + server CPU per sample (target >= {TARGET_TRANSPORT_VS_ECHO}, judged by "
            f"CPU per sample: {'PASS' if _cpu_ratio(t) >= TARGET_TRANSPORT_VS_ECHO else 'FAIL'})",
        ]
    )


def _median_ratio(t: dict[str, Any]) -> float:
    return float(t["rewardmesh"]["median_throughput"] / t["echo"]["median_throughput"])


def _cpu_ratio(t: dict[str, Any]) -> float:
    """Echo's CPU per sample over rewardmesh's (client + server, medians): the throughput ratio of a machine
    whose cores the pair shares with nothing else but each other."""
    rm, echo = t["rewardmesh"]["cpu_us_per_sample"], t["echo"]["cpu_us_per_sample"]
    return float(echo / rm) if rm > 0 else 0.0


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from rewardmesh.client.reward_client import RewardClient
    from rewardmesh.reward_engine.sources.reward_model import ModelSource

    t_start = time.perf_counter()
    if args.torch_threads > 0:  # the same for (a) in this process and for the server it starts
        import torch

        torch.set_num_threads(args.torch_threads)
        os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)
    show = not args.no_progress
    bs = args.max_batch_size
    concurrency = args.concurrency or 4 * bs
    serial_n = args.serial_samples or max(1, args.samples // 4)
    prompt_len = args.seq_len // 2
    report: dict[str, Any] = {"machine": machine_info(), "loadavg_at_start": os.getloadavg()[0]}
    model = ensure_model(args)

    with tempfile.TemporaryDirectory(prefix="rewardmesh-bench-") as tmp:
        workdir = Path(tmp)
        cfg_path = workdir / "reward.yaml"
        cfg_path.write_text(json.dumps(reward_server_config(args, model, concurrency), indent=2))  # JSON is YAML
        reward_server = ServerProcess("reward-server", reward_server_argv(cfg_path), workdir)
        echo_server = ServerProcess("echo-server", echo_server_argv(), workdir)
        try:
            progress("starting the reward server: " + " ".join(reward_server.argv[1:]))
            reward_server.start()
            progress(f"loading {model} in this process for (a)")
            source = ModelSource(name="offline", path=str(model), device=args.device)
            await reward_server.wait_serving(SERVICE)
            progress(f"reward server pid {reward_server.pid} SERVING on {reward_server.address}")
            pids = [reward_server.pid]

            report["model"] = {
                "path": str(model),
                "parameters": sum(p.numel() for p in source._model.parameters()) if source._model else 0,
                "device": str(source.device),
                "dtype": str(source.dtype).removeprefix("torch."),
            }
            ids = token_ids(args.samples, args.seq_len, source.vocab_size, args.seed)
            samples_b = to_samples(ids, "b", prompt_len)
            samples_c = to_samples(ids[:serial_n], "c", prompt_len)
            samples_w = to_samples(ids[: 2 * bs], "w", prompt_len)
            transport_ids = token_ids(args.transport_samples, args.seq_len, source.vocab_size, args.seed + 1)
            samples_t = to_samples(transport_ids, "t", prompt_len)
            samples_tw = to_samples(transport_ids[: min(1000, len(transport_ids))], "tw", prompt_len)

            # Is the model big enough for batching to matter? (min: the least disturbed of the timed batches)
            full_ms = min(time_full_batch(source, ids, bs)) * 1000.0
            report["full_batch_ms"] = full_ms
            verdict_text = (
                "big enough"
                if full_ms >= TARGET_FULL_BATCH_MS
                else f"TOO SMALL: the issue wants >= {TARGET_FULL_BATCH_MS:.0f} ms (use a bigger --model/--layers)"
            )
            progress(f"one full batch ({bs} x {args.seq_len} tokens) takes {full_ms:.1f} ms in process: {verdict_text}")

            offline_runs: list[OfflineStats] = []
            batched_runs: list[RunStats] = []
            async with RewardClient(reward_server.address) as client:
                await drive_concurrent(
                    client, samples_w, PIPELINE, concurrency=concurrency, name="warmup", show_progress=False
                )
                r = 0
                while True:
                    tag = f"round {r + 1}"
                    before = cpu_snapshot(pids)
                    offline = run_offline(source, ids, bs, f"(a) offline {tag}", show)
                    offline.cpu = cpu_usage(before, cpu_snapshot(pids))
                    offline_runs.append(offline)
                    progress(f"(a) offline  {tag}: {fmt_rate(offline.throughput)} samples/s{_noise(offline)}")

                    before = cpu_snapshot(pids)
                    batched = await drive_concurrent(
                        client,
                        samples_b,
                        PIPELINE,
                        concurrency=concurrency,
                        name=f"(b) batching {tag}",
                        show_progress=show,
                    )
                    batched.cpu = cpu_usage(before, cpu_snapshot(pids))
                    batched_runs.append(batched)
                    progress(
                        f"(b) batching {tag}: {fmt_rate(batched.throughput)} samples/s, "
                        f"mean batch {batched.mean_batch_size:.1f}{_noise(batched)}"
                    )
                    r += 1
                    if not _more_rounds(r, args.rounds, args.max_extra_rounds, [offline_runs, batched_runs]):
                        break
                before = cpu_snapshot(pids)
                serial = await drive_serial(client, samples_c, PIPELINE, name="(c) serial", show_progress=show)
                serial.cpu = cpu_usage(before, cpu_snapshot(pids))
                progress(f"(c) serial: {serial_n} samples, {fmt_rate(serial.throughput)} samples/s{_noise(serial)}")
            del source

            progress("starting the echo server: " + " ".join(echo_server.argv[1:]))
            echo_server.start()
            await echo_server.wait_serving(SERVICE)
            progress(f"echo server pid {echo_server.pid} SERVING on {echo_server.address}")
            transport = await run_transport(args, reward_server, echo_server, samples_t, samples_tw)
        finally:
            rc_reward = reward_server.stop()
            rc_echo = echo_server.stop()
        progress(f"SIGTERM: reward server exited with code {rc_reward}, echo server with {rc_echo}")
        if rc_reward != 0:
            progress("reward server log tail:\n" + reward_server.log_tail())

    best_offline = max(offline_runs, key=lambda o: o.throughput)
    best_batched = max(batched_runs, key=lambda b: b.throughput)
    report.update(
        config={
            "samples": args.samples,
            "serial_samples": serial_n,
            "seq_len": args.seq_len,
            "prompt_len": prompt_len,
            "max_batch_size": bs,
            "max_queue_delay_ms": args.max_queue_delay_ms,
            "concurrency": concurrency,
            "rounds": len(batched_runs),
            "transport_samples": args.transport_samples,
            "transport_concurrency": args.transport_concurrency,
            "transport_rounds": len(transport["echo"]["rounds"]),
        },
        offline={
            "samples": best_offline.samples,
            "elapsed_s": best_offline.elapsed_s,
            "throughput": best_offline.throughput,
            "median_batch_ms": best_offline.median_batch_ms,
            "other_cores": best_offline.other_cores,
            "rounds": [o.throughput for o in offline_runs],
            "rounds_other_cores": [o.other_cores for o in offline_runs],
        },
        batching=phase_summary(best_batched, bs, reward_server.pid)
        | {"rounds": [b.throughput for b in batched_runs], "rounds_other_cores": [b.other_cores for b in batched_runs]},
        serial=phase_summary(serial, bs, reward_server.pid),
        transport=transport,
        server_exit_code=rc_reward,
        echo_exit_code=rc_echo,
    )
    report["runtime_s"] = time.perf_counter() - t_start
    return report


def _noise(stats: RunStats | OfflineStats) -> str:
    return "" if stats.other_cores is None else f" (other processes: {stats.other_cores:.1f} cores)"


def _quiet(stats: RunStats | OfflineStats) -> bool:
    return stats.other_cores is None or stats.other_cores < QUIET_CORES


def _more_rounds(done: int, minimum: int, max_extra: int, runs: Sequence[Sequence[RunStats | OfflineStats]]) -> bool:
    """Another round? Until `minimum` are done, then while some measurement has had no quiet round."""
    if done < minimum:
        return True
    if all(any(_quiet(x) for x in phase) for phase in runs):
        return False
    if done >= minimum + max_extra:
        progress(f"no quiet round in {done}: other processes keep the machine busy, so the numbers are noisy")
        return False
    progress(f"other processes kept >= {QUIET_CORES} cores busy in the rounds so far: one more round")
    return True


async def run_transport(
    args: argparse.Namespace,
    reward_server: ServerProcess,
    echo_server: ServerProcess,
    samples: Sequence[Any],
    warmup: Sequence[Any],
) -> dict[str, Any]:
    """Alternating rounds: the `noop` pipeline and the echo server, same client code, messages and window."""
    from rewardmesh.client.reward_client import RewardClient
    from rewardmesh.v1.reward_pb2 import ScoreRequest

    conc = args.transport_concurrency
    servers = {"rewardmesh": reward_server, "echo": echo_server}
    rounds: dict[str, list[RunStats]] = {name: [] for name in servers}
    async with RewardClient(reward_server.address) as rm_client, RewardClient(echo_server.address) as echo_client:
        clients = {"rewardmesh": rm_client, "echo": echo_client}
        for name, client in clients.items():
            await drive_concurrent(client, warmup, "noop", concurrency=conc, name=f"{name} warmup", show_progress=False)
        r = 0
        while True:
            for name, client in clients.items():
                pids = [servers[name].pid]
                before = cpu_snapshot(pids)
                stats = await drive_concurrent(
                    client,
                    samples,
                    "noop",
                    concurrency=conc,
                    name=f"transport {name} round {r + 1}",
                    show_progress=not args.no_progress,
                )
                stats.cpu = cpu_usage(before, cpu_snapshot(pids))
                progress(f"transport {name:<10} round {r + 1}: {fmt_rate(stats.throughput)} samples/s{_noise(stats)}")
                rounds[name].append(stats)
            r += 1
            if not _more_rounds(r, args.transport_rounds, args.max_extra_rounds, list(rounds.values())):
                break
    request_bytes = float(np.mean([ScoreRequest(sample=s, reward="noop").ByteSize() for s in samples[:1000]]))
    out: dict[str, Any] = {}
    for name, runs in rounds.items():
        best = max(runs, key=lambda s: s.throughput)
        server_cpu = [s.cpu_us_per_sample(servers[name].pid) or 0.0 for s in runs]
        client_cpu = [s.cpu_us_per_sample(os.getpid()) or 0.0 for s in runs]
        cpu_rounds = [a + b for a, b in zip(server_cpu, client_cpu, strict=True)]
        out[name] = {
            "throughput": best.throughput,
            "median_throughput": statistics.median(s.throughput for s in runs),
            # Client + server CPU per sample, median over rounds: what the pair costs whatever else runs on the
            # machine (a shared machine changes the rounds' wall throughput, far less their CPU per sample).
            "cpu_us_per_sample": statistics.median(cpu_rounds),
            # Medians over rounds, as the ratio they make up (the best round's CPU is no steadier than any).
            "server_cpu_us_per_sample": statistics.median(server_cpu),
            "client_cpu_us_per_sample": statistics.median(client_cpu),
            "rounds": [s.throughput for s in runs],
            "rounds_other_cores": [s.other_cores for s in runs],
            "other_cores": best.other_cores,
            "errors": sum(len(s.errors) for s in runs),
            "first_error": next((e for s in runs for e in s.errors), ""),
            "p50_ms": best.latency_ms(50),
            "p95_ms": best.latency_ms(95),
            "mean_batch_size": best.mean_batch_size,
            "request_bytes": request_bytes,
            "response_bytes": best.response_bytes(),
        }
    return out


def phase_summary(stats: RunStats, full: int, server_pid: int) -> dict[str, Any]:
    compute_s = stats.server_compute_s()
    return {
        "server_cpu_us_per_sample": stats.cpu_us_per_sample(server_pid),
        "server_loop_cpu_us_per_sample": stats.cpu_us_per_sample(server_pid, main_thread=True),
        "client_cpu_us_per_sample": stats.cpu_us_per_sample(os.getpid()),
        "samples": stats.samples,
        "concurrency": stats.concurrency,
        "elapsed_s": stats.elapsed_s,
        "throughput": stats.throughput,
        "other_cores": stats.other_cores,
        "p50_ms": stats.latency_ms(50),
        "p95_ms": stats.latency_ms(95),
        "mean_batch_size": stats.mean_batch_size,
        "full_batch_fraction": stats.full_batch_fraction(full),
        "server_queue_ms": stats.mean_server_ms("queue"),
        "server_compute_ms": stats.mean_server_ms("compute"),
        "server_total_ms": stats.mean_server_ms("total"),
        "server_full_batch_compute_ms": stats.full_batch_compute_ms(full),
        "server_compute_s": compute_s,
        "server_busy_fraction": compute_s / stats.elapsed_s if stats.elapsed_s else 0.0,
        "errors": len(stats.errors),
        "first_error": stats.errors[0] if stats.errors else "",
    }


# ------------------------------------------------------------------------------------------------------ report


def _verdict(ok: bool, quiet: bool = True) -> str:
    """PASS/FAIL; marked noisy when a round it rests on ran while other processes loaded the machine."""
    return ("PASS" if ok else "**FAIL**") + ("" if quiet else " (noisy, see below)")


def _is_quiet(other_cores: float | None) -> bool:
    return other_cores is None or other_cores < QUIET_CORES


def _rounds(values: Sequence[float]) -> str:
    return ", ".join(fmt_rate(v) for v in values)


def _us(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f} µs"


def _cores(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def render(report: dict[str, Any]) -> str:
    m, c, a, b, s, t = (report[k] for k in ("machine", "config", "offline", "batching", "serial", "transport"))
    rm, echo = t["rewardmesh"], t["echo"]
    on_gpu = str(report["model"]["device"]).startswith("cuda")
    params_m = report["model"]["parameters"] / 1e6
    response = c["seq_len"] - c["prompt_len"]
    other = [a["other_cores"], b["other_cores"], s["other_cores"], rm["other_cores"], echo["other_cores"]]
    known = [x for x in other if x is not None]
    noise = f"mean {np.mean(known):.1f}, max {max(known):.1f} cores" if known else "n/a"

    out = ["## Reward server: dynamic batching benchmark", ""]
    out += [
        markdown_table(
            ["machine", ""],
            [
                ["CPU", f"{m['cpu']}, {m['cpu_count']} cores ({m['usable_cpus']} usable)"],
                ["device / dtype", f"{m['device']} / {report['model']['dtype']}"],
                ["torch (intra-op threads)", f"{m['torch']} ({m['torch_threads']})"],
                ["python / grpcio", f"{m['python']} / {m['grpcio']}"],
                ["load average at start", f"{report['loadavg_at_start']:.2f}"],
                ["CPU used by other processes in the reported rounds", noise],
            ],
        ),
        "",
        markdown_table(
            ["configuration", ""],
            [
                ["reward model", f"`{Path(report['model']['path']).name}` ({params_m:.1f}M parameters)"],
                ["sample", f"{c['seq_len']} token ids ({c['prompt_len']} prompt + {response} response)"],
                [
                    "server batcher",
                    f"max_batch_size {c['max_batch_size']}, max_queue_delay_ms {c['max_queue_delay_ms']:g}",
                ],
                [
                    "(a), (b)",
                    f"{c['samples']} samples each, {c['rounds']} alternating rounds, best round of each reported",
                ],
                ["(b) load", f"{c['concurrency']} samples in flight on one Score stream (RewardClient.submit)"],
                ["(c) load", f"{c['serial_samples']} samples, one in flight"],
                [
                    "transport load",
                    f"{c['transport_samples']} samples x {c['transport_rounds']} alternating rounds, "
                    f"{c['transport_concurrency']} in flight, best round of each reported",
                ],
                ["processes", "load generator + (a) / reward server (`rewardmesh serve reward`) / echo server"],
                ["command", f"`{report['command']}`"],
            ],
        ),
        "",
    ]

    out += [
        markdown_table(
            ["measurement", "samples", "samples/s", "all rounds", "details"],
            [
                [
                    "(a) offline: full batches in process",
                    a["samples"],
                    fmt_rate(a["throughput"]),
                    _rounds(a["rounds"]),
                    f"{a['median_batch_ms']:.0f} ms per batch of {c['max_batch_size']} (median)",
                ],
                [
                    "(b) dynamic batching via the server",
                    b["samples"],
                    fmt_rate(b["throughput"]),
                    _rounds(b["rounds"]),
                    f"mean batch {b['mean_batch_size']:.1f} ({b['full_batch_fraction']:.0%} of samples in full "
                    f"batches); latency p50 {b['p50_ms']:.0f} / p95 {b['p95_ms']:.0f} ms",
                ],
                [
                    "(c) serial via the server",
                    s["samples"],
                    fmt_rate(s["throughput"]),
                    "",
                    f"mean batch {s['mean_batch_size']:.1f}; latency p50 {s['p50_ms']:.1f} / p95 {s['p95_ms']:.1f} ms",
                ],
                [
                    "transport: rewardmesh `noop` pipeline",
                    c["transport_samples"],
                    fmt_rate(rm["throughput"]),
                    _rounds(rm["rounds"]),
                    f"mean batch {rm['mean_batch_size']:.1f}; latency p50 {rm['p50_ms']:.0f} ms",
                ],
                [
                    "transport: bare grpc.aio echo server",
                    c["transport_samples"],
                    fmt_rate(echo["throughput"]),
                    _rounds(echo["rounds"]),
                    f"latency p50 {echo['p50_ms']:.0f} ms",
                ],
            ],
        ),
        "",
    ]

    quiet = {
        name: _is_quiet(x["other_cores"]) for name, x in (("a", a), ("b", b), ("c", s), ("rm", rm), ("echo", echo))
    }
    quiet_ab, quiet_bc = quiet["a"] and quiet["b"], quiet["b"] and quiet["c"]
    r_ba = b["throughput"] / a["throughput"]
    target_ba = TARGET_BATCHING_VS_OFFLINE_GPU if on_gpu else TARGET_BATCHING_VS_OFFLINE
    r_bc = b["throughput"] / s["throughput"]
    r_te = rm["throughput"] / echo["throughput"]
    errors = b["errors"] + s["errors"] + rm["errors"] + echo["errors"]
    out += [
        markdown_table(
            ["check", "target", "measured", "result"],
            [
                [
                    "model big enough: one full batch in process",
                    f">= {TARGET_FULL_BATCH_MS:.0f} ms",
                    f"{report['full_batch_ms']:.0f} ms",
                    _verdict(report["full_batch_ms"] >= TARGET_FULL_BATCH_MS),
                ],
                [
                    "(b)/(a): dynamic batching vs offline limit",
                    f">= {target_ba}" + (" (GPU)" if on_gpu else ""),
                    f"{r_ba:.2f}",
                    _verdict(r_ba >= target_ba, quiet_ab),
                ],
                [
                    "(b)/(c): dynamic batching vs serial",
                    f">= {TARGET_BATCHING_VS_SERIAL:g}x on a GPU",
                    f"{r_bc:.1f}x",
                    _verdict(r_bc >= TARGET_BATCHING_VS_SERIAL, quiet_bc) if on_gpu else "n/a on CPU (reported only)",
                ],
                [
                    "transport: rewardmesh / echo (best rounds; median rounds; by CPU per sample, which is judged)",
                    f">= {TARGET_TRANSPORT_VS_ECHO}",
                    f"{r_te:.2f}; {_median_ratio(t):.2f}; {_cpu_ratio(t):.2f}",
                    _verdict(_cpu_ratio(t) >= TARGET_TRANSPORT_VS_ECHO),
                ],
                [
                    "transport: rewardmesh `noop` rate",
                    f"> {TARGET_NOOP_RATE:,.0f}/s (2-core CPU)",
                    f"{fmt_rate(rm['throughput'])}/s",
                    _verdict(rm["throughput"] > TARGET_NOOP_RATE, _is_quiet(rm["other_cores"])),
                ],
                ["every sample answered, none with an error", "0 errors", str(errors), _verdict(errors == 0)],
                [
                    "reward server exits cleanly on SIGTERM",
                    "exit code 0",
                    str(report["server_exit_code"]),
                    _verdict(report["server_exit_code"] == 0),
                ],
            ],
        ),
        "",
    ]

    out += [
        markdown_table(
            ["where the time went (best rounds)", "value"],
            [
                [
                    "(b) full batch compute on the server (median)",
                    f"{b['server_full_batch_compute_ms']:.0f} ms (in process, (a): {a['median_batch_ms']:.0f} ms)",
                ],
                ["(b) model busy: sum of batch compute / wall time", f"{b['server_busy_fraction']:.0%}"],
                [
                    "(b) per sample on the server: queue / compute / total (mean)",
                    f"{b['server_queue_ms']:.0f} / {b['server_compute_ms']:.0f} / {b['server_total_ms']:.0f} ms",
                ],
                [
                    "(b) CPU per sample: client process / server event loop",
                    f"{_us(b['client_cpu_us_per_sample'])} / {_us(b['server_loop_cpu_us_per_sample'])}",
                ],
                [
                    "transport CPU per sample, server: rewardmesh / echo",
                    f"{_us(rm['server_cpu_us_per_sample'])} / {_us(echo['server_cpu_us_per_sample'])}",
                ],
                [
                    "transport CPU per sample, client: rewardmesh / echo",
                    f"{_us(rm['client_cpu_us_per_sample'])} / {_us(echo['client_cpu_us_per_sample'])}",
                ],
                [
                    "transport messages: request / response",
                    f"{rm['request_bytes']:.0f} B / {rm['response_bytes']:.0f} B "
                    f"(echo: {echo['response_bytes']:.0f} B)",
                ],
                [
                    "CPU load of other processes: (a) / (b) / (c) / noop / echo",
                    " / ".join(_cores(x["other_cores"]) for x in (a, b, s, rm, echo)) + " cores",
                ],
            ],
        ),
        "",
        f"Runtime {report['runtime_s']:.0f} s. A missed target is reported, not an error (exit code 0).",
    ]
    labels = {"a": "(a)", "b": "(b)", "c": "(c)", "rm": "transport rewardmesh", "echo": "transport echo"}
    noisy = [labels[k] for k, ok in quiet.items() if not ok]
    if noisy:
        out.append(
            f"**Noisy:** other processes kept >= {QUIET_CORES} cores busy during the best round of "
            f"{', '.join(noisy)}, so those numbers (and the ratios built on them) are not reliable. (a) suffers "
            "most: its two torch threads fill both cores, and a core taken by another process stalls both at "
            "every synchronisation. Re-run on an idle machine."
        )
    for label, phase in (("(b)", b), ("(c)", s), ("transport rewardmesh", rm), ("transport echo", echo)):
        if phase["errors"]:
            out.append(f"{label}: {phase['errors']} errors; first: {phase['first_error']}")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------ isolation


async def run_isolation_only(args: argparse.Namespace) -> dict[str, Any]:
    """The per-sample cost of isolation (reward_engine/isolation.py): the gsm8k rule inline on the event loop
    vs in warm worker processes (isolation="process", 2 workers), the same samples in batches of 1, 8 and 64,
    modes interleaved round by round, medians. Wall time per sample, and this process's CPU per sample (the
    event loop's share: what the server pays; the workers' CPU runs on other cores)."""
    from rewardmesh.reward_engine.sources.rules import RuleSource
    from rewardmesh.reward_engine.types import RewardInput

    empty = np.zeros(0, dtype=np.int32)
    samples = [
        RewardInput(f"s{i}", empty, empty, response_text=f"so the answer is #### {i % 97}", ground_truth=str(i % 89))
        for i in range(args.isolation_samples)
    ]
    sources = {"inline": RuleSource("inline", "gsm8k"), "process": RuleSource("process", "gsm8k", isolation="process")}
    await sources["process"].warmup()
    results: dict[str, dict[int, dict[str, list[float]]]] = {m: {} for m in sources}
    try:
        for batch in (1, 8, 64):
            for _ in range(args.isolation_rounds):
                for mode, source in sources.items():
                    wall, cpu = time.perf_counter(), time.process_time()
                    for lo in range(0, len(samples), batch):
                        await source.score_batch(samples[lo : lo + batch])
                    per = results[mode].setdefault(batch, {"wall_us": [], "cpu_us": []})
                    per["wall_us"].append((time.perf_counter() - wall) / len(samples) * 1e6)
                    per["cpu_us"].append((time.process_time() - cpu) / len(samples) * 1e6)
            progress(f"isolation: batches of {batch} measured")
    finally:
        for source in sources.values():
            await source.close()
    return {
        "machine": ", ".join(f"{k} {v}" for k, v in machine_info().items()),
        "samples": args.isolation_samples,
        "rounds": args.isolation_rounds,
        "medians": {
            mode: {b: {k: statistics.median(v) for k, v in per.items()} for b, per in by_batch.items()}
            for mode, by_batch in results.items()
        },
    }


def render_isolation(report: dict[str, Any]) -> str:
    med = report["medians"]
    lines = [
        f"Machine: {report['machine']}",
        "",
        f"Isolation cost, gsm8k rule, {report['samples']} samples per round, median of {report['rounds']} "
        "interleaved rounds",
        "",
        "| samples per batch | inline wall (us/sample) | process wall | inline CPU (us/sample) | process CPU "
        "(event-loop process) | wall ratio |",
        "|---|---|---|---|---|---|",
    ]
    for batch in sorted(med["inline"]):
        a, b = med["inline"][batch], med["process"][batch]
        lines.append(
            f"| {batch} | {a['wall_us']:.1f} | {b['wall_us']:.1f} | {a['cpu_us']:.1f} | {b['cpu_us']:.1f} "
            f"| {b['wall_us'] / a['wall_us']:.1f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.samples < args.max_batch_size:
        parser.error("--samples must be at least --max-batch-size")
    if args.seq_len < 2:
        parser.error("--seq-len must be at least 2 (a prompt and a response token)")
    if min(args.rounds, args.transport_rounds, args.max_batch_size, args.transport_samples) < 1:
        parser.error("--rounds, --transport-rounds, --max-batch-size and --transport-samples must be >= 1")
    if not 1 <= args.transport_concurrency <= 4096:
        parser.error("--transport-concurrency must be in 1..4096 (the built-in noop pipeline queues 4096 samples)")
    try:
        if args.isolation_only:
            print(render_isolation(asyncio.run(run_isolation_only(args))), flush=True)
            return 0
        if args.servicer_only:
            print(render_servicer(asyncio.run(run_servicer_only(args))), flush=True)
            return 0
        if args.transport_only:
            report = asyncio.run(run_transport_only(args))
            print(render_transport(report), flush=True)
            return 0
        report = asyncio.run(run(args))
    except RuntimeError as exc:  # a server did not start or died: not a measurement
        print(f"bench.reward_batching: {exc}", file=sys.stderr)
        return 1
    report["command"] = " ".join(["python -m bench.reward_batching", *(argv if argv is not None else sys.argv[1:])])
    print(render(report), flush=True)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(report, indent=2, default=str) + "\n")
        progress(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

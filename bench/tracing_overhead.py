"""What telemetry costs a reward server: its CPU per sample and throughput with telemetry off, default, sampled, all.

    python -m bench.tracing_overhead [--samples 30000 --repeats 5] [--reward-model] [--profile DIR]

Each run starts its own reward server process (`--serve`) with that mode's OTEL_* environment: the
OpenTelemetry providers are global and installed once per process. Modes are interleaved (off, default,
ratio, all, all, ratio, ...); medians are reported.

The workload, identical in every mode: the reward server (built-in `gsm8k` rule pipeline: dynamic batches of
up to 256, 4 in flight; or with --reward-model a 4-layer, 256-wide reward model in batches of up to 32, torch
--torch-threads threads) and, in this process, a RewardClient keeping --concurrency samples in flight on one
long-lived Score stream. The client sends what a rollout server sends: a head-sampled sample's traceparent
with the sample (its prompt group's trace, the reward span's id drawn up front; none with telemetry off), and
every --step-size results the step's slowest --keep-slowest samples with their traceparents, named on the
Score stream (`announce_kept`), as a rollout server passes on the trainer's KeepTraces when a step ends. The client
is plain string work, so what is measured is the reward server. Samples carry 64 prompt and 128 response
token ids plus texts.

  off:     OTEL_* unset: the API's no-op tracer and meter, no interceptors, no flight recorder.
  default: setup_telemetry() as a deployment gets it with an exporter configured: OTLP JSON lines to a temp file
           (real serialization and I/O; behind a BatchSpanProcessor for the SDK's spans, fed the flight
           recorder's kept trees directly), a TracerProvider, the gRPC
           OTel interceptors, a MeterProvider whose PeriodicExportingMetricReader exports every second (console
           exporter to a file), every sample's timings in the metrics, span trees for the kept samples (the
           step's slowest, the failed, and the default head-sampling fraction of 1% of groups).
  ratio:   default with head sampling at --sampled-ratio.
  all:     every sample's tree exported (ratio 1.0).

Measured in the server process between two marks around the --samples after --warmup (a full garbage
collection first, so the one that start-up's imports make due does not land in one mode's window): CPU time
per sample (time.process_time: the event loop, gRPC and the telemetry threads, whose part the table also
gives: span builder and exporters), spans exported per sample. Throughput = samples / time from the first
submit to the last result at the client. On a shared machine throughput swings with other work; CPU per
sample much less, and off's CPU / the mode's CPU is the throughput ratio a saturated, CPU-bound reward server
sees, so the targets apply to it: default/off >= 0.9, all/off >= 0.6.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import markdown_table, progress
from bench.mesh import machine_table, median, verdict

TARGET = 0.9
TARGET_ALL = 0.6
MODES = ("off", "default", "ratio", "all")
PIPELINE = "gsm8k"
RM_PIPELINE = "rm"
# Threads that only telemetry runs: the SDK's exporters and the flight recorder's span builder.
TELEMETRY_THREADS = ("Otel", "rewardmesh-span-builder")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.tracing_overhead",
        description="Reward throughput with OpenTelemetry tracing and metrics on vs off, each run in its own process.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    # A run of the rule lasts about a second at 30,000 samples: long enough to hold its share of the periodic
    # telemetry work (a metric export every second, span bursts every 0.2 s); runs of 5,000 (0.15 s) held
    # it or missed it by chance, so their medians moved by +-0.02. (`%(default).0s` prints nothing: it only
    # keeps the help formatter from adding "(default: None)" after the real defaults.)
    p.add_argument(
        "--samples",
        type=int,
        default=None,
        help="samples per measured run (default: 30000 for the rule, 600 with --reward-model)%(default).0s",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="samples before the clock starts, per run (default: 10000; 100 with --reward-model)%(default).0s",
    )
    p.add_argument("--concurrency", type=int, default=256, help="samples in flight on the Score stream")
    p.add_argument("--repeats", type=int, default=5, help="runs per mode (interleaved); medians reported")
    p.add_argument(
        "--sampled-ratio",
        type=float,
        default=0.1,
        help="the `ratio` mode's OTEL_TRACES_SAMPLER_ARG (parentbased_traceidratio; 0: skip the mode)",
    )
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of: " + ", ".join(MODES))
    p.add_argument("--step-size", type=int, default=256, help="finished samples per step (slowest kept per step)")
    p.add_argument("--keep-slowest", type=int, default=4, help="slowest samples kept per step")
    p.add_argument("--metric-interval-ms", type=int, default=1000,
                   help="the metric reader's export interval (the SDK's default, OTEL_METRIC_EXPORT_INTERVAL, is "
                   "60000: 1000 puts a collection and an export in every run)")  # fmt: skip
    p.add_argument("--timeout-s", type=float, default=300.0, help="limit per child run")
    p.add_argument("--reward-model", action="store_true",
                   help="score with a 4-layer, 256-wide reward model instead of the rule")  # fmt: skip
    p.add_argument("--model-dir", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--torch-threads", type=int, default=1, help="the reward server's torch intra-op threads")
    p.add_argument("--profile", type=Path, default=None,
                   help="cProfile each mode's reward server over its measured window into DIR/<mode>.prof")  # fmt: skip
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, default="off", help=argparse.SUPPRESS)
    p.add_argument("--out-dir", type=Path, default=None, help=argparse.SUPPRESS)
    return p


# ------------------------------------------------------------------------------------------------- child


def make_samples(count: int, tag: str) -> list[Any]:
    from rewardmesh.common.tensors import ids_tensor
    from rewardmesh.v1 import common_pb2

    prompt = ids_tensor([(7 * i) % 500 + 3 for i in range(64)])
    response = [(11 * i) % 500 + 3 for i in range(128)]
    out = []
    for i in range(count):
        answer = i % 10
        out.append(
            common_pb2.Sample(
                sample_id=f"{tag}-{i}",
                group_id=f"{tag}-g{i // 8}",
                prompt_ids=prompt,
                response_ids=ids_tensor(response),
                prompt_text="Natalia sold clips to 48 of her friends in April, and then she sold half as many "
                "clips in May. How many clips did Natalia sell altogether in April and May?",
                response_text=f"Natalia sold 48/2 = 24 clips in May. In all she sold 48+24 = 72 clips. #### {answer}",
                data_source="openai/gsm8k",
                ground_truth=str(answer if i % 3 else 72),
            )
        )
    return out


async def drive(
    client: Any,
    samples: Sequence[Any],
    concurrency: int,
    pipeline: str = PIPELINE,
    *,
    head_ratio: float | None = None,
    step_size: int = 256,
    keep_slowest: int = 4,
) -> tuple[float, int]:
    """Keep `concurrency` samples in flight as a rollout server sends them; returns (seconds, errors).

    `head_ratio` None: no trace context (telemetry off). Otherwise a head-sampled sample carries the
    traceparent a rollout server sends (its group's trace id, the reward span's id drawn up front), and every
    `step_size` results the step's slowest `keep_slowest` are named on the stream with theirs
    (`announce_kept`), as a rollout server passes on the trainer's KeepTraces when a step ends. Plain string
    work: the load generator's own telemetry is not what is measured.
    """
    from rewardmesh.common.flight_recorder import new_span_id, new_trace_id, traceparent

    loop = asyncio.get_running_loop()
    slots = asyncio.Semaphore(concurrency)
    done = loop.create_future()
    state = {"left": len(samples), "errors": 0}
    step: list[tuple[float, str]] = []
    parents: dict[str, tuple[int, int]] = {}  # unsampled samples' (trace id, reward span id), until kept
    keeping: list[asyncio.Task[Any]] = []
    rng = random.Random(1234)

    def end_step() -> None:
        ids = [sid for _, sid in sorted(step, reverse=True)[:keep_slowest]]
        step.clear()
        if ids and keep_slowest and head_ratio is not None:  # as a rollout server does: with their traceparents
            kept = {sid: traceparent(*parents.pop(sid), False) for sid in ids if sid in parents}
            keeping.append(loop.create_task(client.announce_kept(kept)))

    def finished(sid: str, fut: asyncio.Future[Any]) -> None:
        result = fut.result()
        if result.HasField("error"):
            state["errors"] += 1
        slots.release()
        state["left"] -= 1
        step.append((result.timing.total, sid))
        if len(step) >= step_size or state["left"] == 0:
            end_step()
        if state["left"] == 0 and not done.done():
            done.set_result(None)

    group_trace, sampled = 0, False
    started = time.perf_counter()
    for i, sample in enumerate(samples):
        await slots.acquire()
        sid = sample.sample_id
        ctx = None
        if head_ratio is not None:
            if i % 8 == 0:  # a prompt group of 8: one trace, one head-sampling decision
                group_trace, sampled = new_trace_id(), rng.random() < head_ratio
            if sampled:  # sent with the sample only when head-sampled, as a rollout server does
                ctx = {"traceparent": traceparent(group_trace, new_span_id(), True)}
            else:  # the ids drawn up front; the traceparent goes with the keep decision if the sample is kept
                parents[sid] = (group_trace, new_span_id())
        fut = client.submit(sample, pipeline, trace_context=ctx)
        fut.add_done_callback(lambda f, sid=sid: finished(sid, f))
    if samples:
        await done
    elapsed = time.perf_counter() - started
    await asyncio.gather(*keeping)
    return elapsed, state["errors"]


class _Counting:
    """Counts spans ended (the SDK's spans by a SpanProcessor, kept trees by the flight recorder: handed to the
    exporters or dropped) and spans exported (wrapping the exporter)."""

    def __init__(self) -> None:
        self.sdk_ended = 0
        self.exported = 0
        self.telemetry: Any = None

    @property
    def ended(self) -> int:
        rec = self.telemetry.recorder if self.telemetry is not None else None
        return self.sdk_ended + (rec.exported_spans + rec.dropped_spans if rec is not None else 0)


def telemetry_on(out_dir: Path, counts: _Counting, interval_ms: int = 1000) -> Any:
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
    from opentelemetry.sdk.trace.export import SpanExportResult

    from rewardmesh.common.flight_recorder import SpanBlock
    from rewardmesh.common.otlp_json import OtlpJsonLinesExporter
    from rewardmesh.common.telemetry import setup_telemetry

    class CountingExporter(OtlpJsonLinesExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            counts.exported += len(spans)
            return super().export(spans)

        def export_blocks(self, resource: Resource, blocks: Sequence[SpanBlock]) -> SpanExportResult:
            counts.exported += sum(map(len, blocks))
            return super().export_blocks(resource, blocks)

    class EndCounter(SpanProcessor):
        def on_end(self, span: ReadableSpan) -> None:
            counts.sdk_ended += 1

    metrics_file = (out_dir / "metrics.jsonl").open("w")
    reader = PeriodicExportingMetricReader(ConsoleMetricExporter(out=metrics_file), export_interval_millis=interval_ms)
    # As a deployment configures it (OTEL_TRACES_EXPORTER): the exporter behind the SDK's batch processor for its
    # own spans, fed the flight recorder's kept trees directly. The counter sees the SDK's spans only.
    telemetry = setup_telemetry("bench", span_exporters=[CountingExporter(out_dir / "spans.jsonl")],
                                metric_readers=[reader])  # fmt: skip
    telemetry.tracer_provider.add_span_processor(EndCounter())  # type: ignore[union-attr]
    counts.telemetry = telemetry
    return telemetry


async def serve(args: argparse.Namespace) -> None:
    """The reward server process of one run: telemetry per --mode, then commands on stdin, answers on stdout.

    `mark`: this process's CPU seconds (all threads: event loop, gRPC, exporters) and span counts so far;
    `stop`: stop, flush the span queue, report. With --profile, cProfile covers the first to the second mark.
    """
    import gc
    import logging

    logging.basicConfig(level=logging.WARNING)
    out_dir: Path = args.out_dir
    counts = _Counting()
    if args.mode != "off":
        telemetry = telemetry_on(out_dir, counts, args.metric_interval_ms)
        assert telemetry.tracing and telemetry.metrics, "telemetry was already installed in this process"
    else:
        from rewardmesh.common.telemetry import setup_telemetry

        telemetry = setup_telemetry("bench")  # OTEL_* unset: installs nothing
        assert not telemetry.tracing and not telemetry.metrics
    import torch

    torch.set_num_threads(args.torch_threads)
    from rewardmesh.server.reward.server import RewardServer, build_engine
    from rewardmesh.server.serving import ServerOptions

    config = None
    if args.model_dir:  # a realistic reward cost: the 4-layer, 256-wide reward model, dynamically batched
        config = {RM_PIPELINE: {"sources": [{"type": "model", "path": str(args.model_dir)}],
                                "batching": {"max_batch_size": 32, "max_queue_delay_ms": 2}}}  # fmt: skip
    server = RewardServer(build_engine(config), ServerOptions(host="127.0.0.1", port=0, grace_s=2))
    await server.start()
    say = lambda **kw: print(json.dumps(kw), flush=True)  # noqa: E731
    say(address=server.address)
    loop = asyncio.get_running_loop()
    profiler: Any = None
    marks = 0
    while (line := (await loop.run_in_executor(None, sys.stdin.readline)).strip()) not in ("stop", ""):
        if line == "mark":
            marks += 1
            if telemetry.recorder is not None:  # the kept spans of the samples so far built and exported now, so a
                telemetry.recorder.flush_deferred()  # window holds exactly the work for its own samples
            if marks == 1:  # steady state: the full collection that start-up's imports make due happens now,
                gc.collect()  # not at a random point of one mode's measured window
            if args.profile and marks == 1:
                import cProfile

                profiler = cProfile.Profile()
                profiler.enable()
            elif profiler is not None and marks == 2:
                profiler.disable()
                profiler.dump_stats(str(args.profile))
            say(cpu_s=time.process_time(), threads=thread_cpu(), ended=counts.ended, exported=counts.exported)
    await server.stop(grace=1)
    t = time.perf_counter()
    telemetry.shutdown()  # flushes what the span queue still holds
    flush_s = time.perf_counter() - t
    spans = out_dir / "spans.jsonl"
    say(flush_s=flush_s, ended=counts.ended, exported=counts.exported,
        span_bytes=spans.stat().st_size if spans.exists() else 0)  # fmt: skip


def thread_cpu() -> dict[str, float]:
    """CPU seconds per thread name of this process (Linux /proc; empty elsewhere): where telemetry's cost is."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for task in Path("/proc/self/task").glob("*"):
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = names.get(int(task.name)) or stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


class ServerProcess:
    """One run's reward server in its own process (its mode's OTEL_* environment), driven over stdin/stdout."""

    def __init__(self, args: argparse.Namespace, mode: str, out_dir: Path, profile: Path | None = None) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update(OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none", PYTHONUNBUFFERED="1")
        env.update(OMP_NUM_THREADS=str(args.torch_threads))
        ratio = head_ratio(args, mode)
        if ratio is not None:
            env.update(OTEL_TRACES_SAMPLER="parentbased_traceidratio", OTEL_TRACES_SAMPLER_ARG=str(ratio))
        env["REWARDMESH_TRACE_KEEP_SLOWEST"] = str(args.keep_slowest)
        argv = [sys.executable, "-m", "bench.tracing_overhead", "--serve", "--mode", mode, "--out-dir", str(out_dir)]
        argv += ["--torch-threads", str(args.torch_threads), "--metric-interval-ms", str(args.metric_interval_ms)]
        if args.model_dir:
            argv += ["--model-dir", str(args.model_dir)]
        if profile is not None:
            argv += ["--profile", str(profile)]
        self.mode = mode
        self.timeout_s = args.timeout_s
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.address = self._answer()["address"]

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while line := self.proc.stdout.readline():
            if line.startswith("{"):
                return dict(json.loads(line))
        raise RuntimeError(f"reward server ({self.mode}) exited with {self.proc.wait(self.timeout_s)}")

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> dict[str, Any]:
        try:
            return self.ask("stop")
        finally:
            self.proc.wait(self.timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def head_ratio(args: argparse.Namespace, mode: str) -> float | None:
    """The trainer's head-sampling ratio in this mode (None: telemetry off, no trace context sent)."""
    from rewardmesh.common.telemetry import DEFAULT_HEAD_RATIO

    return {"off": None, "default": DEFAULT_HEAD_RATIO, "ratio": args.sampled_ratio, "all": 1.0}[mode]


async def one_run(args: argparse.Namespace, mode: str, out_dir: Path, profile: Path | None = None) -> dict[str, Any]:
    """Start this mode's reward server, warm it up, measure --samples, stop it; the numbers of the run."""
    from rewardmesh.client.reward_client import RewardClient

    server = await asyncio.to_thread(ServerProcess, args, mode, out_dir, profile)
    pipeline = RM_PIPELINE if args.model_dir else PIPELINE
    ratio = head_ratio(args, mode)
    kw = {"head_ratio": ratio, "step_size": args.step_size, "keep_slowest": args.keep_slowest}
    try:
        async with RewardClient([server.address]) as client:
            await drive(client, make_samples(args.warmup, "warm"), args.concurrency, pipeline, **kw)
            samples = make_samples(args.samples, "run")
            before = server.ask("mark")
            elapsed, errors = await drive(client, samples, args.concurrency, pipeline, **kw)
            after = server.ask("mark")
        final = await asyncio.to_thread(server.close)
    finally:
        server.kill()
    return {
        "mode": mode,
        "samples": args.samples,
        "elapsed_s": elapsed,
        "throughput": args.samples / elapsed,
        "cpu_us_per_sample": (after["cpu_s"] - before["cpu_s"]) / args.samples * 1e6,
        "errors": errors,
        "spans_per_sample": (after["ended"] - before["ended"]) / args.samples,
        "threads_us_per_sample": {
            k: (v - before["threads"].get(k, 0.0)) / args.samples * 1e6 for k, v in after["threads"].items()
        },
        "spans_ended": final["ended"],
        "spans_exported": final["exported"],
        "span_bytes": final["span_bytes"],
        "flush_s": final["flush_s"],
    }


# ------------------------------------------------------------------------------------------------ parent


@dataclass
class Run:
    mode: str
    throughput: float
    cpu_us: float
    elapsed_s: float
    errors: int
    spans_per_sample: float
    dropped: int
    span_mb: float
    flush_s: float
    threads: dict[str, float]


def run_child(args: argparse.Namespace, mode: str, out_dir: Path) -> Run:
    """One run: this mode's reward server in a fresh process, this process as its client."""
    profile = args.profile / f"{mode}.prof" if args.profile else None
    if profile is not None:
        profile.parent.mkdir(parents=True, exist_ok=True)
    r = asyncio.run(asyncio.wait_for(one_run(args, mode, out_dir, profile), args.timeout_s))
    return Run(
        mode=mode,
        throughput=r["throughput"],
        cpu_us=r["cpu_us_per_sample"],
        elapsed_s=r["elapsed_s"],
        errors=r["errors"],
        spans_per_sample=r["spans_per_sample"],
        dropped=r["spans_ended"] - r["spans_exported"],
        span_mb=r["span_bytes"] / 1e6,
        flush_s=r["flush_s"],
        threads=r["threads_us_per_sample"],
    )


def parent(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="rewardmesh-trace-") as tmp:
        chosen = {m.strip() for m in args.modes.split(",")} | {"off"}  # off: what every ratio is against
        modes = [m for m in MODES if m in chosen and (m != "ratio" or args.sampled_ratio > 0)]
        for rep in range(args.repeats):
            for mode in modes if rep % 2 == 0 else modes[::-1]:
                out_dir = Path(tmp) / f"{mode}{rep}"
                out_dir.mkdir()
                run = run_child(args, mode, out_dir)
                runs.append(run)
                extra = f", {run.spans_per_sample:.2f} spans/sample, {run.dropped} dropped" if mode != "off" else ""
                progress(
                    f"repeat {rep + 1}/{args.repeats} tracing {mode}: {run.throughput:,.0f} samples/s, "
                    f"{run.cpu_us:.0f} us CPU/sample{extra}"
                )
    wall = time.perf_counter() - started
    print(report(args, runs, wall))
    return 0


def report(args: argparse.Namespace, runs: list[Run], wall: float) -> str:
    by_mode: dict[str, list[Run]] = {}
    for r in runs:
        by_mode.setdefault(r.mode, []).append(r)
    off = by_mode["off"]
    off_tp = median([r.throughput for r in off])
    off_cpu = median([r.cpu_us for r in off])
    label = {
        "off": "off",
        "default": "default (metrics for all, kept trees)",
        "ratio": f"ratio {args.sampled_ratio:g}",
        "all": "ratio 1.0 (every tree)",
    }
    targets = {"default": TARGET, "all": TARGET_ALL}
    config = {
        "workload": f"{args.samples} samples per run ({args.warmup} warm-up) through "
        + (
            "a 4-layer, 256-wide reward model (batches of up to 32)"
            if args.model_dir
            else f"the built-in `{PIPELINE}` rule"
        )
        + f" pipeline, {args.concurrency} in flight on one Score stream; the reward server in its own process"
        + (f" (torch threads: {args.torch_threads})" if args.model_dir else ""),
        "telemetry on": "TracerProvider, OTLP JSON lines file exporter (SDK spans via a BatchSpanProcessor, kept trees "
        "from the flight recorder), gRPC OTel interceptors, "
        f"MeterProvider + PeriodicExportingMetricReader ({args.metric_interval_ms / 1000:g} s, console exporter to a "
        "file), flight recorder; "
        f"steps of {args.step_size} samples, slowest {args.keep_slowest} kept per step (named on the Score stream)",
        "telemetry off": "no providers installed (OTEL_* unset): the API's no-op tracer and meter",
        "runs": f"{args.repeats} per mode, each with a fresh reward server process, interleaved; medians",
        "CPU us/sample": "the reward server process's CPU time (all threads) over the measured samples",
        "wall time": f"{wall:.0f}s",
    }
    rows = []
    results = []
    for mode, rs in by_mode.items():
        tp = median([r.throughput for r in rs])
        cpu = median([r.cpu_us for r in rs])
        # Runs of the same repeat ran back to back, under the most similar machine conditions.
        pairs = [b.throughput / a.throughput for a, b in zip(off, rs, strict=True)]
        traced = mode != "off"
        rows.append(
            [
                label[mode],
                f"{tp:,.0f}",
                " ".join(f"{r.throughput:,.0f}" for r in rs),
                _us(cpu),
                _us(cpu - off_cpu, "+") if traced else "",
                _us(median([sum(v for k, v in r.threads.items() if k.startswith(TELEMETRY_THREADS)) for r in rs])),
                f"{median([r.spans_per_sample for r in rs]):.3f}" if traced else "",
                f"{sum(r.dropped for r in rs)}" if traced else "",
                f"{median([r.flush_s for r in rs]):.2f}" if traced else "",
            ]
        )
        if traced:
            ratio = tp / off_tp
            cpu_ratio = off_cpu / cpu
            cpu_pairs = median([a.cpu_us / b.cpu_us for a, b in zip(off, rs, strict=True)])
            target = targets.get(mode)
            verdict_s = f">= {target}: {verdict(cpu_ratio >= target)}" if target else "(informative)"
            results.append([f"{label[mode]} / off", f"{ratio:.3f}", f"{median(pairs):.3f}", f"{cpu_ratio:.3f}",
                            f"{cpu_pairs:.3f}", verdict_s])  # fmt: skip
    results.append(["errors", str(sum(r.errors for r in runs)), "", "", "", ""])
    return "\n\n".join(
        [
            "## bench.tracing_overhead",
            machine_table(config),
            markdown_table(
                [
                    "telemetry",
                    "samples/s (median)",
                    "runs",
                    "CPU us/sample",
                    "vs off",
                    "of it telemetry threads",
                    "spans exported/sample",
                    "spans dropped",
                    "flush after run s",
                ],
                rows,
            ),
            markdown_table(
                [
                    "ratio",
                    "throughput (medians)",
                    "throughput (back-to-back pairs)",
                    "CPU: off / mode (medians)",
                    "CPU (back-to-back pairs)",
                    "target (CPU, medians)",
                ],
                results,
            ),
        ]
    )


def _us(x: float, sign: str = "") -> str:
    """Microseconds: a tenth where a rule's few microseconds are compared, whole ones for a model's thousands."""
    return f"{x:{sign}.1f}" if abs(x) < 100 else f"{x:{sign}.0f}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.samples is None:
        args.samples = 600 if args.reward_model else 30000
    if args.warmup is None:
        args.warmup = 100 if args.reward_model else 10000
    if args.samples < 1 or args.repeats < 1 or args.concurrency < 1 or args.warmup < 0:
        raise SystemExit("--samples, --repeats, --concurrency must be >= 1 and --warmup >= 0")
    if args.serve:
        asyncio.run(serve(args))
        return 0
    if args.reward_model and args.model_dir is None:  # the same model bench.reward_batching builds and caches
        from bench.reward_batching import build_parser as batching_parser
        from bench.reward_batching import ensure_model

        args.model_dir = ensure_model(batching_parser().parse_args([]))
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())

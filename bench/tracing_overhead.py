"""What OpenTelemetry costs the reward service: throughput with tracing on vs off (issue 5's benchmark).

    python -m bench.tracing_overhead [--samples 6000 --repeats 5 --sampled-ratio 0.1]

OpenTelemetry's providers are global and installed once per process, so every measurement runs in a fresh
subprocess of this module (`--child`), modes interleaved (off, on, sampled, sampled, on, off, ...), medians
reported.

The workload, identical in both modes: a reward server (built-in `gsm8k` rule pipeline: dynamic batches of up
to 256, 4 in flight) and a RewardClient in the same process; the client keeps --concurrency samples in flight
on its one long-lived Score stream and, like the rollout server does, opens a `reward` span per sample and
sends that sample's own trace context with it. Samples carry 64 prompt and 128 response token ids plus texts.

  off: what a process gets with OTEL_* unset: the API's no-op tracer and meter (no interceptors either).
  on:  setup_telemetry() with a TracerProvider (always-on sampling), a BatchSpanProcessor exporting every span
       as OTLP JSON lines to a temp file (real serialization and I/O), OpenTelemetry's gRPC client and server
       interceptors, and a MeterProvider whose PeriodicExportingMetricReader exports every second (console
       exporter to a file). Per sample that is the client's `reward` span, the server's `reward.queue` and
       `reward.compute` spans, histogram and counter updates, and per batch a `reward.batch` span with links.
  sampled (informative, --sampled-ratio): `on` with OTEL_TRACES_SAMPLER=parentbased_traceidratio.

Throughput = samples / time from the first submit to the last result (spans still queued are flushed after
the clock stops; the table says how long that took and whether the span queue dropped anything).
Target: on/off >= 0.9.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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
PIPELINE = "gsm8k"
RM_PIPELINE = "rm"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.tracing_overhead",
        description="Reward throughput with OpenTelemetry tracing and metrics on vs off, each run in its own process.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--samples", type=int, default=6000, help="samples per measured run")
    p.add_argument("--warmup", type=int, default=1000, help="samples before the clock starts, per run")
    p.add_argument("--concurrency", type=int, default=256, help="samples in flight on the Score stream")
    p.add_argument("--repeats", type=int, default=5, help="runs per mode (interleaved); medians reported")
    p.add_argument(
        "--sampled-ratio",
        type=float,
        default=0.1,
        help="also measure tracing on with OTEL_TRACES_SAMPLER=parentbased_traceidratio at this ratio (0: skip)",
    )
    p.add_argument("--timeout-s", type=float, default=300.0, help="limit per child run")
    p.add_argument("--reward-model", action="store_true",
                   help="score with a 4-layer, 256-wide reward model instead of the rule")  # fmt: skip
    p.add_argument("--model-dir", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=["on", "off", "sampled"], default="off", help=argparse.SUPPRESS)
    p.add_argument("--out-dir", type=Path, default=None, help=argparse.SUPPRESS)
    return p


# ------------------------------------------------------------------------------------------------- child


def make_samples(count: int, tag: str) -> list[Any]:
    from client.tensors import ids_tensor
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


async def drive(client: Any, samples: Sequence[Any], concurrency: int, pipeline: str = PIPELINE) -> tuple[float, int]:
    """Keep `concurrency` samples in flight, each under its own `reward` span; returns (seconds, errors)."""
    from opentelemetry import trace

    from client.telemetry import inject, tracer

    loop = asyncio.get_running_loop()
    slots = asyncio.Semaphore(concurrency)
    done = loop.create_future()
    state = {"left": len(samples), "errors": 0}

    def finished(span: Any, fut: asyncio.Future[Any]) -> None:
        result = fut.result()
        if result.HasField("error"):
            state["errors"] += 1
        else:
            span.set_attribute("rewardmesh.score", result.score)
        span.end()
        slots.release()
        state["left"] -= 1
        if state["left"] == 0 and not done.done():
            done.set_result(None)

    started = time.perf_counter()
    for sample in samples:
        await slots.acquire()
        span = tracer().start_span("reward", attributes={"rewardmesh.sample_id": sample.sample_id})
        carrier = inject(trace.set_span_in_context(span))
        fut = client.submit(sample, pipeline, trace_context=carrier)
        fut.add_done_callback(lambda f, span=span: finished(span, f))
    if samples:
        await done
    return time.perf_counter() - started, state["errors"]


class _Counting:
    """Counts spans ended (a SpanProcessor) and spans exported (wrapping the exporter)."""

    def __init__(self) -> None:
        self.ended = 0
        self.exported = 0


def telemetry_on(out_dir: Path, counts: _Counting) -> Any:
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader
    from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult

    from client.telemetry import OtlpJsonLinesExporter, setup_telemetry

    class CountingExporter(OtlpJsonLinesExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            counts.exported += len(spans)
            return super().export(spans)

    class EndCounter(SpanProcessor):
        def on_end(self, span: ReadableSpan) -> None:
            counts.ended += 1

    metrics_file = (out_dir / "metrics.jsonl").open("w")
    reader = PeriodicExportingMetricReader(ConsoleMetricExporter(out=metrics_file), export_interval_millis=1000)
    spans = BatchSpanProcessor(CountingExporter(out_dir / "spans.jsonl"))
    return setup_telemetry("bench", span_processors=[spans, EndCounter()], metric_readers=[reader])


async def child(args: argparse.Namespace) -> dict[str, Any]:
    import logging

    logging.basicConfig(level=logging.WARNING)
    if args.out_dir is None:  # run by hand: keep the span and metric files only for the run
        with tempfile.TemporaryDirectory(prefix="rewardmesh-trace-") as tmp:
            args.out_dir = Path(tmp)
            return await child(args)
    out_dir: Path = args.out_dir
    counts = _Counting()
    if args.mode in ("on", "sampled"):
        telemetry = telemetry_on(out_dir, counts)
        assert telemetry.tracing and telemetry.metrics, "telemetry was already installed in this process"
    else:
        from client.telemetry import setup_telemetry

        telemetry = setup_telemetry("bench")  # OTEL_* unset: installs nothing
        assert not telemetry.tracing and not telemetry.metrics
    from client.reward_client import RewardClient
    from server.reward_server import RewardServer, build_engine
    from server.serving import ServerOptions

    pipeline = PIPELINE
    config = None
    if args.model_dir:  # a realistic reward cost: the 4-layer, 256-wide reward model, dynamically batched
        pipeline = RM_PIPELINE
        config = {RM_PIPELINE: {"sources": [{"type": "model", "path": str(args.model_dir)}],
                                "batching": {"max_batch_size": 32, "max_queue_delay_ms": 2}}}  # fmt: skip
    server = RewardServer(build_engine(config), ServerOptions(host="127.0.0.1", port=0, grace_s=2))
    await server.start()
    try:
        async with RewardClient([server.address]) as client:
            await drive(client, make_samples(args.warmup, "warm"), args.concurrency, pipeline)
            samples = make_samples(args.samples, "run")
            ended_before = counts.ended
            cpu = time.process_time()
            elapsed, errors = await drive(client, samples, args.concurrency, pipeline)
            cpu = time.process_time() - cpu
            spans_in_run = counts.ended - ended_before
    finally:
        await server.stop(grace=1)
    t = time.perf_counter()
    telemetry.shutdown()  # flushes what the span queue still holds
    flush_s = time.perf_counter() - t
    span_bytes = (out_dir / "spans.jsonl").stat().st_size if (out_dir / "spans.jsonl").exists() else 0
    return {
        "mode": args.mode,
        "samples": args.samples,
        "elapsed_s": elapsed,
        "throughput": args.samples / elapsed,
        "cpu_us_per_sample": cpu / args.samples * 1e6,
        "errors": errors,
        "spans_per_sample": spans_in_run / args.samples,
        "spans_ended": counts.ended,
        "spans_exported": counts.exported,
        "span_bytes": span_bytes,
        "flush_s": flush_s,
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


def run_child(args: argparse.Namespace, mode: str, out_dir: Path) -> Run:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none", PYTHONUNBUFFERED="1")
    if mode == "sampled":
        env.update(OTEL_TRACES_SAMPLER="parentbased_traceidratio", OTEL_TRACES_SAMPLER_ARG=str(args.sampled_ratio))
    argv = [sys.executable, "-m", "bench.tracing_overhead", "--child", "--mode", mode, "--out-dir", str(out_dir)]
    argv += ["--samples", str(args.samples), "--warmup", str(args.warmup), "--concurrency", str(args.concurrency)]
    if args.model_dir:
        argv += ["--model-dir", str(args.model_dir)]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=args.timeout_s, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"child ({mode}) exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    r = json.loads(lines[-1])
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
    )


def parent(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="rewardmesh-trace-") as tmp:
        modes = ["off", "on", *(["sampled"] if args.sampled_ratio > 0 else [])]
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
    label = {"off": "off", "on": "on (every sample traced)", "sampled": f"on, {args.sampled_ratio:g} sampled"}
    config = {
        "workload": f"{args.samples} samples per run ({args.warmup} warm-up) through "
        + (
            "a 4-layer, 256-wide reward model (batches of up to 32)"
            if args.model_dir
            else f"the built-in `{PIPELINE}` rule"
        )
        + f" pipeline, {args.concurrency} in flight on one Score stream (RewardClient and server in one process)",
        "tracing on": "TracerProvider + BatchSpanProcessor -> OTLP JSON lines file, gRPC OTel interceptors, "
        "MeterProvider + PeriodicExportingMetricReader (1 s, console exporter to a file); sampler always on, "
        f"or parentbased_traceidratio {args.sampled_ratio:g} for the sampled row",
        "tracing off": "no providers installed (OTEL_* unset): the API's no-op tracer and meter",
        "runs": f"{args.repeats} per mode, each in a fresh subprocess, interleaved; medians",
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
                f"{cpu:.0f}",
                f"{cpu - off_cpu:+.0f}" if traced else "",
                f"{median([r.spans_per_sample for r in rs]):.2f}" if traced else "",
                f"{sum(r.dropped for r in rs)}" if traced else "",
                f"{median([r.flush_s for r in rs]):.2f}" if traced else "",
            ]
        )
        if traced:
            ratio = tp / off_tp
            target = f">= {TARGET}: {verdict(ratio >= TARGET)}" if mode == "on" else "(informative)"
            results.append([f"{label[mode]} / off", f"{ratio:.3f}", f"{median(pairs):.3f}", target])
    results.append(["errors", str(sum(r.errors for r in runs)), "", ""])
    return "\n\n".join(
        [
            "## bench.tracing_overhead",
            machine_table(config),
            markdown_table(
                [
                    "tracing",
                    "samples/s (median)",
                    "runs",
                    "CPU us/sample",
                    "vs off",
                    "spans/sample",
                    "spans dropped",
                    "flush after run s",
                ],
                rows,
            ),
            markdown_table(["throughput ratio", "of medians", "median of back-to-back pairs", "target"], results),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.samples < 1 or args.repeats < 1 or args.concurrency < 1 or args.warmup < 0:
        raise SystemExit("--samples, --repeats, --concurrency must be >= 1 and --warmup >= 0")
    if args.child:
        print(json.dumps(asyncio.run(child(args))), flush=True)
        return 0
    if args.reward_model and args.model_dir is None:  # the same model bench.reward_batching builds and caches
        from bench.reward_batching import build_parser as batching_parser
        from bench.reward_batching import ensure_model

        args.model_dir = ensure_model(batching_parser().parse_args([]))
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())

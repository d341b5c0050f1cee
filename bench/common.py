"""Shared benchmark helpers: the bare echo baseline server, the load generator, CPU accounting, tables.

The echo server lives here too and runs as its own process:

    python -m bench.common echo-server --host 127.0.0.1 --port 0

It implements RewardService.Score as the thinnest possible grpc.aio handler (read a request, answer a
RewardResult of the same shape a rewardmesh `noop` result has, no engine, no batcher, no interceptor),
so the transport benchmark can tell rewardmesh's own per-sample cost from gRPC's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import platform
import signal
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from grpc import aio
from tqdm import tqdm

from rewardmesh.client.reward_client import RewardClient
from rewardmesh.v1 import common_pb2, reward_pb2, reward_pb2_grpc

log = logging.getLogger(__name__)


def progress(message: str) -> None:
    """A short progress line on stderr (stdout carries only the result table)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------- CPU accounting


@dataclass
class CpuSnapshot:
    wall: float
    busy_s: float  # all CPUs, every process on the machine (steal included: time the hypervisor took)
    procs: dict[int, tuple[float, float]]  # pid -> CPU seconds of (all its threads, its main thread)


@dataclass
class CpuUsage:
    """CPU spent between two snapshots: by the watched processes, and by every other process (noise)."""

    wall_s: float
    other_cores: float  # mean cores kept busy by processes other than the watched ones
    process_s: dict[int, float]  # pid -> CPU seconds, all threads
    main_thread_s: dict[int, float]  # pid -> CPU seconds of the main thread (an asyncio server's event loop)


def _proc_cpu(pid: int, tick: int) -> tuple[float, float] | None:
    def read(path: str) -> float:
        stat = Path(path).read_text().rsplit(")", 1)[1].split()
        return (int(stat[11]) + int(stat[12])) / tick  # utime + stime

    try:
        return read(f"/proc/{pid}/stat"), read(f"/proc/{pid}/task/{pid}/stat")
    except (OSError, ValueError, IndexError):
        return None


def cpu_snapshot(pids: Sequence[int] = ()) -> CpuSnapshot | None:
    """Machine-wide busy CPU time, and CPU time of this process and `pids` (Linux /proc; None elsewhere)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None
    procs = {}
    for pid in {os.getpid(), *pids}:
        if pid > 0 and (cpu := _proc_cpu(pid, tick)) is not None:
            procs[pid] = cpu
    busy = (user + nice + system + irq + softirq + steal) / tick
    return CpuSnapshot(time.monotonic(), busy, procs)


def cpu_usage(before: CpuSnapshot | None, after: CpuSnapshot | None) -> CpuUsage | None:
    if before is None or after is None or after.wall <= before.wall:
        return None
    pids = before.procs.keys() & after.procs.keys()
    process_s = {pid: after.procs[pid][0] - before.procs[pid][0] for pid in pids}
    main_s = {pid: after.procs[pid][1] - before.procs[pid][1] for pid in pids}
    wall = after.wall - before.wall
    other = max(0.0, (after.busy_s - before.busy_s - sum(process_s.values())) / wall)
    return CpuUsage(wall, other, process_s, main_s)


# ---------------------------------------------------------------------------------------------- load generation


@dataclass
class RunStats:
    """What one load phase measured, client side, plus what the server reported per sample."""

    name: str
    samples: int
    concurrency: int
    elapsed_s: float
    latencies_s: np.ndarray
    results: list[reward_pb2.RewardResult] = field(repr=False)
    cpu: CpuUsage | None = None  # set by the caller: CPU of the client, the server and everything else

    @property
    def other_cores(self) -> float | None:
        """CPU load of unrelated processes during the phase (a noise indicator)."""
        return self.cpu.other_cores if self.cpu is not None else None

    def cpu_us_per_sample(self, pid: int, *, main_thread: bool = False) -> float | None:
        """CPU microseconds per sample of process `pid` (or of its main thread) during the phase."""
        if self.cpu is None or not self.samples:
            return None
        table = self.cpu.main_thread_s if main_thread else self.cpu.process_s
        return table[pid] / self.samples * 1e6 if pid in table else None

    @property
    def throughput(self) -> float:
        return self.samples / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def errors(self) -> list[str]:
        return [f"{r.sample_id}: {r.error.code} {r.error.message}" for r in self.results if r.HasField("error")]

    def latency_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies_s, q) * 1000.0) if self.latencies_s.size else 0.0

    @property
    def batch_sizes(self) -> np.ndarray:
        return np.fromiter((r.batch_size for r in self.results), dtype=np.float64, count=len(self.results))

    @property
    def mean_batch_size(self) -> float:
        """Mean over batches (each sample reports its batch's size, so a batch of k counts k times 1/k)."""
        bs = self.batch_sizes
        bs = bs[bs > 0]
        return float(bs.size / np.sum(1.0 / bs)) if bs.size else 0.0

    def full_batch_fraction(self, full: int) -> float:
        bs = self.batch_sizes
        return float(np.mean(bs >= full)) if bs.size else 0.0

    def server_compute_s(self) -> float:
        """Total time the server's source spent computing batches (each batch counted once)."""
        return float(sum(r.timing.compute / r.batch_size for r in self.results if r.batch_size > 0))

    def mean_server_ms(self, what: str) -> float:
        values = [getattr(r.timing, what) for r in self.results if not r.HasField("error")]
        return float(np.mean(values) * 1000.0) if values else 0.0

    def full_batch_compute_ms(self, full: int) -> float:
        """Median compute time of the server's full batches."""
        values = [r.timing.compute for r in self.results if r.batch_size >= full]
        return float(np.median(values) * 1000.0) if values else 0.0

    def response_bytes(self, limit: int = 1000) -> float:
        sizes = [r.ByteSize() for r in self.results[:limit]]
        return float(np.mean(sizes)) if sizes else 0.0


class _Progress:
    """A tqdm bar refreshed from a timer, so the per-sample hot path only bumps a counter."""

    def __init__(self, desc: str, total: int, disable: bool) -> None:
        self.done = 0
        self._bar = tqdm(total=total, desc=desc, unit="sample", file=sys.stderr, disable=disable, leave=False)
        self._task: asyncio.Task[None] | None = None

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            self._bar.update(self.done - self._bar.n)

    def __enter__(self) -> _Progress:
        self._task = asyncio.get_running_loop().create_task(self._refresh())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
        self._bar.update(self.done - self._bar.n)
        self._bar.close()


async def drive_concurrent(
    client: RewardClient,
    samples: Sequence[common_pb2.Sample],
    reward: str,
    *,
    concurrency: int,
    name: str,
    show_progress: bool = True,
) -> RunStats:
    """Submit samples one by one on the client's Score stream, keeping at most `concurrency` in flight.

    Every sample is its own `RewardClient.submit()` (as a rollout server sends each sample the moment it
    finishes); a done-callback records its latency and frees a slot. Elapsed time runs from the first
    submit to the last result.
    """
    n = len(samples)
    loop = asyncio.get_running_loop()
    # Free slots as a counter and one waiter, not an asyncio.Semaphore: Python 3.11's Semaphore.acquire scans
    # every waiter (locked()), which at 1024 in flight cost the load generator more than the client it drives.
    free = concurrency
    waiter: asyncio.Future[None] | None = None
    sent = np.zeros(n)
    finished = np.zeros(n)
    results: list[reward_pb2.RewardResult | None] = [None] * n
    all_done: asyncio.Future[None] = loop.create_future()
    clock = time.perf_counter

    with _Progress(name, n, not show_progress) as bar:

        def on_done(i: int, fut: asyncio.Future[reward_pb2.RewardResult]) -> None:
            nonlocal free
            finished[i] = clock()
            free += 1
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
            if fut.cancelled():
                results[i] = reward_pb2.RewardResult(
                    sample_id=samples[i].sample_id, error=common_pb2.Status(code=1, message="cancelled")
                )
            else:
                results[i] = fut.result()
            bar.done += 1
            if bar.done == n and not all_done.done():
                all_done.set_result(None)

        start = clock()
        for i, sample in enumerate(samples):
            while not free:
                waiter = loop.create_future()
                await waiter
                waiter = None
            free -= 1
            sent[i] = clock()
            client.submit(sample, reward).add_done_callback(functools.partial(on_done, i))
        if n:
            await all_done
        elapsed = clock() - start
    return RunStats(name, n, concurrency, elapsed, finished - sent, [r for r in results if r is not None])


async def drive_serial(
    client: RewardClient, samples: Sequence[common_pb2.Sample], reward: str, *, name: str, show_progress: bool = True
) -> RunStats:
    """One sample at a time on the client's Score stream, each result awaited before the next is sent."""
    latencies = np.zeros(len(samples))
    results: list[reward_pb2.RewardResult] = []
    clock = time.perf_counter
    with _Progress(name, len(samples), not show_progress) as bar:
        start = clock()
        for i, sample in enumerate(samples):
            t = clock()
            results.append(await client.submit(sample, reward))
            latencies[i] = clock() - t
            bar.done += 1
        elapsed = clock() - start
    return RunStats(name, len(samples), 1, elapsed, latencies, results)


# ----------------------------------------------------------------------------------------------------- output


def machine_info() -> dict[str, str]:
    import grpc
    import torch

    cpu_model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    if torch.cuda.is_available():
        device = f"cuda: {torch.cuda.get_device_name(0)}"
    else:
        device = "cpu"
    return {
        "cpu": cpu_model,
        "cpu_count": str(os.cpu_count()),
        "usable_cpus": str(len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else "?",
        "torch": torch.__version__,
        "torch_threads": str(torch.get_num_threads()),
        "device": device,
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
        "platform": platform.platform(terse=True),
    }


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured markdown table with padded columns (readable as plain text too)."""
    cells = [[str(c) for c in header], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"

    return "\n".join([line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells[1:])])


def fmt_rate(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:,.1f}"


# ------------------------------------------------------------------------------------------------- echo server


def _echo_result(sample_id: str, reward: str, arrived: float) -> reward_pb2.RewardResult:
    # Non-zero timings, as a real result has: proto3 leaves zero doubles off the wire.
    took = time.monotonic() - arrived + 1e-6
    return reward_pb2.RewardResult(
        sample_id=sample_id,
        reward=reward,
        batch_size=1,
        timing=reward_pb2.RewardTiming(queue=took, compute=took, total=took),
    )


class EchoRewardServicer(reward_pb2_grpc.RewardServiceServicer):
    """RewardService with no engine: each ScoreRequest is answered at once with a RewardResult shaped like
    a rewardmesh `noop` result (sample_id, reward, batch_size, timing), so messages are the same size."""

    def __init__(self) -> None:
        self.results_sent = 0
        self.messages_in = self.messages_out = 0

    async def Score(
        self, request_iterator: AsyncIterator[reward_pb2.ScoreRequest], context: aio.ServicerContext
    ) -> AsyncIterator[reward_pb2.ScoreResponse]:
        many = False  # answer in kind: several results per message once the client asks for them
        async for req in request_iterator:
            arrived = time.monotonic()
            self.messages_in += 1
            many = many or req.max_results_per_message > 1
            if req.items:
                results = [_echo_result(it.sample.sample_id, it.reward, arrived) for it in req.items]
                self.results_sent += len(results)
                if many:
                    self.messages_out += 1
                    yield reward_pb2.ScoreResponse(results=results)
                else:
                    for r in results:
                        self.messages_out += 1
                        yield reward_pb2.ScoreResponse(result=r)
            elif req.HasField("sample"):
                self.results_sent += 1
                self.messages_out += 1
                yield reward_pb2.ScoreResponse(result=_echo_result(req.sample.sample_id, req.reward, arrived))

    async def ScoreBatch(
        self, request: reward_pb2.ScoreBatchRequest, context: aio.ServicerContext
    ) -> reward_pb2.ScoreBatchResponse:
        arrived = time.monotonic()
        self.results_sent += len(request.samples)
        return reward_pb2.ScoreBatchResponse(
            results=[_echo_result(s.sample_id, request.reward, arrived) for s in request.samples]
        )

    async def ListRewards(
        self, request: reward_pb2.ListRewardsRequest, context: aio.ServicerContext
    ) -> reward_pb2.ListRewardsResponse:
        return reward_pb2.ListRewardsResponse()

    async def KeepTraces(
        self, request: reward_pb2.KeepTracesRequest, context: aio.ServicerContext
    ) -> reward_pb2.KeepTracesResponse:
        return reward_pb2.KeepTracesResponse()  # it records no traces


async def serve_echo(host: str, port: int, port_file: str = "") -> None:
    """Run the echo server (same channel options as a reward server, plus health) until SIGTERM/SIGINT."""
    from grpc_health.v1 import _async as health_aio
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from rewardmesh.server.serving import ServerOptions, write_port_file

    options = ServerOptions(host=host, port=port)
    server = aio.server(options=options.channel_args())
    servicer = EchoRewardServicer()
    reward_pb2_grpc.add_RewardServiceServicer_to_server(servicer, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise SystemExit(f"echo server: could not bind {host}:{port}")
    await server.start()
    for name in ("", reward_pb2.DESCRIPTOR.services_by_name["RewardService"].full_name):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("echo server listening on %s:%d", host, bound)
    if port_file:
        write_port_file(port_file, bound)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)
    log.info(
        "echo server stopped after sending %d results (Score messages: %d in, %d out)",
        servicer.results_sent,
        servicer.messages_in,
        servicer.messages_out,
    )


def echo_server_argv(host: str = "127.0.0.1", port: int = 0) -> list[str]:
    return [sys.executable, "-m", "bench.common", "echo-server", "--host", host, "--port", str(port)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.common", description="benchmark helper processes")
    sub = parser.add_subparsers(dest="command", required=True)
    echo = sub.add_parser("echo-server", help="bare grpc.aio RewardService that echoes each sample_id back")
    echo.add_argument("--host", default="127.0.0.1")
    echo.add_argument("--port", type=int, default=0)
    echo.add_argument("--port-file", default="", help="write the bound port here once serving")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "echo-server":
        asyncio.run(serve_echo(args.host, args.port, args.port_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())

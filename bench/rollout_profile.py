"""Benchmark: where the rollout server's CPU goes per sample, one line per part of the data path.

    python -m bench.rollout_profile [--engine instant|vllm] [--prompts 128] [--n 8] [--passes 4]

The whole mesh runs as a user runs it (`TrainerClient` in this process -> a rollout server process -> a
`rewardmesh serve reward` process with the `noop` pipeline); the rollout server runs under cProfile. At a load
where the engine is fast (`instant`: the stand-in engine of `bench.rollout_throughput`, which answers at once;
`vllm`: the tiny policy on vLLM), what is left is the server's own work per sample. Every function's own time
(C functions: their caller's part) goes to one line:

- sample building: the finished sample's fields, tensors and text (server/rollout/worker.py, common/tensors.py);
- Generate servicer: request checks, planning, answers into messages (server/rollout/service.py);
- reward stream hand-off: the Score stream's client (client/reward_client.py and what it calls);
- telemetry: sample traces (server/rollout/telemetry.py, common/telemetry.py, the flight recorder, OpenTelemetry);
- gRPC messages, Python: grpc.aio's Python layer and protobuf calls made from Python;
- gRPC core and event loop, C: grpc's compiled core (message (de)serialization happens there), task steps;
- event loop, Python: asyncio's own Python code;
- engine: the stand-in and the agent loop, or vLLM's front end (input processing, output handling);
- other.

cProfile's per-call cost inflates Python lines against C ones, so the shares are a guide; the CPU per sample of
the same server without the profiler (from /proc) is printed beside them. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pstats
import signal
import sys
import sysconfig
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.common import cpu_snapshot, cpu_usage, machine_info, markdown_table, progress
from bench.rollout_throughput import (
    REWARD_SERVICE,
    ROLLOUT_SERVICE,
    mesh_pass,
    prompt_specs,
    reward_argv,
    vllm_available,
)
from rewardmesh.demo.server_process import ServerProcess

LINES = [
    "sample building",
    "Generate servicer",
    "reward stream hand-off",
    "telemetry",
    "gRPC messages, Python",
    "gRPC core and event loop, C",
    "event loop, Python",
    "engine",
    "other",
]

ROOT = str(Path(__file__).resolve().parents[1]).replace(os.sep, "/") + "/"
STDLIB = sysconfig.get_paths()["stdlib"].replace(os.sep, "/") + "/"

# The project's files (paths from the repository root, rewardmesh/ prefixed or not): (start of the path, line).
OWN = [
    ("server/rollout/worker.py", "sample building"),
    ("common/tensors.py", "sample building"),
    ("server/decoding.py", "sample building"),
    ("server/rollout/service.py", "Generate servicer"),
    ("server/status.py", "Generate servicer"),
    ("server/limits.py", "Generate servicer"),
    ("client/", "reward stream hand-off"),
    ("server/rollout/telemetry.py", "telemetry"),
    ("common/telemetry.py", "telemetry"),
    ("common/flight_recorder.py", "telemetry"),
    ("server/rollout/agent_loop.py", "engine"),
    ("server/rollout/backends/", "engine"),
    ("bench/rollout_throughput.py", "engine"),
]
# Other packages, by the directory they are imported from: (package, line).
PACKAGES = [
    ("numpy", "sample building"),
    ("tokenizers", "sample building"),
    ("transformers", "sample building"),
    ("opentelemetry", "telemetry"),
    ("grpc", "gRPC messages, Python"),
    ("google", "gRPC messages, Python"),  # protobuf
    ("asyncio", "event loop, Python"),
    ("vllm", "engine"),
    ("zmq", "engine"),  # vLLM's front end talks to its engine core over ZeroMQ
    ("msgspec", "engine"),
]


def line_of(func: tuple[str, int, str]) -> str | None:
    """The line a Python function's own time goes to; None for a C function or the standard library's (enum,
    copy, selectors: their callers decide), asyncio excepted (the event loop, Python)."""
    filename = func[0]
    if filename == "~" or filename.startswith("<"):
        return None
    path = filename.replace(os.sep, "/")
    if path.startswith(STDLIB) and "site-packages/" not in path:
        return "event loop, Python" if path[len(STDLIB) :].startswith("asyncio/") else None
    if path.startswith(ROOT):
        own = path[len(ROOT) :].removeprefix("rewardmesh/")
        return next((line for start, line in OWN if own.startswith(start)), "other")
    parts = path.split("/")
    return next((line for package, line in PACKAGES if package in parts), "other")


def breakdown(stats: pstats.Stats) -> dict[str, float]:
    """Seconds of own time per line. A C (or standard library) function's time is split among its callers' lines
    by what each call site spent; C work called from C (grpc's core resuming a task, serializing a message) shows
    up in the C function the event loop called, which is the gRPC core and event loop line."""
    raw: Any = stats.stats  # type: ignore[attr-defined]
    out: dict[str, float] = defaultdict(float)
    for func, (_, _, own, _, callers) in raw.items():
        line = line_of(func)
        if line is not None:
            out[line] += own
            continue
        native = func[0] == "~"
        spent = {caller: entry[2] for caller, entry in callers.items()}
        total = sum(spent.values())
        if total <= 0:
            out["gRPC core and event loop, C" if native else "other"] += own
            continue
        for caller, share in spent.items():
            owner = line_of(caller)
            if native and owner in (None, "event loop, Python"):
                owner = "gRPC core and event loop, C"  # the loop's callbacks and task steps: C all the way down
            out[owner or "other"] += own * share / total
    return dict(out)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from rewardmesh.client.trainer import Sampling, TrainerClient
    from rewardmesh.demo.tiny_models import build_tiny_models, build_tokenizer

    prompts = prompt_specs(args.prompts, args.prompt_tokens, len(build_tokenizer()), args.seed)
    sampling = Sampling(temperature=1.0, max_tokens=args.response_tokens, seed=args.seed, ignore_eos=True)
    report: dict[str, Any] = {"machine": machine_info(), "loadavg_at_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="rewardmesh-rollout-profile-") as tmp:
        work = Path(tmp)
        if args.engine == "instant":
            server = [sys.executable, "-m", "bench.rollout_throughput", "serve-instant",
                      "--response-tokens", str(args.response_tokens)]  # fmt: skip
        else:
            model = str(build_tiny_models(args.models).policy)
            server = [sys.executable, "-m", "rewardmesh.server.cli", "serve", "rollout", "--host", "127.0.0.1",
                      "--port", "0", "--backend", "vllm", "--model", model, "--grace-s", "2",
                      *[f"--engine-arg={a}" for a in args.vllm_engine_arg]]  # fmt: skip
        reward = ServerProcess("reward", reward_argv(), work)
        reward.start()
        try:
            await reward.wait_serving(REWARD_SERVICE)
            for profiled in (False, True):
                prof = work / "rollout.prof"
                argv = [*server, "--reward-target", reward.address]
                if profiled:  # the module run under this one's `profile` command: CPU time, main thread
                    argv = [argv[0], "-m", "bench.rollout_profile", "profile", str(prof), *argv[1:]]
                rollout = ServerProcess("rollout-profiled" if profiled else "rollout", argv, work)
                rollout.start(timeout_s=900)
                try:
                    await rollout.wait_serving(ROLLOUT_SERVICE, timeout_s=900)
                    async with TrainerClient([rollout.address], reward="noop", sampling=sampling) as client:
                        await mesh_pass(client, prompts, args.n, "noop", sampling)  # warm up
                        if profiled:
                            os.kill(rollout.pid, signal.SIGUSR1)
                        before = cpu_snapshot([rollout.pid])
                        started = time.perf_counter()
                        samples = 0
                        for _ in range(args.passes):
                            done, _, errors = await mesh_pass(client, prompts, args.n, "noop", sampling)
                            if errors:
                                raise RuntimeError(f"{errors} samples failed")
                            samples += done
                        elapsed = time.perf_counter() - started
                        usage = cpu_usage(before, cpu_snapshot([rollout.pid]))
                        if profiled:
                            os.kill(rollout.pid, signal.SIGUSR2)
                finally:
                    code = rollout.stop(timeout_s=120)
                if code != 0:
                    raise RuntimeError(f"the rollout server exited with {code}: {rollout.log_tail()}")
                cpu_s = usage.process_s.get(rollout.pid, 0.0) if usage is not None else 0.0
                key = "profiled" if profiled else "plain"
                report[key] = {"samples": samples, "elapsed_s": elapsed, "cpu_us_per_sample": cpu_s / samples * 1e6,
                               "other_cores": usage.other_cores if usage is not None else None}  # fmt: skip
                progress(f"{key}: {samples / elapsed:,.0f} samples/s, rollout server CPU "
                         f"{cpu_s / samples * 1e6:,.0f} µs per sample")  # fmt: skip
                if profiled:
                    lines = breakdown(pstats.Stats(str(prof)))
                    if args.profile_out is not None:
                        args.profile_out.write_bytes(prof.read_bytes())
                    report["lines_us_per_sample"] = {k: lines.get(k, 0.0) / samples * 1e6 for k in LINES}
        finally:
            reward.stop()
    return report


def render(report: dict[str, Any], args: argparse.Namespace) -> str:
    lines = report["lines_us_per_sample"]
    total = sum(lines.values())
    rows = [[name, f"{us:,.1f}", f"{us / total:.0%}" if total else ""] for name, us in lines.items()]
    rows.append(["total (profiled)", f"{total:,.1f}", "100%"])
    m = report["machine"]
    plain, profiled = report["plain"], report["profiled"]
    return "\n".join([
        f"Machine: {m['cpu']}, {m['usable_cpus']} usable cores, {m['device']}, torch {m['torch']}, "
        f"Python {m['python']}, grpcio {m['grpcio']}; load average at start {report['loadavg_at_start']:.2f} "
        "(shared: numbers are noisy).",
        "",
        f"### Rollout server CPU per sample, by line ({args.engine} engine, {args.prompts} prompts x n={args.n}, "
        f"{args.response_tokens}-token responses, scored by `noop`, {args.passes} passes)",
        "",
        markdown_table(["line", "µs per sample (profiled)", "share"], rows),
        "",
        f"Without the profiler the rollout server spent {plain['cpu_us_per_sample']:,.0f} µs of CPU per sample "
        f"({plain['samples'] / plain['elapsed_s']:,.0f} samples/s); under it {profiled['cpu_us_per_sample']:,.0f} µs.",
    ])  # fmt: skip


def profile(out: str, module: str, argv: list[str]) -> None:
    """Run `module` as __main__ with `argv`, profiled between SIGUSR1 and SIGUSR2 (the timed passes, not the
    start) by cProfile counting the main thread's CPU time (not the wall time it waits); the stats go to `out`
    when it exits."""
    import cProfile
    import runpy
    import signal

    profiler = cProfile.Profile(time.thread_time)
    signal.signal(signal.SIGUSR1, lambda *_: profiler.enable())
    signal.signal(signal.SIGUSR2, lambda *_: profiler.disable())
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit:
        pass
    finally:
        profiler.disable()
        profiler.dump_stats(out)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["profile"]:  # profile OUT -m MODULE ARGS...
        if len(argv) < 4 or argv[2] != "-m":
            raise SystemExit("usage: python -m bench.rollout_profile profile OUT -m MODULE [ARGS...]")
        profile(argv[1], argv[3], argv[4:])
        return 0
    p = argparse.ArgumentParser(prog="python -m bench.rollout_profile", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--engine", choices=["instant", "vllm"], default="instant")
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--response-tokens", type=int, default=32)
    p.add_argument("--passes", type=int, default=4, help="timed passes (after one to warm up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--models", type=Path, default=Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        / "rewardmesh" / "models", help="where the tiny models are built (reused)",
    )  # fmt: skip
    p.add_argument("--profile-out", type=Path, help="also keep the rollout server's cProfile stats here (pstats)")
    p.add_argument("--vllm-engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="vllm engine: an engine argument (also REWARDMESH_ENGINE_ARG)")  # fmt: skip
    args = p.parse_args(argv)
    if args.engine == "vllm" and (why := vllm_available()):
        print(f"bench.rollout_profile: {why}", file=sys.stderr)
        return 1
    report = asyncio.run(run(args))
    print(render(report, args), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

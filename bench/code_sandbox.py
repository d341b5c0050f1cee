"""Code rewards against a bare process and firejail, side by side, and what streaming buys for code rewards.

    python -m bench.code_sandbox [--samples 48 --rounds 3 --step-samples 256 --generation-s 30 --no-step]

Part 1, executions. The shipped test set's Python problems (stdin/stdout, call-based, HumanEval and MBPP asserts,
canonical solutions as a policy writes them) as two workloads: one-test samples (HumanEval style: a program and
one test) and 16-test samples. Every mode runs the same program and test harness and checks that it passed:

- bare subprocess: subprocess.run of the program in a temporary directory, no isolation (the limit);
- sandbox, cold: the code pipeline with a sandbox started for every sample (samples_per_sandbox: 1);
- sandbox, warm: the code pipeline as shipped (sandboxes started ahead, each serving many samples);
- firejail: Debian's firejail, one start per execution, with the closest isolation it offers: an empty network
  namespace, private /tmp and /dev, IPC namespace, an empty home, the rest of the file system read-only, all
  capabilities dropped, no_new_privs, its default seccomp filter, and the same rlimits. Install it with
  `make bench-tools` (root with apt) or `apt-get install firejail`; without it its rows are skipped.

Per mode: milliseconds per execution with one sample at a time, then executions/s with as many samples at once as
the machine has CPUs (the pool's size). The modes take turns sample by sample (latency) and burst by burst
(throughput), so a busy moment of a shared machine falls on all of them alike; each number is the median over
rounds.

Part 2, a zygote: inside one warm sandbox, a test run as a fresh interpreter (what the sandbox does) against a
fork of an interpreter that has already started (a zygote), per test.

Part 3, a step of --step-samples code samples whose programs have long-tailed run times (CPU-bound, lognormal,
capped at 1 s) and whose generation finishes spread over --generation-s seconds (also long-tailed): (a) every
sample scored by the code pipeline the moment it finishes (streaming, as the mesh does), (b) all scored after the
last one is generated. Reported: the step's time from the first generation to the last score, and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench.common import markdown_table, progress
from bench.mesh import machine_table
from rewardmesh.demo.code_problems import PROBLEMS
from rewardmesh.reward_engine.engine import RewardEngine
from rewardmesh.reward_engine.sandbox.executor import Job, Limits, Sandbox, TestRun
from rewardmesh.reward_engine.sandbox.grading import job_of, outcome, plan
from rewardmesh.reward_engine.sandbox.levels import default_python
from rewardmesh.reward_engine.sources.code import CodeSource
from rewardmesh.reward_engine.ticket import Ticket
from rewardmesh.reward_engine.types import RewardInput

MANY = 16
LIMITS = Limits()  # the code pipeline's defaults, applied to every mode (firejail's rlimits too)
Sample = tuple[str, str]  # (response, ground truth)


def _one_test_truths(ground_truth: str) -> list[str]:
    """A problem's tests as ground truths of one test each (verl's JSON forms kept)."""
    spec = json.loads(ground_truth)
    if "inputs" in spec:
        pairs = zip(spec["inputs"], spec["outputs"], strict=True)
        return [json.dumps({**spec, "inputs": [i], "outputs": [o]}) for i, o in pairs]
    if "test_list" in spec:
        return [json.dumps({**spec, "test_list": [t]}) for t in spec["test_list"]]
    return [ground_truth]  # HumanEval: one check() program


def _many_tests_truth(ground_truth: str, n: int) -> str:
    spec = json.loads(ground_truth)
    if "inputs" in spec:
        k = len(spec["inputs"])
        return json.dumps({**spec, "inputs": [spec["inputs"][i % k] for i in range(n)],
                           "outputs": [spec["outputs"][i % k] for i in range(n)]})  # fmt: skip
    if "test_list" in spec:
        return json.dumps({**spec, "test_list": [spec["test_list"][i % len(spec["test_list"])] for i in range(n)]})
    raise ValueError("a HumanEval test is one check() program")


def workloads(n: int) -> dict[str, list[Sample]]:
    python = [p for p in PROBLEMS if p.language == "python"]
    one = [(p.canonical, truth) for p in python for truth in _one_test_truths(p.ground_truth)]
    listed = [p for p in python if "test" not in json.loads(p.ground_truth)]  # not HumanEval's one check()
    many = [(p.canonical, _many_tests_truth(p.ground_truth, MANY)) for p in listed]
    return {
        "one-test samples": [one[i % len(one)] for i in range(n)],
        f"{MANY}-test samples": [many[i % len(many)] for i in range(max(2, n // 4))],
    }


def _tests(sample: Sample) -> int:
    return len(plan(*sample).stdins)


# ------------------------------------------------------------------------------------------------------ modes


def firejail_argv(workdir: str) -> list[str]:
    """firejail with the isolation closest to the sandbox's that it offers, and the same rlimits."""
    return [
        "firejail", "--quiet", "--noprofile", "--private", f"--private-cwd={workdir}", "--read-only=/",
        "--net=none", "--private-tmp", "--private-dev", "--ipc-namespace", "--caps.drop=all", "--nonewprivs",
        "--nogroups", "--seccomp", f"--rlimit-as={LIMITS.memory_mb << 20}", f"--rlimit-cpu={int(LIMITS.cpu_s) + 1}",
        f"--rlimit-nproc={LIMITS.procs}", f"--rlimit-nofile={LIMITS.files}", f"--rlimit-fsize={LIMITS.file_bytes}",
        "--",
    ]  # fmt: skip


class Process:
    """The program and its harness run as plain processes, one per test: bare, or under a prefix (firejail)."""

    def __init__(self, python: str, root: Path, prefix: Callable[[str], list[str]] | None = None) -> None:
        self.python, self.root, self.prefix = python, root, prefix
        self.threads = ThreadPoolExecutor(len(os.sched_getaffinity(0)) * 2)

    def _sample(self, sample: Sample) -> None:
        p = plan(*sample)
        job = job_of(p, self.python)
        work = tempfile.mkdtemp(dir=self.root)
        try:
            for name, text in job.files.items():
                Path(work, name).write_text(text)
            argv = [*(self.prefix(work) if self.prefix else []), *job.run]
            for i, stdin in enumerate(job.stdins):
                done = subprocess.run(argv, input=stdin.encode(), cwd=work, capture_output=True, timeout=60)
                code = done.returncode
                run = TestRun("exited", code if code >= 0 else None, -code if code < 0 else None,
                              done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace"))  # fmt: skip
                verdict = outcome(p, i, run)
                assert verdict[0] == "passed", (argv, verdict, run.stderr[-500:])
        finally:
            shutil.rmtree(work, ignore_errors=True)

    async def __call__(self, sample: Sample) -> None:
        await asyncio.get_running_loop().run_in_executor(self.threads, self._sample, sample)


class Pipeline:
    """The code reward source, as the reward server runs it."""

    def __init__(self, source: CodeSource) -> None:
        self.source = source

    async def __call__(self, sample: Sample) -> None:
        grade = await self.source.grade(*sample)
        assert grade.score == 1.0, grade.tests


Mode = Callable[[Sample], Awaitable[None]]


async def _latencies(modes: dict[str, Mode], samples: list[Sample]) -> dict[str, float]:
    """ms per execution of each mode, one sample at a time, the modes taking turns sample by sample (so a busy
    moment of the machine falls on all of them alike)."""
    spent = dict.fromkeys(modes, 0.0)
    for s in samples:
        for name, mode in modes.items():
            start = time.perf_counter()
            await mode(s)
            spent[name] += time.perf_counter() - start
    executions = sum(map(_tests, samples))
    return {name: t * 1e3 / executions for name, t in spent.items()}


async def _throughputs(modes: dict[str, Mode], samples: list[Sample], at_once: int) -> dict[str, float]:
    """executions/s of each mode with `at_once` samples in flight, the modes taking turns burst by burst (a burst:
    about 4 x `at_once` executions, at least `at_once` samples), so a busy moment of the machine falls on all of
    them alike."""
    gate = asyncio.Semaphore(at_once)
    spent = dict.fromkeys(modes, 0.0)

    async def one(mode: Mode, s: Sample) -> None:
        async with gate:
            await mode(s)

    size = max(at_once, 4 * at_once // max(1, _tests(samples[0])))
    names = list(modes)
    for b, first in enumerate(range(0, len(samples), size)):
        burst = samples[first : first + size]
        for name in names[b % len(names) :] + names[: b % len(names)]:
            start = time.perf_counter()
            await asyncio.gather(*(one(modes[name], s) for s in burst))
            spent[name] += time.perf_counter() - start
    executions = sum(map(_tests, samples))
    return {name: executions / t for name, t in spent.items()}


def tool_versions() -> dict[str, str]:
    versions = {}
    for tool, flag in (("bwrap", "--version"), ("firejail", "--version")):
        if path := shutil.which(tool):
            first = subprocess.run([path, flag], capture_output=True, text=True).stdout.split("\n")[0]
            versions[tool] = first.split()[-1] if first else "?"
    return versions


async def executions(n: int, rounds: int) -> list[list[object]]:
    workers = len(os.sched_getaffinity(0))
    python = default_python()
    root = Path(tempfile.mkdtemp(prefix="rewardmesh-bench-", dir=Path.cwd()))  # firejail hides /tmp and /var/tmp
    os.chmod(root, 0o755)
    warm = CodeSource("code", workers=workers)
    cold = CodeSource("code", workers=workers, samples_per_sandbox=1)
    await warm.warmup()
    await cold.warmup()
    level = warm.sandbox.level.name if warm.sandbox.level else "?"
    modes: dict[str, Mode] = {
        "bare subprocess": Process(python, root),
        f"sandbox ({level}), cold: a start per sample": Pipeline(cold),
        f"sandbox ({level}), warm": Pipeline(warm),
    }
    if shutil.which("firejail"):
        modes["firejail, a start per execution"] = Process(python, root, firejail_argv)
    else:
        progress("firejail is not installed (`make bench-tools`, or apt-get install firejail): its rows are skipped")
    work = workloads(n)
    lat: dict[tuple[str, str], list[float]] = {}
    rate: dict[tuple[str, str], list[float]] = {}
    try:
        for r in range(rounds):
            for load, samples in work.items():
                progress(f"round {r + 1}/{rounds}: {load}, one at a time, the modes taking turns")
                for name, ms in (await _latencies(modes, samples)).items():
                    lat.setdefault((load, name), []).append(ms)
                progress(f"round {r + 1}/{rounds}: {load}, {workers} at once, the modes taking turns")
                for name, per_s in (await _throughputs(modes, samples, workers)).items():
                    rate.setdefault((load, name), []).append(per_s)
    finally:
        await warm.close()
        await cold.close()
        shutil.rmtree(root, ignore_errors=True)
    rows: list[list[object]] = []
    for load in work:
        bare = statistics.median(rate[(load, "bare subprocess")])
        for name in modes:
            ms, per_s = statistics.median(lat[(load, name)]), statistics.median(rate[(load, name)])
            rows.append([load, name, f"{ms:.1f}", f"{per_s:.1f}", f"{per_s / bare:.2f}"])
    return rows


# ------------------------------------------------------------------------------------------------------ zygote

_ZYGOTE = """import json, os, resource, subprocess, sys, time
import io, contextlib, runpy, socket, selectors, base64, re, math  # what a zygote would hold imported
python, runs = sys.argv[1], int(sys.argv[2])
stdin = sys.stdin.read()

def fresh():
    subprocess.run([python, '-I', 'main.py'], input=stdin.encode(), capture_output=True, check=True)

def forked():
    r, w = os.pipe()
    out_r, out_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(w); os.close(out_r)
        os.dup2(r, 0); os.dup2(out_w, 1)
        sys.stdin = io.TextIOWrapper(os.fdopen(0, 'rb', closefd=False))
        sys.stdout = io.TextIOWrapper(os.fdopen(1, 'wb', closefd=False), write_through=True)
        try:
            runpy.run_path('main.py', run_name='__main__')
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            code = 1
        os._exit(code)
    os.close(r); os.close(out_w)
    os.write(w, stdin.encode()); os.close(w)
    while os.read(out_r, 65536):
        pass
    os.close(out_r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0

def cpu():
    return sum(sum(resource.getrusage(who)[:2]) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))

result = {}
for name, how in (('fresh', fresh), ('forked', forked)):
    how()
    start, used = time.perf_counter(), cpu()
    for _ in range(runs):
        how()
    result[name] = ((time.perf_counter() - start) * 1e3 / runs, (cpu() - used) * 1e3 / runs)
print(json.dumps(result))
"""


async def zygote(runs: int) -> list[list[object]]:
    """Wall and CPU ms per test inside one warm sandbox: a fresh interpreter per test against a fork of a started
    one (CPU time is what a busy machine pays; wall time there is mostly waiting for a core)."""
    problem = next(p for p in PROBLEMS if p.form == "assert" and "entry_point" in p.ground_truth)
    job = job_of(plan(problem.canonical, problem.ground_truth), default_python())
    sandbox = Sandbox(workers=1, limits=Limits(cpu_s=60, wall_s=60))
    await sandbox.prestart()
    try:
        files = {**job.files, "zygote.py": _ZYGOTE}
        run = [sandbox.python, "-I", "zygote.py", sandbox.python, str(runs)]
        result = await sandbox.run(Job(files, run, job.stdins))
    finally:
        sandbox.close()
    test = result.runs[0]
    assert test.status == "exited" and test.exit_code == 0, test.stderr
    ms = json.loads(test.stdout)
    return [
        ["a fresh interpreter per test (the sandbox's rule)", f"{ms['fresh'][0]:.1f}", f"{ms['fresh'][1]:.1f}"],
        ["a fork of a started interpreter per test (a zygote)", f"{ms['forked'][0]:.1f}", f"{ms['forked'][1]:.1f}"],
    ]


# ------------------------------------------------------------------------------------------------------ the step

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
            scored = await pipeline.add(Ticket(inp)).future
            assert scored.output.score == 1.0, scored

        await asyncio.gather(*(one(at, inp) for at, inp in work))
        return time.perf_counter() - start

    async def after() -> float:
        start = time.perf_counter()
        await asyncio.sleep(work[-1][0])
        results = await asyncio.gather(*(pipeline.add(Ticket(inp)).future for _, inp in work))
        assert all(r.output.score == 1.0 for r in results)
        return time.perf_counter() - start

    progress(f"part 3: a step of {n} samples, generation over {generation_s:g}s, streaming then after generation")
    streamed = await streaming()
    batched = await after()
    await engine.close()
    return streamed, batched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=48, help="one-test samples per mode and round (16-test: 1/4)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--zygote-runs", type=int, default=40)
    parser.add_argument("--step-samples", type=int, default=256)
    parser.add_argument("--tests", type=int, default=2, help="tests per sample in the step")
    parser.add_argument("--generation-s", type=float, default=30.0)
    parser.add_argument("--no-step", action="store_true", help="skip part 3")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    workers = len(os.sched_getaffinity(0))
    notes: dict[str, object] = {"sandbox workers": workers, "rounds": args.rounds, **tool_versions()}
    rows = asyncio.run(executions(args.samples, args.rounds))
    progress("part 2: a fresh interpreter against a zygote's fork, per test, in one warm sandbox")
    zygote_rows = asyncio.run(zygote(args.zygote_runs))
    stepped = None if args.no_step else asyncio.run(step(args.step_samples, args.tests, args.generation_s, args.seed))
    print(machine_table(notes))
    print()
    print(markdown_table(["workload", "mode", "ms per execution", "executions/s", "vs bare (executions/s)"], rows))
    print()
    print(markdown_table(["inside one warm sandbox", "ms per test", "CPU ms per test"], zygote_rows))
    if stepped is not None:
        streamed, after = stepped
        print()
        print(
            markdown_table(
                ["step of code samples", "time (s)"],
                [
                    [f"streaming ({args.step_samples} samples, {args.tests} tests each)", f"{streamed:.2f}"],
                    ["after generation", f"{after:.2f}"],
                    ["after / streaming", f"{after / streamed:.2f}"],
                    ["generation alone", f"{args.generation_s:.2f}"],
                ],
            )
        )


if __name__ == "__main__":
    main()

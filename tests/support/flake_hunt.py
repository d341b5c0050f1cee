"""Hunt flaky tests: run the suite several times, each time in a new random order, beside a CPU load on every core,
then print every test that failed at least once, with its failure and the seed that replays that run's order.

    python -m tests.support.flake_hunt --runs 10 --load 60 [-- PYTEST ARGS]

A test that passes on an idle machine and fails on a loaded one waits on luck (a fixed sleep, a wall-clock ratio,
an order between independent tasks); one that fails only after some other test shares state with it. The load is
Debian's stress-ng where installed (`make flake-hunt` installs it as root), else this module's own: one process
per core, busy for `--load` per cent of every 100 ms. The order is pytest-random-order's module bucket: the files
in a random order, and the tests of each file shuffled (module fixtures are still set up once per file).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TAIL_LINES = 30  # of each failure's traceback, printed
BURNER = "flake-hunt-burner"  # the name of the load processes this module starts where stress-ng is missing
SUMMARY = re.compile(r"^=*\s*(\d+ \w+|no tests ran)[^=]* in [\d.]+s")  # pytest's closing line


@dataclass
class Failure:
    run: int
    seed: int
    message: str
    text: str


@dataclass
class Run:
    index: int
    seed: int
    exit_code: int
    seconds: float
    summary: str
    log: Path
    failures: dict[str, Failure] = field(default_factory=dict)


def burn(load_percent: int) -> None:
    """Keep one core busy `load_percent` per cent of every 100 ms (the fallback load when stress-ng is missing)."""
    period = 0.1
    busy = period * load_percent / 100
    while True:
        start = time.monotonic()
        while time.monotonic() - start < busy:
            pass
        time.sleep(max(0.0, period - (time.monotonic() - start)))


@contextlib.contextmanager
def cpu_load(load_percent: int) -> Iterator[str]:
    """A CPU load on every core for the duration; yields what makes it (for the report)."""
    cores = os.cpu_count() or 1
    if load_percent <= 0:
        yield "no added load"
        return
    stress = shutil.which("stress-ng")
    if stress:
        argv = [stress, "--cpu", str(cores), "--cpu-load", str(load_percent), "--quiet"]
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            yield f"stress-ng {' '.join(argv[1:])}"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 15)  # stress-ng's workers are its children, in its session
            proc.wait(30)
        return
    ctx = multiprocessing.get_context("spawn")
    burners = [ctx.Process(target=burn, args=(load_percent,), name=BURNER, daemon=True) for _ in range(cores)]
    for p in burners:
        p.start()
    try:
        yield f"{cores} burner processes at {load_percent}% (stress-ng is not installed)"
    finally:
        for p in burners:
            p.kill()
            p.join(30)


def node_id(classname: str, name: str) -> str:
    """pytest's node id from a JUnit testcase's classname (dotted path, then any class) and name."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = Path(*parts[:cut]).with_suffix(".py")
        if (REPO / path).is_file():
            return "::".join([path.as_posix(), *parts[cut:], name])
    return f"{classname}::{name}"


def failures_in(junit: Path, run: int, seed: int) -> dict[str, Failure]:
    found: dict[str, Failure] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        nid = node_id(case.get("classname", ""), case.get("name", ""))
        for kind, where in (("failure", ""), ("error", " (in setup or teardown)")):
            element = case.find(kind)
            if element is not None:
                found.setdefault(nid + where, Failure(run, seed, element.get("message", kind), element.text or ""))
    return found


def one_run(index: int, seed: int, pytest_args: Sequence[str], out: Path) -> Run:
    junit, log = out / f"run-{index}.xml", out / f"run-{index}.log"
    argv = [sys.executable, "-m", "pytest", "-p", "random_order", "--random-order-bucket=module",
            f"--random-order-seed={seed}", "-p", "no:cacheprovider", "-q", "-rfE", f"--junitxml={junit}",
            *pytest_args]  # fmt: skip
    started = time.monotonic()
    with log.open("w") as sink:
        code = subprocess.call(argv, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    seconds = time.monotonic() - started
    lines = log.read_text(errors="replace").splitlines()
    summary = next((line.strip("= ") for line in reversed(lines) if SUMMARY.match(line)), "")
    run = Run(index, seed, code, seconds, summary, log)
    if junit.is_file():
        run.failures = failures_in(junit, index, seed)
    if code not in (0, 1) or not junit.is_file():  # interrupted, a collection error, a crash: the run itself
        tail = "\n".join(lines[-TAIL_LINES:])
        run.failures[f"(the whole run: pytest exited with {code})"] = Failure(index, seed, f"exit code {code}", tail)
    return run


def replay(seed: int, pytest_args: Sequence[str]) -> str:
    args = ["-p", "random_order", f"--random-order-seed={seed}", *pytest_args]
    return "pytest " + " ".join(shlex.quote(a) for a in args)


def report(runs: list[Run], pytest_args: Sequence[str], load: str, out: Path) -> int:
    print(f"\nflake hunt: {len(runs)} run(s) in random order beside {load}; logs and JUnit XML in {out}")
    for r in runs:
        print(f"  run {r.index} (seed {r.seed}, {r.seconds:.0f} s): {r.summary or f'exit code {r.exit_code}'}")
    failed: dict[str, list[Failure]] = {}
    for r in runs:
        for nid, f in r.failures.items():
            failed.setdefault(nid, []).append(f)
    if not failed:
        print(f"\nno test failed in {len(runs)} run(s)")
        return 0
    print(f"\n{len(failed)} test(s) failed at least once:")
    for nid, fs in sorted(failed.items(), key=lambda kv: -len(kv[1])):
        first = fs[0]
        print(f"\n{nid}\n  failed in {len(fs)} of {len(runs)} run(s): seeds {', '.join(str(f.seed) for f in fs)}")
        print(f"  replay that run's order: {replay(first.seed, pytest_args)}")
        print(f"  {first.message.splitlines()[0] if first.message else ''}")
        for line in first.text.rstrip().splitlines()[-TAIL_LINES:]:
            print(f"    {line}")
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="how many runs of the suite (default 3)")
    parser.add_argument("--load", type=int, default=60, help="per-cent CPU load on every core, 0 for none (60)")
    parser.add_argument("--seed", type=int, action="append", default=[],
                        help="the order seed of a run (repeatable; runs beyond these get random seeds)")  # fmt: skip
    parser.add_argument("--out", type=Path, help="where logs and JUnit XML go (default: a new temporary folder)")
    parser.add_argument("pytest_args", nargs="*", help="after --: what pytest runs (default: the whole suite)")
    args = parser.parse_args(argv)
    if args.runs < 1 or not 0 <= args.load <= 100:
        parser.error("--runs must be >= 1 and --load in 0..100")
    out: Path = args.out or Path(tempfile.mkdtemp(prefix="flake-hunt-"))
    out.mkdir(parents=True, exist_ok=True)
    seeds = [*args.seed, *(random.randint(1, 999_999) for _ in range(args.runs - len(args.seed)))][: args.runs]
    runs: list[Run] = []
    with cpu_load(args.load) as load:
        print(f"flake hunt: {args.runs} run(s) beside {load}; logs in {out}", flush=True)
        for index, seed in enumerate(seeds, 1):
            run = one_run(index, seed, args.pytest_args, out)
            runs.append(run)
            print(f"  run {index}/{args.runs} (seed {seed}, {run.seconds:.0f} s): {run.summary}", flush=True)
    return report(runs, args.pytest_args, load, out)


if __name__ == "__main__":
    sys.exit(main())

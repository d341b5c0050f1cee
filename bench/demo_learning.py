"""Does the demo's tiny policy visibly learn, within the time budget? (`python -m bench.demo_learning`)

Runs the default `rewardmesh demo` in a subprocess and checks the issue's bar: on a 2-core CPU the
run takes at most 3 minutes and the mean score of the last 10 steps is at least twice that of the
first 10. A measurement, not a test: it prints PASS/FAIL and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, help="override the demo's default step count")
    parser.add_argument("--budget-s", type=float, default=180.0, help="wall-clock budget (default %(default)s)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.json"
        cmd = [sys.executable, "-m", "server.cli", "demo", "--metrics-out", str(metrics),
               "--plot", str(Path(tmp) / "curve.png")]  # fmt: skip
        if args.steps:
            cmd += ["--steps", str(args.steps)]
        print("running:", " ".join(cmd), flush=True)
        started = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - started
        history = json.loads(metrics.read_text())
    scores = [h["score"] for h in history]
    first, last = statistics.fmean(scores[:10]), statistics.fmean(scores[-10:])
    ratio = last / max(first, 1e-9)
    print(f"| machine | {os.cpu_count()} CPUs |")
    print("| steps | wall s | mean score, first 10 | mean score, last 10 | ratio | budget | learns 2x |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {len(scores)} | {wall:.0f} | {first:.3f} | {last:.3f} | {ratio:.1f}x | "
          f"{'PASS' if wall <= args.budget_s else 'FAIL'} (<= {args.budget_s:.0f} s) | "
          f"{'PASS' if ratio >= 2 else 'FAIL'} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

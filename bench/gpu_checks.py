"""Every check that needs a GPU, in one go, in one table: run it whenever a CUDA machine with vLLM is at hand.

    python -m bench.gpu_checks [--out DIR] [--only NAME,...] [--deadline-s 480] [--dry-run]
    make gpu-checks                      (the same, with the project's .venv)

In order (the most important first, each with its own time limit, all within --deadline-s):

1. `vllm-tests`: the vLLM backend's tests (tests/server/rollout/test_vllm_backend.py), the engine ones on the GPU;
2. `cuda-ipc-tests`: the CUDA IPC data plane's tests (tests/common/test_cuda_ipc.py);
3. `reward-model-tests`: the reward model's tests (tests/reward_engine/test_reward_model.py, and those of
   tests/reward_engine/test_capacity.py: on the GPU, a tenant's batch sent first goes before the batch staged);
4. `rollout-tiny`: rollout throughput with the tiny policy: offline `LLM.generate`, bare `AsyncLLM`, the mesh
   (bench.rollout_throughput --modes vllm);
5. `rollout-1.5b`: the same with a random Qwen2.5-1.5B-shaped policy in bf16, built on the machine;
6. `reward-model`: a random Qwen2.5-0.5B-shaped reward model on the GPU: offline batches against the same samples
   dynamically batched through `rewardmesh serve reward` (bench.reward_batching --device cuda);
7. `weight-sync`: a ~160M-parameter update from a trainer on the same GPU over CUDA IPC through vLLM's
   weight-transfer engine, in GB/s (bench.weight_sync --transports ipc --backend vllm).

Each step is a process of its own; its output goes to DIR/<name>.log and its numbers to DIR/<name>.json, the table
to DIR/gpu_checks.md. The table is printed as each step ends, so a run cut short still shows what it measured.
Where there is no CUDA GPU the steps that do not need one run (the test files run their CPU parts) and the run
stops at the first one that does, saying so (exit code 2). A vLLM build without flash-attention kernels takes
its attention backend from the environment: REWARDMESH_ENGINE_ARG=attention_backend=TRITON_ATTN.

Exit code: 0 every step ran and passed, 1 a step failed or ran out of time, 2 stopped: no CUDA GPU here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import machine_info, markdown_table

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Step:
    name: str
    what: str
    argv: list[str]  # after the interpreter
    needs_cuda: bool
    limit_s: int  # its own time limit
    summarize: Callable[[str, Path], tuple[bool, str]]  # (output, its JSON file) -> (passed, what it measured)
    env: dict[str, str] = field(default_factory=dict)
    needs_vllm: bool = True  # the test files of the CUDA IPC data plane and of the reward model run without it


@dataclass
class StepResult:
    """How one check step ended, for the summary table."""

    step: Step
    state: str  # "passed" | "failed" | "timed out" | "not run: ..."
    summary: str = ""
    seconds: float = 0.0


# ------------------------------------------------------------------------------------------------ summaries


def pytest_summary(output: str, _: Path) -> tuple[bool, str]:
    """pytest's last line ("12 passed, 3 skipped in 40.1s"); passed when nothing failed or errored."""
    lines = [ln.strip("= ") for ln in output.splitlines() if re.search(r"\d+ (passed|failed|error|skipped)", ln)]
    if not lines:
        return False, "no pytest summary (see the log)"
    last = lines[-1]
    return not re.search(r"\d+ (failed|error)", last), re.sub(r" in [\d.]+s.*", "", last)


def rollout_summary(_: str, out: Path) -> tuple[bool, str]:
    """Tokens/s per path and the mesh's ratios (bench.rollout_throughput's JSON)."""
    res = json.loads(out.read_text())["vllm"]
    tps = res["tokens_per_s"]
    return True, (
        f"tokens/s: offline {tps['offline']:,.0f}, AsyncLLM {tps['async']:,.0f}, mesh {tps['mesh']:,.0f}; "
        f"mesh/AsyncLLM **{res['mesh_vs_async']:.2f}**, mesh/offline **{res['mesh_vs_offline']:.2f}**"
    )


def reward_summary(_: str, out: Path) -> tuple[bool, str]:
    """Offline batches against dynamic batching through the server (bench.reward_batching's JSON)."""
    res = json.loads(out.read_text())
    a, b = res["offline"]["throughput"], res["batching"]["throughput"]
    return res.get("server_exit_code") == 0, (
        f"samples/s: offline batches {a:,.1f}, through the server {b:,.1f} (mean batch "
        f"{res['batching'].get('mean_batch_size', 0):.1f}); served/offline **{b / a:.2f}**; full batch "
        f"{res['full_batch_ms']:.1f} ms"
    )


def weight_sync_summary(output: str, _: Path) -> tuple[bool, str]:
    """The CUDA IPC end-to-end rate line of bench.weight_sync's table."""
    m = re.search(r"\| ipc end to end, 1 server \(GB/s, not a ratio\) \| ([\d.]+)x", output)
    size = re.search(r"weight sync: ([\d.]+)M parameters, (\d+) MB", output)
    if m is None:
        return False, "no CUDA IPC rate in the output (see the log)"
    what = f"{size[1]}M parameters, {size[2]} MB bf16: " if size else ""
    return True, f"{what}update_weights over CUDA IPC **{float(m[1]):.1f} GB/s** end to end"


# ------------------------------------------------------------------------------------------------ the plan


def steps(out: Path) -> list[Step]:
    py = ["-m", "pytest", "-q", "-p", "no:cacheprovider"]
    rollout = ["-m", "bench.rollout_throughput", "--modes", "vllm", "--vllm-gpu-memory-utilization", "0.3"]
    return [
        Step("vllm-tests", "the vLLM backend's tests", [*py, "tests/server/rollout/test_vllm_backend.py"], False,
             300, pytest_summary, {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}),
        Step("cuda-ipc-tests", "the CUDA IPC tests", [*py, "tests/common/test_cuda_ipc.py"], False, 120,
             pytest_summary, needs_vllm=False),
        Step("reward-model-tests", "the reward model's tests, a batch sent first going before the staged one",
             [*py, "-k", "reward_model", "tests/reward_engine/test_reward_model.py",
              "tests/reward_engine/test_capacity.py"], False, 120, pytest_summary, needs_vllm=False),
        Step("rollout-tiny", "rollout throughput, tiny policy (64 prompts x n=8, 64 tokens)",
             [*rollout, "--rounds", "3", "--json-out", str(out / "rollout-tiny.json")], True, 180, rollout_summary),
        Step("rollout-1.5b", "rollout throughput, Qwen2.5-1.5B shape, bf16 (64 prompts x n=8, 128 tokens)",
             [*rollout, "--vllm-shape", "qwen2.5-1.5b", "--vllm-max-model-len", "1024", "--vllm-max-tokens", "128",
              "--rounds", "2", "--json-out", str(out / "rollout-1.5b.json")], True, 300, rollout_summary),
        Step("reward-model", "reward model on the GPU, Qwen2.5-0.5B shape: offline batches vs the server",
             ["-m", "bench.reward_batching", "--device", "cuda", "--shape", "qwen2.5-0.5b-rm", "--samples", "4096",
              "--rounds", "2", "--max-extra-rounds", "0", "--transport-samples", "4000", "--transport-rounds", "2",
              "--no-progress", "--json-out", str(out / "reward-model.json")], True, 180, reward_summary),
        Step("weight-sync", "CUDA IPC weight sync into vLLM, ~160M parameters",
             ["-m", "bench.weight_sync", "--device", "cuda", "--backend", "vllm", "--transports", "ipc",
              "--server-counts", "1", "--params", "160e6", "--rounds", "3"], True, 180, weight_sync_summary),
    ]  # fmt: skip


# ------------------------------------------------------------------------------------------------- running


def cuda_here() -> str:
    """Empty when a CUDA GPU is usable here, else why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA GPU (torch.cuda.is_available() is False)"
    return ""


def vllm_here() -> str:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "vLLM is not installed (GPU: `make install-gpu`; a CPU: `make test-vllm` builds .venv-vllm)"
    return ""


def blocker(step: Step, no_cuda: str, no_vllm: str) -> str:
    """Why this step cannot run here ("" if it can): no CUDA GPU, or no vLLM, where the step needs them."""
    if step.needs_cuda and no_cuda:
        return f"needs a CUDA GPU: {no_cuda}"
    if no_vllm and step.needs_vllm:
        return no_vllm
    return ""


def run_step(step: Step, out: Path, limit_s: float) -> StepResult:
    log = out / f"{step.name}.log"
    started = time.monotonic()
    env = {**os.environ, **step.env, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as f:
        f.write(f"$ {sys.executable} {' '.join(step.argv)}\n")
        f.flush()
        try:
            proc = subprocess.run([sys.executable, *step.argv], cwd=REPO, env=env, stdout=f,
                                  stderr=subprocess.STDOUT, timeout=limit_s, check=False)  # fmt: skip
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
    seconds = time.monotonic() - started
    output = log.read_text(errors="replace")
    if code is None:
        return StepResult(step, "timed out", f"after {limit_s:.0f} s (see {log.name})", seconds)
    try:
        passed, summary = step.summarize(output, out / f"{step.name}.json")
    except (OSError, ValueError, KeyError) as exc:
        passed, summary = False, f"no result ({type(exc).__name__}: {exc}; see {log.name})"
    if code != 0:
        passed, summary = False, f"exit code {code}; {summary}"
    return StepResult(step, "passed" if passed else "failed", summary, seconds)


def table(outcomes: list[StepResult]) -> str:
    rows = [[o.step.name, o.step.what, o.state, o.summary, f"{o.seconds:.0f}" if o.seconds else ""] for o in outcomes]
    return markdown_table(["check", "what", "result", "measured", "s"], rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_checks", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--out", type=Path, help="logs, JSON and the table go here (default: $OUT, else a new temporary "
                   "directory)")  # fmt: skip
    p.add_argument("--only", default="", help="comma-separated step names (default: every step)")
    p.add_argument("--deadline-s", type=float, default=480.0, help="the whole run's time limit")
    p.add_argument("--dry-run", action="store_true", help="print the steps and what would run here, run nothing")
    args = p.parse_args(argv)
    given = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    # A new temporary directory only for a real run (a dry run writes nothing).
    out = (given or Path(tempfile.gettempdir()) / f"rewardmesh-gpu-checks-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    plan = steps(out)
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - {s.name for s in plan})
        if unknown:
            p.error(f"--only: unknown step(s) {', '.join(unknown)}; the steps: {', '.join(s.name for s in plan)}")
        plan = [s for s in plan if s.name in wanted]
    no_cuda, no_vllm = cuda_here(), vllm_here()
    m = machine_info()
    header = (f"Machine: {m['cpu']}, {m['usable_cpus']} usable cores, {m['device']}, torch {m['torch']}, "
              f"Python {m['python']}; {'vLLM: ' + no_vllm if no_vllm else 'vLLM installed'}; "
              f"engine arguments from the environment: {os.environ.get('REWARDMESH_ENGINE_ARG', 'none')}")  # fmt: skip
    print(header, flush=True)
    if args.dry_run:
        for s in plan:
            verdict = blocker(s, no_cuda, no_vllm) or "runs"
            print(f"{s.name}: {verdict} (limit {s.limit_s} s): python {' '.join(s.argv)}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    print(f"logs, JSON and the table: {out}", flush=True)
    deadline = time.monotonic() + args.deadline_s
    outcomes: list[StepResult] = []
    stopped = ""
    for s in plan:
        left = deadline - time.monotonic()
        why = blocker(s, no_cuda, no_vllm)
        if stopped:
            outcomes.append(StepResult(s, "not run", stopped))
        elif s.needs_cuda and no_cuda:
            stopped = f"no CUDA GPU here ({no_cuda})"
            outcomes.append(StepResult(s, "not run", stopped))
            print(f"\nstopped at {s.name}: it needs a CUDA GPU, and {no_cuda}; not run: "
                  f"{', '.join(x.name for x in plan[plan.index(s):])}", flush=True)  # fmt: skip
        elif why:
            outcomes.append(StepResult(s, "not run", why))
        elif left < 30:
            outcomes.append(StepResult(s, "not run", f"the run's {args.deadline_s:.0f} s were spent"))
        else:
            limit = min(s.limit_s, left)
            print(f"\n[gpu_checks {time.strftime('%H:%M:%S')}] {s.name}: {s.what} (limit {limit:.0f} s)", flush=True)
            outcome = run_step(s, out, limit)
            outcomes.append(outcome)
            print(f"[gpu_checks] {s.name}: {outcome.state} in {outcome.seconds:.0f} s: {outcome.summary}", flush=True)
    text = "\n".join([header, "", table(outcomes)])
    (out / "gpu_checks.md").write_text(text + "\n")
    (out / "gpu_checks.json").write_text(json.dumps(
        {"machine": m, "steps": [{"name": o.step.name, "result": o.state, "measured": o.summary,
                                  "seconds": o.seconds} for o in outcomes]}, indent=2) + "\n")  # fmt: skip
    print("\n" + text, flush=True)
    if stopped.startswith("no CUDA"):
        return 2
    return 0 if all(o.state == "passed" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())

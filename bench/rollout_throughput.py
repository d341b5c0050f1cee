"""Benchmark: rollouts through the mesh against the bare engine, on the same prompts, in one run.

    python -m bench.rollout_throughput [--modes instant,hf,vllm] [--json-out FILE]

Every mode drives the whole mesh as a user would: `TrainerClient.generate_batch` in this process ->
a rollout server in its own process -> a reward server in its own process (`rewardmesh serve reward`,
the built-in `noop` or `first_number` pipeline) -> back. Modes alternate with their bare baseline
round by round and medians are reported. CPU time per sample is read from /proc for each process.

- `instant`: a stand-in engine that answers every request at once with a fixed response (no model).
  What remains is the mesh's own cost per sample (Generate, agent loop, Score stream, batcher, protobuf
  and tensor conversions, trainer assembly), reported as samples/s per CPU core (samples over the CPU
  seconds of all three processes) and CPU microseconds per sample in each process. Runs anywhere.
- `hf`: the tiny policy on the CPU through `rewardmesh serve rollout --backend hf` against a bare
  transformers `generate` of the same batch in this process (same prompts, n, max_tokens, sampling,
  torch threads); tokens/s and the ratio.
- `vllm`: `rewardmesh serve rollout --backend vllm` against vLLM's offline `LLM.generate` and a bare `AsyncLLM`
  with every request in flight (one request of n samples per prompt, final outputs only), on the same engine
  arguments (scheduler limits explicit on every path), every sample to max_tokens; on vLLM's CPU build
  (`.venv-vllm`) or a GPU; skipped where vLLM is not installed. The policy is the tiny one, a local directory
  (`--vllm-model`) or a model of a real shape built here (`--vllm-shape qwen2.5-0.5b`, bf16; see
  `rewardmesh tiny-models --shape`).

The rollout server with the instant engine is this module run as
`python -m bench.rollout_throughput serve-instant --reward-target HOST:PORT`.

Prints markdown tables and exits 0 whether or not targets are met: it is a measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import cpu_snapshot, cpu_usage, echo_server_argv, machine_info, markdown_table, progress
from rewardmesh.demo.model_shapes import SHAPES
from rewardmesh.demo.server_process import ServerProcess
from rewardmesh.server.rollout.backends.base import Backend

POLICY_SHAPES = [name for name, shape in SHAPES.items() if shape.kind == "policy"]
REWARD_SERVICE = "rewardmesh.v1.RewardService"
ROLLOUT_SERVICE = "rewardmesh.v1.RolloutService"
TARGET_MESH_VS_BARE = 0.9  # GPU target of the throughput issue


# ------------------------------------------------------------------------------------------ instant engine


class InstantBackend(Backend):
    """A generation engine that costs nothing: every request is answered at once with `response_tokens`
    fixed token ids (finish reason "length"), so only the mesh's own work is left to measure."""

    name = "instant"

    def __init__(self, tokenizer: Any, response_tokens: int, max_model_len: int = 4096) -> None:
        import torch

        self.tokenizer = tokenizer
        self.model = "instant"
        self.max_model_len = max_model_len
        self.policy_version = 0
        vocab = len(tokenizer)
        self._ids = [5 + (i * 7) % max(1, vocab - 10) for i in range(response_tokens)]
        self._weights = {"w": torch.zeros(1)}

    @property
    def running(self) -> int:
        return 0

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def generate(self, request: Any) -> Any:
        from rewardmesh.server.rollout.backends.base import GenerationOutput

        return GenerationOutput(list(self._ids[: request.max_tokens]), "length", 0, self.policy_version)

    def weight_specs(self) -> dict[str, Any]:
        return {k: (tuple(v.shape), v.dtype) for k, v in self._weights.items()}

    async def update_weights(self, tensors: dict[str, Any], version: int) -> None:
        self.policy_version = version


async def serve_instant(host: str, port: int, reward_target: str, response_tokens: int, port_file: str = "") -> None:
    """A rollout server process with the instant engine (the tiny tokenizer, built in memory)."""
    from rewardmesh.demo.tiny_models import build_tokenizer
    from rewardmesh.server.rollout.server import RolloutServer
    from rewardmesh.server.serving import ServerOptions

    backend = InstantBackend(build_tokenizer(), response_tokens)
    targets = [t for t in reward_target.split(",") if t]
    server = RolloutServer(backend, targets, ServerOptions(host=host, port=port, grace_s=2, port_file=port_file))
    await server.start()
    server.grpc.stop_on_signals()
    await server.wait()
    if server.rewards is not None:
        await server.rewards.close()


# ------------------------------------------------------------------------------------------- measurements


@dataclass
class Round:
    """One timed pass of one path."""

    path: str
    samples: int
    tokens: int
    elapsed_s: float
    cpu_s: dict[str, float] = field(default_factory=dict)  # process role -> CPU seconds
    other_cores: float | None = None
    errors: int = 0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.elapsed_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s


async def timed(path: str, run: Callable[[], Awaitable[tuple[int, int, int]]], pids: dict[str, int]) -> Round:
    """Run one pass and account the CPU of every named process (`pids`: role -> pid; 0 = this process)."""
    real = {role: pid or os.getpid() for role, pid in pids.items()}
    before = cpu_snapshot(list(real.values()))
    t = time.perf_counter()
    samples, tokens, errors = await run()
    elapsed = time.perf_counter() - t
    usage = cpu_usage(before, cpu_snapshot(list(real.values())))
    r = Round(path, samples, tokens, elapsed, errors=errors)
    if usage is not None:
        r.cpu_s = {role: usage.process_s.get(pid, 0.0) for role, pid in real.items()}
        r.other_cores = usage.other_cores
    return r


def prompt_specs(count: int, prompt_tokens: int, vocab: int, seed: int) -> list[Any]:
    from rewardmesh.client.trainer import PromptSpec

    rng = np.random.default_rng(seed)
    ids = rng.integers(5, vocab - 1, size=(count, prompt_tokens), dtype=np.int32)
    return [PromptSpec(token_ids=row.tolist(), ground_truth="0") for row in ids]


async def mesh_pass(client: Any, prompts: Sequence[Any], n: int, reward: str, sampling: Any) -> tuple[int, int, int]:
    batch = await client.generate_batch(prompts, n=n, reward=reward, sampling=sampling)
    tokens = int(sum(len(s.response_ids) for s in batch.samples))
    return len(batch.samples), tokens, sum(1 for s in batch.samples if s.error)


def median_round(rounds: Sequence[Round]) -> Round:
    ordered = sorted(rounds, key=lambda r: r.elapsed_s)
    return ordered[len(ordered) // 2]


def med(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


# ------------------------------------------------------------------------------------------------ instant


async def run_instant(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from rewardmesh.client.trainer import Sampling, TrainerClient
    from rewardmesh.demo.tiny_models import build_tokenizer

    tokenizer = build_tokenizer()
    prompts = prompt_specs(args.prompts, args.prompt_tokens, len(tokenizer), args.seed)
    sampling = Sampling(max_tokens=args.response_tokens)
    # --echo-reward: the bare grpc.aio echo server (bench/common.py) as the reward target, the reward side's floor.
    reward = ServerProcess("reward-instant", echo_server_argv() if args.echo_reward else reward_argv(), workdir)
    reward.start()
    rollout: ServerProcess | None = None
    try:
        await reward.wait_serving(REWARD_SERVICE)
        rollout = ServerProcess(
            "rollout-instant",
            [
                sys.executable,
                "-m",
                "bench.rollout_throughput",
                "serve-instant",
                "--reward-target",
                reward.address,
                "--response-tokens",
                str(args.response_tokens),
            ],
            workdir,
        )
        rollout.start()
        await rollout.wait_serving(ROLLOUT_SERVICE)
        bare_engine = InstantBackend(tokenizer, args.response_tokens)

        async def bare() -> tuple[int, int, int]:
            from rewardmesh.server.rollout.backends.base import GenerationRequest

            reqs = [GenerationRequest(prompt_ids=list(p.token_ids), max_tokens=args.response_tokens)
                    for p in prompts for _ in range(args.n)]  # fmt: skip
            outs = await asyncio.gather(*(bare_engine.generate(r) for r in reqs))
            return len(outs), sum(len(o.token_ids) for o in outs), 0

        pids = {"trainer": 0, "rollout": rollout.pid, "reward": reward.pid}
        rounds: dict[str, list[Round]] = {"bare": [], "mesh": []}
        async with TrainerClient([rollout.address], reward="noop", sampling=sampling) as client:
            await mesh_pass(client, prompts[: max(1, len(prompts) // 4)], args.n, "noop", sampling)  # warm up
            for r in range(args.rounds):
                rounds["bare"].append(await timed("bare", bare, {"trainer": 0}))
                mesh = await timed("mesh", lambda: mesh_pass(client, prompts, args.n, "noop", sampling), pids)
                rounds["mesh"].append(mesh)
                cores = sum(mesh.cpu_s.values()) / mesh.elapsed_s
                progress(
                    f"instant round {r + 1}: mesh {mesh.samples_per_s:,.0f} samples/s, "
                    f"{mesh.samples / max(1e-9, sum(mesh.cpu_s.values())):,.0f} samples/s per CPU core "
                    f"({cores:.2f} cores busy; other processes {mesh.other_cores or 0:.2f} cores)"
                )
    finally:
        if rollout is not None:
            rollout.stop()
        reward.stop()
    return summarize_instant(rounds) | {"score_messages": score_messages(reward.log_text())}


def score_messages(reward_log: str) -> dict[str, int] | None:
    """Results and Score messages (in, out) over the reward server's life, from its shutdown log line: how
    many samples share a message decides the per-message gRPC cost per sample."""
    m = re.search(r"after sending (\d+) results \(Score messages: (\d+) in, (\d+) out\)", reward_log)
    return None if m is None else {"results": int(m[1]), "in": int(m[2]), "out": int(m[3])}


def summarize_instant(rounds: dict[str, list[Round]]) -> dict[str, Any]:
    mesh = rounds["mesh"]
    per_core = [r.samples / sum(r.cpu_s.values()) for r in mesh if r.cpu_s]
    roles = ("trainer", "rollout", "reward")
    return {
        "samples": mesh[0].samples,
        "errors": sum(r.errors for r in mesh),
        "bare_samples_per_s": med([r.samples_per_s for r in rounds["bare"]]),
        "mesh_samples_per_s": med([r.samples_per_s for r in mesh]),
        "samples_per_s_per_core": med(per_core),
        "rounds_per_core": per_core,
        "cpu_us_per_sample": {
            role: med([r.cpu_s[role] / r.samples * 1e6 for r in mesh if role in r.cpu_s]) for role in roles
        },
        "total_cpu_us_per_sample": med([sum(r.cpu_s.values()) / r.samples * 1e6 for r in mesh if r.cpu_s]),
        "other_cores": med([r.other_cores or 0.0 for r in mesh]),
    }


def render_instant(res: dict[str, Any], args: argparse.Namespace) -> str:
    cpu = res["cpu_us_per_sample"]
    rows = [
        ["bare instant engine (in process)", f"{res['bare_samples_per_s']:,.0f}", "", ""],
        [
            "mesh: trainer -> rollout server -> "
            + ("bare echo server" if args.echo_reward else "reward server (`noop`)")
            + " -> back",
            f"{res['mesh_samples_per_s']:,.0f}",
            f"{res['samples_per_s_per_core']:,.0f}",
            f"{res['total_cpu_us_per_sample']:,.0f} µs (trainer {cpu['trainer']:,.0f} / rollout "
            f"{cpu['rollout']:,.0f} / reward {cpu['reward']:,.0f})",
        ],
    ]
    return "\n".join([
        f"### Instant engine: the mesh's own cost ({args.prompts} prompts x n={args.n}, "
        f"{args.prompt_tokens}-token prompts, {args.response_tokens}-token responses, {args.rounds} rounds, medians)",
        "",
        markdown_table(["path", "samples/s", "samples/s per CPU core", "CPU per sample (all processes)"], rows),
        "",
        f"Errors: {res['errors']}. CPU of other processes during the mesh rounds: {res['other_cores']:.2f} cores "
        f"(median). Per-core rounds: {', '.join(f'{x:,.0f}' for x in res['rounds_per_core'])}.",
        _messages_line(res.get("score_messages")),
    ])  # fmt: skip


def _messages_line(msgs: dict[str, int] | None) -> str:
    if not msgs or not msgs["in"] or not msgs["out"]:
        return "Score messages: not reported by the reward server."
    return (
        f"Score stream (whole run, warmup included): {msgs['results']:,} results, "
        f"{msgs['results'] / msgs['in']:.1f} samples per request message, "
        f"{msgs['results'] / msgs['out']:.1f} per response message."
    )


# ------------------------------------------------------------------------------------------------------ hf


def reward_argv() -> list[str]:
    return [sys.executable, "-m", "rewardmesh.server.cli", "serve", "reward", "--host", "127.0.0.1", "--port", "0",
            "--grace-s", "2"]  # fmt: skip


async def run_hf(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rewardmesh.client.trainer import Sampling, TrainerClient
    from rewardmesh.demo.tiny_models import build_tiny_models

    paths = build_tiny_models(args.models)
    policy = str(paths.policy)
    batch = args.hf_prompts * args.hf_n
    torch.set_num_threads(args.threads)
    env_threads = {"OMP_NUM_THREADS": str(args.threads)}
    tokenizer = AutoTokenizer.from_pretrained(policy, local_files_only=True)
    prompts = prompt_specs(args.hf_prompts, args.prompt_tokens, len(tokenizer), args.seed)
    sampling = Sampling(temperature=1.0, max_tokens=args.hf_max_tokens, seed=args.seed)
    reward = ServerProcess("reward-hf", reward_argv(), workdir)
    rollout_argv = [sys.executable, "-m", "rewardmesh.server.cli", "serve", "rollout", "--host", "127.0.0.1",
                    "--port", "0",
                    "--backend", "hf", "--model", policy, "--device", "cpu", "--max-num-seqs", str(batch),
                    "--grace-s", "2"]  # fmt: skip
    os.environ.update(env_threads)  # the rollout server's torch uses the same thread count as the bare run
    reward.start()
    rollout: ServerProcess | None = None
    try:
        await reward.wait_serving(REWARD_SERVICE)
        rollout = ServerProcess("rollout-hf", [*rollout_argv, "--reward-target", reward.address], workdir)
        rollout.start()
        await rollout.wait_serving(ROLLOUT_SERVICE)
        model: Any = AutoModelForCausalLM.from_pretrained(policy, local_files_only=True, dtype=torch.float32)
        model.eval()
        eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        input_ids = torch.tensor([p.token_ids for p in prompts], dtype=torch.long)  # equal lengths: no padding

        async def bare() -> tuple[int, int, int]:
            def gen() -> torch.Tensor:
                with torch.inference_mode():
                    return model.generate(
                        input_ids=input_ids,
                        attention_mask=torch.ones_like(input_ids),
                        do_sample=True,
                        temperature=1.0,
                        top_p=1.0,
                        top_k=0,
                        max_new_tokens=args.hf_max_tokens,
                        num_return_sequences=args.hf_n,
                        pad_token_id=pad,
                        eos_token_id=eos,
                    )

            out = gen()[:, input_ids.shape[1] :]
            tokens = 0
            for row in out.tolist():  # count up to and including the first eos, as the backend does
                tokens += (row.index(eos) + 1) if eos in row else len(row)
            return out.shape[0], tokens, 0

        pids = {"trainer": 0, "rollout": rollout.pid, "reward": reward.pid}
        rounds: dict[str, list[Round]] = {"bare": [], "mesh": []}
        async with TrainerClient([rollout.address], reward="noop", sampling=sampling) as client:
            await mesh_pass(client, prompts, args.hf_n, "noop", sampling)
            await bare()
            for r in range(args.rounds):
                rounds["bare"].append(await timed("bare", bare, {"trainer": 0}))
                rounds["mesh"].append(
                    await timed("mesh", lambda: mesh_pass(client, prompts, args.hf_n, "noop", sampling), pids)
                )
                progress(
                    f"hf round {r + 1}: bare {rounds['bare'][-1].tokens_per_s:,.0f} tokens/s, "
                    f"mesh {rounds['mesh'][-1].tokens_per_s:,.0f} tokens/s"
                )
    finally:
        if rollout is not None:
            rollout.stop()
        reward.stop()
    bare_tps = med([r.tokens_per_s for r in rounds["bare"]])
    mesh_tps = med([r.tokens_per_s for r in rounds["mesh"]])
    mesh = rounds["mesh"]
    return {
        "batch": batch,
        "bare_tokens_per_s": bare_tps,
        "mesh_tokens_per_s": mesh_tps,
        "ratio": mesh_tps / bare_tps if bare_tps else 0.0,
        "ratios": [m.tokens_per_s / b.tokens_per_s for m, b in zip(mesh, rounds["bare"], strict=True)],
        "cpu_us_per_sample": {
            role: med([r.cpu_s[role] / r.samples * 1e6 for r in mesh if role in r.cpu_s])
            for role in ("trainer", "rollout", "reward")
        },
        "bare_cpu_us_per_sample": med([r.cpu_s["trainer"] / r.samples * 1e6 for r in rounds["bare"] if r.cpu_s]),
        "errors": sum(r.errors for r in mesh),
    }


def render_hf(res: dict[str, Any], args: argparse.Namespace) -> str:
    cpu = res["cpu_us_per_sample"]
    rows = [
        ["bare transformers `generate` (one batch, in process)", f"{res['bare_tokens_per_s']:,.0f}", "1.00",
         f"{res['bare_cpu_us_per_sample']:,.0f} µs"],
        ["mesh: TrainerClient -> `serve rollout --backend hf` -> `serve reward` (`noop`)",
         f"{res['mesh_tokens_per_s']:,.0f}", f"{res['ratio']:.2f}",
         f"trainer {cpu['trainer']:,.0f} / rollout {cpu['rollout']:,.0f} / reward {cpu['reward']:,.0f} µs"],
    ]  # fmt: skip
    return "\n".join([
        f"### hf backend on the CPU ({args.hf_prompts} prompts x n={args.hf_n} = {res['batch']} samples, "
        f"max_tokens {args.hf_max_tokens}, temperature 1, torch threads {args.threads}, {args.rounds} rounds, medians)",
        "",
        markdown_table(["path", "tokens/s", "ratio", "CPU per sample"], rows),
        "",
        f"Per-round ratios: {', '.join(f'{x:.2f}' for x in res['ratios'])}. Errors: {res['errors']}.",
    ])  # fmt: skip


# ---------------------------------------------------------------------------------------------------- vLLM


def vllm_available() -> str:
    """Empty when the vLLM mode can run here (vLLM's CPU build or a GPU build), else why not."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "vllm is not installed (CPU: `make test-vllm` builds .venv-vllm; GPU: `make install-gpu`)"
    return ""


def vllm_engine_args(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """The engine arguments every path gets: the same model, seed and memory, the scheduler limits made explicit
    (by default the ones vLLM's offline ``LLM`` picks for this machine), and any --vllm-engine-arg."""
    from vllm import AsyncEngineArgs  # type: ignore[import-not-found,unused-ignore]

    from rewardmesh.server.rollout.backends.vllm_engine import (
        engine_args_from_env,
        llm_usage_context,
        parse_engine_args,
    )

    extra = {**engine_args_from_env(), **parse_engine_args(args.vllm_engine_arg)}
    kwargs: dict[str, Any] = {"model": model, "seed": args.seed, "disable_log_stats": True,
                              "gpu_memory_utilization": args.vllm_gpu_memory_utilization, **extra}  # fmt: skip
    if args.vllm_max_model_len:
        kwargs["max_model_len"] = args.vllm_max_model_len
    if args.vllm_max_num_seqs:
        kwargs["max_num_seqs"] = args.vllm_max_num_seqs
    if args.vllm_max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.vllm_max_num_batched_tokens
    if "max_num_seqs" not in kwargs or "max_num_batched_tokens" not in kwargs:
        scheduler = AsyncEngineArgs(**kwargs).create_engine_config(llm_usage_context()).scheduler_config
        kwargs.setdefault("max_num_seqs", scheduler.max_num_seqs)
        kwargs.setdefault("max_num_batched_tokens", scheduler.max_num_batched_tokens)
    return kwargs


async def run_vllm(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Mesh vs vLLM offline `LLM.generate` vs bare `AsyncLLM` with every request in flight, on the same engine
    arguments; every sample runs to max_tokens (ignore_eos). On a CPU the three engines stay up together and the
    paths alternate round by round (each engine idles while another runs); on a GPU, whose memory they could not
    share, each path runs in its own phase."""
    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, AsyncEngineArgs, SamplingParams  # type: ignore[import-not-found,unused-ignore]
    from vllm.sampling_params import RequestOutputKind  # type: ignore[import-not-found,unused-ignore]
    from vllm.v1.engine.async_llm import AsyncLLM  # type: ignore[import-not-found,unused-ignore]

    from rewardmesh.client.trainer import Sampling, TrainerClient
    from rewardmesh.server.rollout.backends.vllm_outputs import token_prompt

    model = str(vllm_policy(args))
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    prompts = prompt_specs(args.vllm_prompts, args.prompt_tokens, len(tokenizer), args.seed)
    kwargs = vllm_engine_args(args, model)
    # The bare engine at its best: one request of n samples per prompt, final outputs only (no per-token outputs).
    params = SamplingParams(n=args.vllm_n, temperature=1.0, max_tokens=args.vllm_max_tokens, seed=args.seed,
                            ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
    token_prompts = [token_prompt(list(p.token_ids)) for p in prompts]
    sampling = Sampling(temperature=1.0, max_tokens=args.vllm_max_tokens, seed=args.seed, ignore_eos=True)
    results: dict[str, list[float]] = {"offline": [], "async": [], "mesh": []}
    mesh_pids: dict[str, int] = {}
    progress(f"vllm: engine arguments on every path: {kwargs}")

    @contextlib.asynccontextmanager
    async def offline() -> AsyncIterator[Callable[[], Awaitable[int]]]:
        llm = LLM(**kwargs)

        async def run() -> int:
            outs = llm.generate(token_prompts, params, use_tqdm=False)
            return sum(len(c.token_ids) for o in outs for c in o.outputs)

        try:
            yield run
        finally:
            core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if core is not None:  # stop its processes now, not when the garbage collector gets to it
                core.shutdown()
            _free_memory()

    @contextlib.asynccontextmanager
    async def bare_async() -> AsyncIterator[Callable[[], Awaitable[int]]]:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

        async def one(i: int, prompt: Any) -> int:
            last = None
            async for out in engine.generate(prompt, params, request_id=f"bench-{time.monotonic_ns()}-{i}"):
                last = out
            return sum(len(c.token_ids) for c in last.outputs) if last is not None else 0

        async def run() -> int:
            return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(token_prompts))))

        try:
            yield run
        finally:
            engine.shutdown()
            _free_memory()

    @contextlib.asynccontextmanager
    async def mesh() -> AsyncIterator[Callable[[], Awaitable[int]]]:
        reward = ServerProcess("reward-vllm", reward_argv(), workdir)
        reward.start()
        rollout: ServerProcess | None = None
        flags = [f"--engine-arg={k}={json.dumps(v)}" for k, v in kwargs.items() if k != "model"]
        try:
            await reward.wait_serving(REWARD_SERVICE)
            rollout = ServerProcess("rollout-vllm", [*rollout_argv("vllm", model, reward.address), *flags], workdir)
            rollout.start(timeout_s=900)
            await rollout.wait_serving(ROLLOUT_SERVICE, timeout_s=900)
            mesh_pids.update(rollout=rollout.pid, reward=reward.pid)
            async with TrainerClient([rollout.address], reward="noop", sampling=sampling) as client:

                async def run() -> int:
                    _, tokens, errors = await mesh_pass(client, prompts, args.vllm_n, "noop", sampling)
                    if errors:
                        raise RuntimeError(f"{errors} samples failed in the mesh")
                    return tokens

                yield run
        finally:
            if rollout is not None:
                rollout.stop()
            reward.stop()

    paths = {"offline": offline, "async": bare_async, "mesh": mesh}

    samples = len(prompts) * args.vllm_n
    # CPU per sample of the front ends (the engines' own processes are not counted): this process for the in-process
    # paths (the others idle meanwhile), the mesh's rollout server, reward server and this process as its trainer.
    cpu: dict[str, list[dict[str, float]]] = {"offline": [], "async": [], "mesh": []}

    async def measure(name: str, run: Callable[[], Awaitable[int]], r: int) -> None:
        roles = {"this process": os.getpid(), **(mesh_pids if name == "mesh" else {})}
        before = cpu_snapshot(list(roles.values()))
        t = time.perf_counter()
        tokens = await run()
        results[name].append(tokens / (time.perf_counter() - t))
        usage = cpu_usage(before, cpu_snapshot(list(roles.values())))
        if usage is not None:
            cpu[name].append({role: usage.process_s.get(pid, 0.0) / samples * 1e6 for role, pid in roles.items()})
        progress(f"vllm round {r + 1}: {name} {results[name][-1]:,.0f} tokens/s")

    interleaved = not torch.cuda.is_available()
    if interleaved:
        async with contextlib.AsyncExitStack() as stack:
            runs = {name: await stack.enter_async_context(make()) for name, make in paths.items()}
            for run in runs.values():
                await run()  # warm up: one whole pass on every path
            for r in range(args.rounds):
                for name, run in runs.items():
                    await measure(name, run, r)
    else:
        for name, make in paths.items():
            async with make() as run:
                await run()
                for r in range(args.rounds):
                    await measure(name, run, r)
    mid = {k: med(v) for k, v in results.items()}
    return {
        "model": args.vllm_shape or ("the tiny policy" if not args.vllm_model else str(args.vllm_model)),
        "engine_args": {k: v for k, v in kwargs.items() if k != "model"},
        "interleaved": interleaved,
        "tokens_per_s": mid,
        "rounds": results,
        "mesh_vs_offline": mid["mesh"] / mid["offline"],
        "mesh_vs_async": mid["mesh"] / mid["async"],
        "cpu_us_per_sample": {
            path: {role: med([r[role] for r in rounds]) for role in rounds[0]} for path, rounds in cpu.items() if rounds
        },
    }


def vllm_policy(args: argparse.Namespace) -> Path:
    """--vllm-model, a model of --vllm-shape built (once) under --models, or the tiny policy."""
    from rewardmesh.demo.tiny_models import build_shaped_models, build_tiny_models

    if args.vllm_model:
        return Path(args.vllm_model)
    if args.vllm_shape:
        progress(f"vllm: the {args.vllm_shape} shape, built once under {args.models / 'shapes'} (bf16, random)")
        return build_shaped_models(args.models / "shapes", [args.vllm_shape])[args.vllm_shape]
    return build_tiny_models(args.models).policy


def rollout_argv(backend: str, model: str, reward_target: str) -> list[str]:
    return [sys.executable, "-m", "rewardmesh.server.cli", "serve", "rollout", "--host", "127.0.0.1", "--port", "0",
            "--backend", backend, "--model", model, "--reward-target", reward_target, "--grace-s", "2"]  # fmt: skip


def _free_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def render_vllm(res: dict[str, Any], args: argparse.Namespace) -> str:
    tps, eargs, rounds = res["tokens_per_s"], res["engine_args"], res["rounds"]
    cpu = res.get("cpu_us_per_sample", {})

    def cpu_of(path: str) -> str:
        roles = cpu.get(path, {})
        if not roles:
            return ""
        if path != "mesh":
            return f"{roles['this process']:,.0f} µs"
        return (f"{sum(roles.values()):,.0f} µs (rollout {roles['rollout']:,.0f} / reward {roles['reward']:,.0f} / "
                f"trainer {roles['this process']:,.0f})")  # fmt: skip

    rows = [
        ["vLLM offline `LLM.generate`", f"{tps['offline']:,.0f}", "1.00", "", cpu_of("offline")],
        [f"vLLM `AsyncLLM`, {args.vllm_prompts} requests of n={args.vllm_n} in flight, final outputs only",
         f"{tps['async']:,.0f}", f"{tps['async'] / tps['offline']:.2f}", "1.00", cpu_of("async")],
        ["mesh: TrainerClient -> `serve rollout --backend vllm` -> `serve reward` (`noop`)", f"{tps['mesh']:,.0f}",
         f"**{res['mesh_vs_offline']:.2f}**", f"**{res['mesh_vs_async']:.2f}**", cpu_of("mesh")],
    ]  # fmt: skip
    return "\n".join([
        f"### vLLM on {machine_info()['device']}, {res['model']} ({args.vllm_prompts} prompts x n={args.vllm_n}, "
        f"{args.prompt_tokens}-token prompts, every sample "
        f"{args.vllm_max_tokens} tokens, max_num_seqs {eargs.get('max_num_seqs')}, max_num_batched_tokens "
        f"{eargs.get('max_num_batched_tokens')}, {args.rounds} rounds "
        f"{'alternating between the paths' if res['interleaved'] else 'per path'}, medians)",
        "",
        markdown_table(["path", "tokens/s", "vs offline", "vs AsyncLLM", "front-end CPU per sample"], rows),
        "",
        "Per-round tokens/s: " + "; ".join(f"{k} " + ", ".join(f"{x:,.0f}" for x in v) for k, v in rounds.items()),
        "",
        "Front-end CPU: what the path's own processes spent per sample, the engines' core and worker processes not "
        "counted (the same engine work on every path).",
    ])  # fmt: skip


# ------------------------------------------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.rollout_throughput",
        description="Rollouts through the mesh against the bare engine on the same prompts, in one run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--modes", default="instant,hf,vllm", help="comma-separated: instant, hf, vllm")
    p.add_argument(
        "--echo-reward",
        action="store_true",
        help="instant mode: score on the bare grpc.aio echo server instead of `rewardmesh serve reward` "
        "(the reward side's floor: what gRPC alone costs per sample at the mesh's message sizes)",
    )
    p.add_argument("--rounds", type=int, default=3, help="alternating bare/mesh rounds per mode (medians reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-tokens", type=int, default=16, help="tokens per prompt (random ids)")
    p.add_argument("--prompts", type=int, default=128, help="instant mode: prompts per step")
    p.add_argument("--n", type=int, default=8, help="instant mode: samples per prompt")
    p.add_argument("--response-tokens", type=int, default=32, help="instant mode: tokens in every response")
    p.add_argument("--hf-prompts", type=int, default=16, help="hf mode: prompts")
    p.add_argument("--hf-n", type=int, default=4, help="hf mode: samples per prompt")
    p.add_argument("--hf-max-tokens", type=int, default=32, help="hf mode: max new tokens")
    p.add_argument("--threads", type=int, default=1, help="hf mode: torch threads, bare and rollout server alike")
    p.add_argument(
        "--models", type=Path, default=Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        / "rewardmesh" / "models", help="where the tiny models (and --vllm-shape models) are built (reused)",
    )  # fmt: skip
    p.add_argument("--vllm-model", type=Path, help="vllm mode: local model directory (default: the tiny policy)")
    p.add_argument("--vllm-shape", choices=sorted(POLICY_SHAPES),
                   help="vllm mode: a random bf16 policy of a real shape, built under --models/shapes")  # fmt: skip
    p.add_argument("--vllm-max-model-len", type=int, default=0, help="vllm mode: context length (0: the model's)")
    p.add_argument("--vllm-prompts", type=int, default=64)
    p.add_argument("--vllm-n", type=int, default=8)
    p.add_argument("--vllm-max-tokens", type=int, default=64, help="vllm mode: tokens in every sample (ignore_eos)")
    p.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--vllm-max-num-seqs", type=int, default=0, help="vllm mode: 0: what offline LLM picks here")
    p.add_argument("--vllm-max-num-batched-tokens", type=int, default=0, help="vllm mode: 0: what LLM picks here")
    p.add_argument("--vllm-engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="vllm mode: an engine argument for every path (also REWARDMESH_ENGINE_ARG)")  # fmt: skip
    p.add_argument("--json-out", type=Path, help="also write every number to this JSON file")
    return p


async def run(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    report: dict[str, Any] = {"machine": machine_info(), "loadavg_at_start": os.getloadavg()[0]}
    tables: list[str] = []
    with tempfile.TemporaryDirectory(prefix="rewardmesh-rollout-bench-") as tmp:
        work = Path(tmp)
        for mode in modes:
            if mode == "instant":
                report["instant"] = await run_instant(args, work)
                tables.append(render_instant(report["instant"], args))
            elif mode == "hf":
                report["hf"] = await run_hf(args, work)
                tables.append(render_hf(report["hf"], args))
            elif mode == "vllm":
                why = vllm_available()
                if why:
                    progress(f"vllm mode skipped: {why}")
                    tables.append(f"### vLLM: skipped ({why})")
                    continue
                report["vllm"] = await run_vllm(args, work)
                tables.append(render_vllm(report["vllm"], args))
            else:
                raise SystemExit(f"unknown mode {mode!r}: choose from instant, hf, vllm")
    m = report["machine"]
    header = (
        f"Machine: {m['cpu']}, {m['usable_cpus']} usable cores, {m['device']}, torch {m['torch']}, "
        f"Python {m['python']}, grpcio {m['grpcio']}; load average at start {report['loadavg_at_start']:.2f} "
        "(shared with other work: numbers are noisy)."
    )
    return report, [header, "", *tables]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve-instant"]:
        sp = argparse.ArgumentParser(prog="python -m bench.rollout_throughput serve-instant")
        sp.add_argument("--host", default="127.0.0.1")
        sp.add_argument("--port", type=int, default=0)
        sp.add_argument("--reward-target", required=True)
        sp.add_argument("--response-tokens", type=int, default=32)
        sp.add_argument("--port-file", default="", help="write the bound port here once serving")
        a = sp.parse_args(argv[1:])
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        asyncio.run(serve_instant(a.host, a.port, a.reward_target, a.response_tokens, a.port_file))
        return 0
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    report, lines = asyncio.run(run(args))
    print("\n".join(lines), flush=True)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

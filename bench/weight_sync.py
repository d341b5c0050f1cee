"""Weight sync: a ~100M-parameter bf16 Llama sent to 1 and to 2 rollout servers, each a process of its own.

Side by side in one run, interleaved round by round, medians reported:
- memcpy of the same tensors into preallocated buffers (the limit on this machine),
- a bare gloo broadcast of the same bytes as one buffer (trainer -> 1 or 2 receiver processes),
- a bare grpc.aio client stream of the same bytes in 4 MiB messages (no protobuf, a sink server per target),
- `TrainerClient.update_weights` over each transport (grpc, dist, shm), timed until every server reports the
  new version (the rollout servers run the hf backend in bf16: a whole dist or grpc update is adopted, an
  O(1) swap of each parameter's storage; shm is copied in). On one host, dist's two servers serve one copy
  (the first receives it into /dev/shm, the second maps it); "dist, a copy per server" turns that off and
  times the TCP chain itself, what servers on different hosts get.
Each transport and server count has rollout servers of its own (their steady state is what a deployment sees).

    python -m bench.weight_sync [--params 100e6] [--rounds 5] [--device cpu|cuda] [--backend hf|vllm]
    python -m bench.weight_sync --delta [--lrs 1e-6,1e-5] [--rounds 5]

Every update carries xxh3 digests that each server checks; "no digests" rows time the same update without them.
`--delta` times updates that carry only the changed elements after real AdamW steps (see `run_delta`).

`--device cuda` puts the trainer's tensors on the GPU (dist then uses NCCL; the servers must be on GPUs too), and
`--transports ipc,dist,grpc` adds CUDA IPC (trainer and servers share the GPU; with `--backend vllm` through
vLLM's weight-transfer engine; the issue's target: >= 5 GB/s end to end for a >= 300 MB model, `--params 160e6`):
written for the GPU, unverified on the CPU-only development machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import torch
from grpc import aio

from rewardmesh.client.trainer import TrainerClient
from rewardmesh.common.planes.digests import digest
from rewardmesh.common.planes.dist import Store, form_group
from rewardmesh.demo.server_process import ServerProcess

MESSAGE = 4 << 20
_SINK = "/bench.Sink/Push"


def progress(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------- the model


def build_model(out: Path, params: float) -> Path:
    """A random Llama of about `params` parameters with the tiny tokenizer, saved in bf16."""
    from transformers import LlamaForCausalLM

    from rewardmesh.demo.tiny_models import _llama_config, _save, build_tokenizer

    tokenizer = build_tokenizer()
    hidden = 1024 if params <= 400e6 else 2048
    layers = max(1, round(params / (10 * hidden * hidden)))  # attention 4h^2 + MLP 3 * h * 2h per layer
    config = _llama_config(tokenizer, layers=layers, hidden=hidden, heads=hidden // 64, max_position_embeddings=512,
                           initializer_range=0.02)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    _save(model.bfloat16(), tokenizer, out)
    return out


# -------------------------------------------------------------------------------------- helper processes


async def serve_rollout(model: str, port_file: str, threads: int, device: str, backend_name: str) -> None:
    """A rollout server whose hf backend holds the weights in bf16 (the dtype sent: updates can be adopted), or a
    vLLM engine (a small share of the GPU each: the trainer and the other servers share it)."""
    from rewardmesh.server.rollout.backends.base import Backend
    from rewardmesh.server.rollout.backends.hf import HFBackend
    from rewardmesh.server.rollout.server import RolloutServer
    from rewardmesh.server.serving import ServerOptions, write_port_file

    backend: Backend
    if backend_name == "vllm":
        from rewardmesh.server.rollout.backends.vllm_backend import VLLMBackend
        from rewardmesh.server.rollout.backends.vllm_engine import engine_args_from_env

        extra = engine_args_from_env()  # REWARDMESH_ENGINE_ARG, as `rewardmesh serve rollout` reads it
        backend = VLLMBackend(model, gpu_memory_utilization=0.2, enforce_eager=True, dtype="bfloat16",
                              engine_args=extra)  # fmt: skip
    else:
        backend = HFBackend(model, device=device, dtype="bfloat16", num_threads=threads)
    server = RolloutServer(backend, None, ServerOptions(host="127.0.0.1", port=0))
    write_port_file(port_file, await server.start())
    await server.serve_until_signalled()


async def serve_sink(port_file: str) -> None:
    """The thinnest grpc.aio client-stream handler: take every message, answer once (with the malloc settings
    a rollout server's grpc updates get, so the baseline is not slowed by page faults the mesh avoids)."""
    from rewardmesh.common.allocator import keep_freed_memory
    from rewardmesh.server.serving import write_port_file

    keep_freed_memory()

    async def push(requests: object, context: object) -> bytes:
        n = 0
        async for msg in requests:  # type: ignore[attr-defined]
            n += len(msg)
        return n.to_bytes(8, "little")

    server = aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    handler = grpc.method_handlers_generic_handler("bench.Sink", {"Push": grpc.stream_unary_rpc_method_handler(push)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    write_port_file(port_file, port)
    await server.wait_for_termination()


def bare_receiver(host: str, port: int, group: str, rank: int, world: int) -> None:
    """Join the bare group; receive broadcasts (a size header, the bytes, then an all-reduce saying "got it")
    until the size is 0."""
    torch.set_num_threads(1)
    pg = form_group(host=host, port=port, group=group, rank=rank, world_size=world, backend="gloo", timeout_s=300)
    timeout = datetime.timedelta(seconds=300)
    buf = torch.empty(0, dtype=torch.uint8)
    while True:
        size = torch.zeros(1, dtype=torch.int64)
        pg.broadcast([size], _root()).wait(timeout)
        if int(size) == 0:
            return
        if buf.numel() != int(size):
            buf = torch.empty(int(size), dtype=torch.uint8)
        pg.broadcast([buf], _root()).wait(timeout)
        pg.allreduce([torch.zeros(1)]).wait(timeout)


def _root() -> object:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return opts


# --------------------------------------------------------------------------------------------- the run


class BareBroadcast:
    """Trainer side of the bare gloo baseline: one group per receiver count, kept for the whole run."""

    def __init__(self, store: Store, receivers: int) -> None:
        self.group_name = f"bare{receivers}"
        self.world = receivers + 1
        self.store = store
        argv = [sys.executable, "-m", "bench.weight_sync", "bare-receiver", "--host", store.host,
                "--port", str(store.port), "--group", self.group_name, "--world", str(self.world)]  # fmt: skip
        self.procs = [subprocess.Popen([*argv, "--rank", str(r)]) for r in range(1, self.world)]
        self.pg = form_group(host=store.host, port=store.port, group=self.group_name, rank=0, world_size=self.world,
                             backend="gloo", timeout_s=300, store=store.store)  # fmt: skip

    def send(self, flat: torch.Tensor) -> None:
        """Header, bytes, then an all-reduce: done only when every receiver holds every byte."""
        self.pg.broadcast([torch.tensor([flat.numel()], dtype=torch.int64)], _root()).wait()
        self.pg.broadcast([flat], _root()).wait()
        self.pg.allreduce([torch.zeros(1)]).wait()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.pg.broadcast([torch.zeros(1, dtype=torch.int64)], _root()).wait()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


async def bare_stream(channels: list[aio.Channel], pieces: list[bytes]) -> None:
    async def one(ch: aio.Channel) -> None:
        await ch.stream_unary(_SINK, None, None)(iter(pieces))

    await asyncio.gather(*(one(ch) for ch in channels))


def fmt_table(rows: list[tuple[str, float | None, float | None]], nbytes: int) -> str:
    lines = ["| mode | 1 server (s) | GB/s | 2 servers (s) | GB/s |", "|---|---|---|---|---|"]
    for name, one, two in rows:
        cells = []
        for t in (one, two):
            cells += ["", ""] if t is None else [f"{t:.3f}", f"{nbytes / t / 1e9:.2f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    workdir = Path(tempfile.mkdtemp(prefix="rewardmesh-weight-sync-"))
    progress(f"building a ~{args.params / 1e6:.0f}M-parameter Llama in {workdir}")
    model_dir = build_model(workdir / "model", args.params)
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16, local_files_only=True)
    state = {k: v.detach().to(args.device).contiguous() for k, v in lm.state_dict().items()}
    del lm
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    nparams = sum(t.numel() for k, t in state.items() if k != "lm_head.weight")
    progress(f"{nparams / 1e6:.1f}M parameters, {nbytes / 1e6:.0f} MB in bf16, {len(state)} tensors")

    py = [sys.executable, "-m", "bench.weight_sync"]
    # Every transport and server count has servers of its own: a deployment uses one data plane for a stable
    # set of servers, and that steady state is what is timed (a server that switches planes, or is left out of
    # every other update, pays fresh staging buffers).
    serve = [*py, "rollout-server", "--model", str(model_dir), "--threads", str(args.threads), "--device", args.device,
             "--backend", args.backend]  # fmt: skip
    counts = [int(c) for c in args.server_counts.split(",") if c]
    fleets = {(t, n): [ServerProcess(f"rollout-{t}{n}-{i}", serve, workdir)
                       for i in range(n)]
              for t in args.transports for n in counts}  # fmt: skip
    copies = ("dist, a copy per server", 2)  # the TCP chain itself: what servers on different hosts get
    if "dist" in args.transports and 2 in counts:
        fleets[copies] = [ServerProcess(f"rollout-copies-{i}", serve, workdir) for i in range(2)]
    rollouts = [r for fleet in fleets.values() for r in fleet]
    sinks = [ServerProcess(f"sink{i}", [*py, "sink"], workdir) for i in range(2)]
    procs = [*rollouts, *sinks]
    store = Store("127.0.0.1", 300)
    bare: dict[int, BareBroadcast] = {}
    clients: dict[tuple[str, int], TrainerClient] = {}
    memory: dict[tuple[str, int], list[tuple[int, int]]] = {}
    sink_channels: list[aio.Channel] = []
    try:
        await asyncio.gather(*(asyncio.to_thread(p.start, 600) for p in procs))  # sinks serve once they wrote
        await asyncio.gather(*(p.wait_serving() for p in rollouts))
        progress("servers up; forming the bare gloo groups")
        bare = {n: await asyncio.to_thread(BareBroadcast, store, n) for n in counts}
        clients = {key: TrainerClient([r.address for r in fleet]) for key, fleet in fleets.items()}
        for c in clients.values():
            c.weight_sync.delta = False  # the same tensors every round: whole updates (`--delta` times deltas)
        if copies in clients:
            clients[copies].weight_sync.share_host = False
        opts = [("grpc.max_send_message_length", 64 << 20)]
        sink_channels = [aio.insecure_channel(s.address, options=opts) for s in sinks]
        flat = torch.empty(nbytes, dtype=torch.uint8)
        pieces = [
            bytes(memoryview(flat.numpy())[i : i + MESSAGE])  # type: ignore[arg-type]
            for i in range(0, nbytes, MESSAGE)
        ]
        dst = {k: torch.empty_like(v) for k, v in state.items()}
        version = 0

        def memcpy() -> None:
            for k, v in state.items():
                dst[k].copy_(v)

        async def update(fleet: tuple[str, int], transport: str, verify: bool = True) -> None:
            nonlocal version
            version += 1
            client = clients[fleet]
            client.weight_sync.verify = verify
            await client.update_weights(state, version=version, transport=transport)
            done = client.last_weight_sync
            assert done is not None and done.transport == transport

        def digests() -> None:
            for t in state.values():
                digest(t)

        modes: dict[tuple[str, int], Callable[[], Awaitable[object]]] = {
            ("memcpy", 1): lambda: asyncio.to_thread(memcpy)
        }
        for n in counts:
            modes[("bare gloo broadcast", n)] = lambda n=n: asyncio.to_thread(bare[n].send, flat)  # type: ignore[misc]
            modes[("bare grpc.aio stream", n)] = lambda n=n: bare_stream(sink_channels[:n], pieces)  # type: ignore[misc]
        if args.device == "cpu":
            modes[("xxh3 digest of every tensor", 1)] = lambda: asyncio.to_thread(digests)
        for transport in args.transports:
            for n in counts:
                modes[(f"update_weights {transport}", n)] = lambda t=transport, n=n: update((t, n), t)  # type: ignore[misc]
                modes[(f"update_weights {transport}, no digests", n)] = lambda t=transport, n=n: update(  # type: ignore[misc]
                    (t, n), t, verify=False
                )
        if copies in fleets:
            modes[(f"update_weights {copies[0]}", 2)] = lambda: update(copies, "dist")
        progress("warm-up (groups formed, buffers touched)")
        for fn in modes.values():
            await fn()
        times: dict[tuple[str, int], list[float]] = {k: [] for k in modes}
        keys = list(modes)
        for r in range(args.rounds):
            order = keys[r % len(keys) :] + keys[: r % len(keys)]  # rotate: no mode always runs first
            for key in order:
                started = time.perf_counter()
                await modes[key]()
                times[key].append(time.perf_counter() - started)
            progress(f"round {r + 1}/{args.rounds} done")
        memory = {key: [rss(r.pid) for r in fleet] for key, fleet in fleets.items() if key[0].startswith("dist")}
    finally:
        for c in clients.values():
            await c.close()
        for ch in sink_channels:
            await ch.close(None)
        for b in bare.values():
            await asyncio.to_thread(b.close)
        for p in procs:
            p.stop(timeout_s=20)
        store.close()

    med = {k: statistics.median(v) for k, v in times.items()}
    names = list(dict.fromkeys(k[0] for k in med))
    rows = [(name, med.get((name, 1)), med.get((name, 2))) for name in names]
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
    machine += f"Python {platform.python_version()}, grpcio {grpc.__version__}"
    print(f"\nweight sync: {nparams / 1e6:.1f}M parameters, {nbytes / 1e6:.0f} MB bf16, {len(state)} tensors; median "
          f"of {args.rounds} interleaved rounds; torch threads {args.threads}; {machine}\n")  # fmt: skip
    print(fmt_table(rows, nbytes))
    print("\nmemory of each dist server after the rounds (MB; private: RssAnon, mapped /dev/shm files: RssShmem)\n")
    print("| servers | server 1: private, shm | server 2: private, shm |\n|---|---|---|")
    for (name, n), usage in memory.items():
        cells = " | ".join(f"{a / 1e6:.0f}, {sh / 1e6:.0f}" for a, sh in usage)
        print(f"| update_weights {name} ({n}) | {cells} |")
    checks = []
    if "dist" in args.transports and counts == [1, 2]:
        r1 = med[("bare gloo broadcast", 1)] / med[("update_weights dist", 1)]
        r2 = med[("bare gloo broadcast", 2)] / med[("update_weights dist", 2)]
        scale = med[("update_weights dist", 2)] / med[("update_weights dist", 1)]
        bare_scale = med[("bare gloo broadcast", 2)] / med[("bare gloo broadcast", 1)]
        checks += [("bare gloo broadcast, 2 servers / 1 server (time, for reference)", bare_scale, "", True),
                   ("dist vs bare gloo broadcast, 1 server", r1, ">= 0.7", r1 >= 0.7),
                   ("dist vs bare gloo broadcast, 2 servers", r2, ">= 0.7", r2 >= 0.7),
                   ("dist, 2 servers / 1 server (time)", scale, "<= 1.3", scale <= 1.3)]  # fmt: skip
        each = med[("update_weights dist, a copy per server", 2)]
        checks += [("dist, a copy per server, 2 servers: vs bare gloo broadcast (for reference)",
                    med[("bare gloo broadcast", 2)] / each, "", True),
                   ("dist, a copy per server, 2 servers / 1 server (time, for reference)",
                    each / med[("update_weights dist", 1)], "", True)]  # fmt: skip
    if "grpc" in args.transports and counts == [1, 2]:
        g1 = med[("bare grpc.aio stream", 1)] / med[("update_weights grpc", 1)]
        g2 = med[("bare grpc.aio stream", 2)] / med[("update_weights grpc", 2)]
        checks += [("grpc vs bare grpc.aio stream, 1 server", g1, ">= 0.6", g1 >= 0.6),
                   ("grpc vs bare grpc.aio stream, 2 servers", g2, ">= 0.6", g2 >= 0.6)]  # fmt: skip
    for transport in args.transports:
        for n in counts:
            cost = med[(f"update_weights {transport}", n)] / med[(f"update_weights {transport}, no digests", n)]
            checks.append((f"{transport}, {n} server(s): with digests / without (time)", cost, "<= 1.15", cost <= 1.15))
    if "ipc" in args.transports and 1 in counts:
        rate = nbytes / med[("update_weights ipc", 1)] / 1e9
        checks.append(("ipc end to end, 1 server (GB/s, not a ratio)", rate, ">= 5", rate >= 5))
    if "shm" in args.transports and 1 in counts:
        s1 = med[("memcpy", 1)] / med[("update_weights shm", 1)]
        checks.append(("shm vs memcpy, 1 server", s1, "", True))
    print("\n| check | measured | target | result |\n|---|---|---|---|")
    for name, value, target, ok in checks:
        print(f"| {name} | {value:.2f}x | {target} | {'PASS' if ok else 'FAIL' if target else ''} |")
    return 0


async def run_delta(args: argparse.Namespace) -> int:
    """Delta updates after real training steps against whole dist updates, side by side in one run.

    The trainer holds fp32 master weights and takes AdamW steps on random token batches; after each step it casts
    them to bf16 (what it sends) and updates two fleets of two servers each: one with deltas, one whole (dist,
    the two servers of the host sharing one copy). Each server checks every tensor's xxh3 digest against the
    trainer's bf16 weights before it applies an update, so every completed update is bitwise the trainer's."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    workdir = Path(tempfile.mkdtemp(prefix="rewardmesh-weight-delta-"))
    progress(f"building a ~{args.params / 1e6:.0f}M-parameter Llama in {workdir}")
    model_dir = build_model(workdir / "model", args.params)
    py = [sys.executable, "-m", "bench.weight_sync"]
    serve = [*py, "rollout-server", "--model", str(model_dir), "--threads", "1", "--device", "cpu", "--backend", "hf"]
    fleets = {
        kind: [ServerProcess(f"rollout-{kind}-{i}", serve, workdir) for i in range(2)] for kind in ("delta", "whole")
    }
    procs = [p for fleet in fleets.values() for p in fleet]
    clients: dict[str, TrainerClient] = {}
    results: list[tuple[float, str, list[float], list[int], list[float], int]] = []
    try:
        await asyncio.gather(*(asyncio.to_thread(p.start, 600) for p in procs))
        await asyncio.gather(*(p.wait_serving() for p in procs))
        clients = {kind: TrainerClient([r.address for r in fleet]) for kind, fleet in fleets.items()}
        clients["delta"].weight_sync.delta = True
        clients["whole"].weight_sync.delta = False
        version = 0
        for lr in args.lrs:
            model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, local_files_only=True)
            optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
            gen = torch.Generator().manual_seed(0)

            def bf16() -> dict[str, torch.Tensor]:
                return {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}  # noqa: B023

            version += 1
            for c in clients.values():  # the starting point, whole to both fleets
                c.policy_version = version - 1
                await c.update_weights(bf16(), version=version, transport="dist")
            changed: list[float] = []
            sent: list[int] = []
            took: dict[str, list[float]] = {"delta": [], "whole": []}
            for step in range(args.rounds):
                ids = torch.randint(0, model.config.vocab_size, (4, 64), generator=gen)
                model(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                state = bf16()
                version += 1
                order = ["delta", "whole"] if step % 2 == 0 else ["whole", "delta"]
                for kind in order:
                    started = time.perf_counter()
                    await clients[kind].update_weights(state, version=version, transport="dist")
                    took[kind].append(time.perf_counter() - started)
                done = clients["delta"].last_weight_sync
                assert done is not None
                changed.append(done.changed)
                sent.append(done.sent_bytes)
                full = done.num_bytes
                progress(f"lr {lr:g} step {step + 1}: {done.changed:.4%} changed, {done.sent_bytes / 1e6:.1f} MB, "
                         f"delta {took['delta'][-1]:.3f}s, whole {took['whole'][-1]:.3f}s")  # fmt: skip
            results.append((lr, "dist", changed, sent, [*took["delta"], *took["whole"]], full))

    finally:
        for c in clients.values():
            await c.close()
        for p in procs:
            p.stop(timeout_s=20)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
    print(f"\ndelta weight sync: ~{args.params / 1e6:.0f}M parameters in bf16, 2 hf servers per fleet, one AdamW step "
          f"(fp32 master weights, batch 4x64) between updates, median of {args.rounds} steps; {machine}\n")  # fmt: skip
    print("| lr | changed elements | bytes sent: delta | whole | fewer bytes | time: delta (s) | whole dist (s) | "
          "less time |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    checks = []
    for lr, _, changed, sent, times, full in results:
        n = len(changed)
        d, w = statistics.median(times[:n]), statistics.median(times[n:])
        b = statistics.median(sent)
        print(f"| {lr:g} | {statistics.median(changed):.3%} | {b / 1e6:.1f} MB | {full / 1e6:.1f} MB | "
              f"{full / b:.1f}x | {d:.3f} | {w:.3f} | {w / d:.1f}x |")  # fmt: skip
        if lr == 1e-6:
            checks += [("lr 1e-6: fewer bytes than whole", full / b, ">= 5", full / b >= 5),
                       ("lr 1e-6: less time than whole dist", w / d, ">= 3", w / d >= 3)]  # fmt: skip
    print("\n| check | measured | target | result |\n|---|---|---|---|")
    for name, value, target, ok in checks:
        print(f"| {name} | {value:.2f}x | {target} | {'PASS' if ok else 'FAIL'} |")
    return 0


def rss(pid: int) -> tuple[int, int]:
    """A process's private resident memory and its resident pages of shared-memory files, in bytes."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    kb = [int(fields.get(k, "0 kB").split()[0]) for k in ("RssAnon", "RssShmem")]
    return kb[0] * 1024, kb[1] * 1024


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.weight_sync", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = p.add_subparsers(dest="command")
    p.add_argument("--params", type=float, default=100e6, help="model size in parameters (default 100e6)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads in every process (default 1)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (unverified here)")
    p.add_argument("--transports", default="grpc,dist,shm", help="any of ipc,grpc,dist,shm (ipc: --device cuda)")
    p.add_argument("--backend", default="hf", choices=["hf", "vllm"], help="the rollout servers' backend")
    p.add_argument("--server-counts", default="1,2", choices=["1", "2", "1,2"],
                   help="rollout servers per update (default 1,2; the scaling checks need both)")  # fmt: skip
    p.add_argument("--delta", action="store_true", help="time delta updates after AdamW steps against whole dist")
    p.add_argument("--lrs", default="1e-6,1e-5", help="--delta: the learning rates (default 1e-6,1e-5)")
    r = sub.add_parser("rollout-server")
    r.add_argument("--model", required=True)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--device", default="cpu")
    r.add_argument("--backend", default="hf", choices=["hf", "vllm"])
    r.add_argument("--port-file", required=True)
    s = sub.add_parser("sink")
    s.add_argument("--port-file", required=True)
    b = sub.add_parser("bare-receiver")
    b.add_argument("--host", required=True)
    b.add_argument("--port", type=int, required=True)
    b.add_argument("--group", required=True)
    b.add_argument("--rank", type=int, required=True)
    b.add_argument("--world", type=int, required=True)
    args = p.parse_args(argv)
    if args.command == "rollout-server":
        asyncio.run(serve_rollout(args.model, args.port_file, args.threads, args.device, args.backend))
        return 0
    if args.command == "sink":
        asyncio.run(serve_sink(args.port_file))
        return 0
    if args.command == "bare-receiver":
        bare_receiver(args.host, args.port, args.group, args.rank, args.world)
        return 0
    args.transports = [t for t in args.transports.split(",") if t]
    if args.delta:
        args.lrs = [float(x) for x in args.lrs.split(",") if x]
        return asyncio.run(run_delta(args))
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())

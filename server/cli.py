"""The `rewardmesh` command: serve, build tiny models, run the demo."""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rewardmesh.common.telemetry import setup_telemetry
from rewardmesh.demo.model_shapes import SHAPES
from rewardmesh.server.config import load_yaml, resolve

if TYPE_CHECKING:
    from rewardmesh.server.serving import ServerOptions


def default_models_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rewardmesh" / "tiny-models"


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _add_server_flags(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--config", help="YAML file; its `server:` section sets any option below")
    p.add_argument("--host", help="address to bind (default 0.0.0.0)")
    p.add_argument("--port", type=int, help=f"port to bind, 0 for any free one (default {default_port})")
    p.add_argument("--grace-s", dest="grace_s", type=float, help="drain period on SIGTERM (default 30)")
    p.add_argument("--max-message-mb", dest="max_message_mb", type=int, help="largest gRPC message (default 64)")
    p.add_argument(
        "--max-connection-age-s",
        dest="max_connection_age_s",
        type=float,
        help="close connections after this age so clients re-resolve DNS (default 0: never)",
    )
    p.add_argument("--tls-cert", dest="tls_cert", help="PEM certificate: serve TLS (with --tls-key)")
    p.add_argument("--tls-key", dest="tls_key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", dest="tls_ca", help="PEM CA: require client certificates it signed (mutual TLS)")
    p.add_argument("--auth-token-file", dest="auth_token_file",
                   help="require 'authorization: Bearer <token>' (this file's content) on every call but health; "
                        "or set REWARDMESH_AUTH_TOKEN")  # fmt: skip
    p.add_argument("--health-port", dest="health_port", type=int,
                   help="plaintext grpc.health.v1-only port for Kubernetes probes (default 0: none)")  # fmt: skip
    p.add_argument("--prometheus-port", dest="prometheus_port", type=int,
                   help="serve OpenTelemetry metrics for Prometheus on this port (default: off)")  # fmt: skip
    p.add_argument("--port-file", dest="port_file",
                   help="write the bound port to this file once serving (with --port 0)")  # fmt: skip
    p.add_argument("--log-level", default=os.environ.get("REWARDMESH_LOG_LEVEL", "INFO"))


def _missing_demo_extra() -> list[str]:
    """The demos' progress bars and score plot come from the `demo` extra, not the core install."""
    import importlib.util

    return [name for name in ("tqdm", "matplotlib") if importlib.util.find_spec(name) is None]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rewardmesh",
        description="gRPC service mesh for RL post-training: streaming rewards that hide behind generation. "
        "Every option can also come from a REWARDMESH_<OPTION> environment variable or a YAML config file.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run a server")
    serve_sub = serve.add_subparsers(dest="service", required=True)
    _add_serve_reward(serve_sub)
    _add_serve_rollout(serve_sub)
    _add_tiny_models(sub)
    _add_demo(sub)
    _add_reward_demo(sub)
    _add_health(sub)
    return parser


def _add_serve_reward(serve_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`serve reward` and its options."""
    reward = serve_sub.add_parser(
        "reward",
        help="run a reward server",
        description="Serve RewardService. With no config it offers every built-in rule as a pipeline; "
        "the YAML's `pipelines:` mapping adds reward-model, function and judge pipelines.",
    )
    _add_server_flags(reward, 50051)
    reward.add_argument("--tokenizer", help="policy tokenizer directory, to decode samples that carry only ids")
    reward.add_argument("--http-port", dest="http_port", type=int,
                        help="HTTP gateway port for OpenRLHF and slime (default 0: off)")  # fmt: skip
    reward.add_argument("--http-pipeline", dest="http_pipeline", help="pipeline of /get_reward requests naming none")
    reward.add_argument("--http-token-file", dest="http_token_file",
                        help="HTTP bearer token file (else REWARDMESH_HTTP_TOKEN; neither: no auth)")  # fmt: skip
    reward.add_argument("--max-stream-unanswered", dest="max_stream_unanswered", type=int,
                        help="samples read but not yet answered per Score stream before the server stops reading "
                        "it (flow control then pushes back on the client; default 2048)")  # fmt: skip
    reward.add_argument(
        "--no-builtin-rules",
        dest="builtin_rules",
        action="store_const",
        const=False,
        help="do not offer the built-in rules as pipelines",
    )


def _add_serve_rollout(serve_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`serve rollout` and its options (some for one backend only, as their help says)."""
    rollout = serve_sub.add_parser(
        "rollout",
        help="run a rollout server",
        description="Serve RolloutService: generate with an agent loop and stream every finished sample "
        "into the reward servers at once.",
    )
    _add_server_flags(rollout, 50061)
    rollout.add_argument("--backend", choices=["hf", "vllm"], help="generation engine (default hf)")
    rollout.add_argument("--model", help="local model directory (e.g. from `rewardmesh tiny-models`)")
    rollout.add_argument("--reward-target", dest="reward_target",
                         help="reward servers HOST:PORT[,HOST:PORT...] or dns:///name:port")  # fmt: skip
    rollout.add_argument("--default-max-tokens", dest="default_max_tokens", type=int,
                         help="max_tokens when a request sets none (default 256)")  # fmt: skip
    rollout.add_argument("--dtype", help="weights dtype: auto, bfloat16, float16, float32 (default auto)")
    rollout.add_argument("--max-model-len", dest="max_model_len", type=int,
                         help="context length (default 0: the model's)")  # fmt: skip
    rollout.add_argument("--device", help="hf backend: auto, cpu or cuda (default auto)")
    rollout.add_argument("--max-num-seqs", dest="max_num_seqs", type=int,
                         help="most sequences decoded together: the hf backend's rows, vLLM's max_num_seqs "
                              "(default 0: the backend's own)")  # fmt: skip
    rollout.add_argument("--max-batch-size", dest="max_batch_size", type=int,
                         help="deprecated name of --max-num-seqs")  # fmt: skip
    rollout.add_argument("--max-batch-tokens", dest="max_batch_tokens", type=int,
                         help="hf backend: KV budget, prompt + max_tokens over rows (default 0: none)")  # fmt: skip
    rollout.add_argument("--batch-wait-ms", dest="batch_wait_ms", type=float,
                         help="hf backend: an idle backend waits this long for company (default 5)")  # fmt: skip
    rollout.add_argument("--num-threads", dest="num_threads", type=int,
                         help="hf backend: decode threads (default -1: half the cores, 1-8; 0: torch)")  # fmt: skip
    rollout.add_argument("--gpu-memory-utilization", dest="gpu_memory_utilization", type=float,
                         help="vllm backend: fraction of GPU memory for the engine (default 0.85)")  # fmt: skip
    rollout.add_argument("--tensor-parallel-size", dest="tensor_parallel_size", type=int,
                         help="vllm backend: GPUs per engine (default 1)")  # fmt: skip
    rollout.add_argument("--enforce-eager", dest="enforce_eager", action="store_const", const=True,
                         help="vllm backend: no CUDA graphs (faster start, slower decode)")  # fmt: skip
    rollout.add_argument("--attention-backend", dest="attention_backend",
                         help="vllm backend: attention kernels, e.g. TRITON_ATTN (default: vLLM picks)")  # fmt: skip
    rollout.add_argument("--engine-arg", dest="engine_arg", action="append", metavar="KEY=VALUE",
                         help="vllm backend: any other vllm.AsyncEngineArgs field (repeatable)")  # fmt: skip


def _add_tiny_models(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`tiny-models` and its options."""
    tiny = sub.add_parser(
        "tiny-models",
        help="build tiny policy and reward models locally (no download)",
        description="Builds the tiny policy and reward models, or with --shape random bf16 models of real "
        "architectures and sizes (from configs shipped in rewardmesh/demo/model_shapes), each into OUT/SHAPE.",
    )
    tiny.add_argument("--out", type=Path, default=default_models_dir(), help="output directory (default %(default)s)")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--shape", action="append", default=[], choices=sorted(SHAPES), metavar="SHAPE",
                      help=f"a model of a real shape instead of the tiny set (repeatable): "
                           f"{', '.join(sorted(SHAPES))}")  # fmt: skip


def _add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`demo` and its options: the mesh's servers, the GRPO trainer's settings and what the run writes."""
    demo = sub.add_parser(
        "demo",
        help="train the tiny policy with GRPO on the mesh (in-process servers on 127.0.0.1, or real ones)",
        description="Starts a reward server and rollout servers in-process (or uses --rollout-target) and trains "
        'the tiny policy to continue a count ("4 5 6" -> "7") with one token, syncing weights after every step.',
    )
    demo.add_argument("--steps", type=int, default=150, help="training steps (default %(default)s)")
    demo.add_argument("--task", choices=("count", "addition"), default="count",
                      help="what the policy learns (default %(default)s; see docs/benchmarks.md)")  # fmt: skip
    demo.add_argument("--prompts-per-step", dest="prompts_per_step", type=int, default=32)
    demo.add_argument("--n", type=int, default=16, help="samples per prompt, a GRPO group (default %(default)s)")
    demo.add_argument("--lr", type=float, default=5e-3, help="learning rate (default %(default)s)")
    demo.add_argument("--min-lr-ratio", dest="min_lr_ratio", type=float, default=0.2,
                      help="cosine decay of the learning rate to lr x this over the steps; 1: constant "
                      "(default %(default)s)")  # fmt: skip
    demo.add_argument("--off-policy-steps", dest="off_policy_steps", type=int, default=1,
                      help="step k+1 rolls out while step k trains (default %(default)s; 0: synchronous)")  # fmt: skip
    demo.add_argument("--rollout-servers", dest="rollout_servers", type=int, default=0,
                      help="in-process rollout servers (default: 2 hf, 1 vllm)")  # fmt: skip
    demo.add_argument("--backend", choices=["hf", "vllm"], default="hf",
                      help="engine of the in-process rollout servers (default %(default)s)")  # fmt: skip
    demo.add_argument("--rollout-target", dest="rollout_target",
                      help="use these rollout servers instead (HOST:PORT,... or dns:///name:port)")  # fmt: skip
    demo.add_argument("--reward", default="first_number", help="reward pipeline name (default %(default)s)")
    demo.add_argument("--model", type=Path, help="policy directory (default: the tiny policy)")
    demo.add_argument("--models", type=Path, default=default_models_dir(),
                      help="tiny models directory, built if missing (default %(default)s)")  # fmt: skip
    demo.add_argument("--max-num-seqs", "--max-batch-size", dest="max_num_seqs", type=int, default=64,
                      help="hf rollout servers: most sequences decoded together (default %(default)s; "
                           "--max-batch-size: its deprecated name)")  # fmt: skip
    demo.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default %(default)s)")
    demo.add_argument("--clip-ratio-low", dest="clip_ratio_low", type=float, default=0.2,
                      help="PPO clip below 1 (default %(default)s)")  # fmt: skip
    demo.add_argument("--clip-ratio-high", dest="clip_ratio_high", type=float, default=0.28,
                      help="PPO clip above 1 (default %(default)s; DAPO's clip-higher)")  # fmt: skip
    demo.add_argument("--tis-cap", dest="tis_cap", type=float, default=0.0,
                      help="truncated IS cap, instead of PPO-clip against the rollout (0: off)")  # fmt: skip
    demo.add_argument("--beta2", type=float, default=0.999, help="Adam's second-moment decay (default %(default)s)")
    demo.add_argument("--ppo-epochs", dest="ppo_epochs", type=int, default=1,
                      help="passes over each batch (default %(default)s)")  # fmt: skip
    demo.add_argument("--ppo-mini-batches", dest="ppo_mini_batches", type=int, default=1,
                      help="optimizer steps per pass (default %(default)s)")  # fmt: skip
    demo.add_argument("--entropy-coeff", dest="entropy_coeff", type=float, default=0.02,
                      help="entropy bonus; keeps a group exploring after it settles (default %(default)s)")  # fmt: skip
    demo.add_argument("--norm-adv-by-std", dest="norm_adv_by_std", action=argparse.BooleanOptionalAction,
                      default=False, help="divide GRPO advantages by the group's std (verl's norm_adv_by_std_in_grpo; "
                      "default off: Dr. GRPO)")  # fmt: skip
    demo.add_argument(
        "--plot", type=Path, default=Path("demo_scores.png"), help="score curve PNG (default %(default)s)"
    )
    demo.add_argument("--metrics-out", dest="metrics_out", type=Path, help="write per-step metrics as JSON")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--trace-out", dest="trace_out", type=Path,
                      help="write spans as OTLP JSON lines; print the slowest sample's span tree")  # fmt: skip


def _add_reward_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`reward-demo` and its options."""
    rdemo = sub.add_parser("reward-demo", help="score GSM8K-style samples through a real reward server and client")
    rdemo.add_argument("--samples", type=int, default=400, help="samples to score (default %(default)s)")
    rdemo.add_argument("--models", type=Path, default=default_models_dir())
    rdemo.add_argument("--seed", type=int, default=0)


def _add_health(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`health` and its options."""
    health = sub.add_parser(
        "health",
        help="ask a server's grpc.health.v1 service; exit 0 if SERVING (for exec probes)",
        description="One grpc.health.v1 Check, plaintext: exit 0 when the service is SERVING, 1 otherwise (with "
        "the status or error on stderr). For Kubernetes exec probes where gRPC probes are missing (before 1.27), "
        "and for scripts.",
    )
    health.add_argument("--host", default="127.0.0.1", help="server address (default %(default)s)")
    health.add_argument("--port", type=int, required=True, help="the server's port, or its --health-port")
    health.add_argument("--service", default="",
                        help="e.g. rewardmesh.v1.RewardService (default: the whole server)")  # fmt: skip
    health.add_argument("--timeout-s", dest="timeout_s", type=float, default=3.0, help="default %(default)s")


def _health(args: argparse.Namespace) -> int:
    """Exit status of one health check: 0 SERVING, 1 anything else (NOT_SERVING, unknown service, unreachable)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = f"{args.host}:{args.port}" if ":" not in args.host else f"[{args.host}]:{args.port}"
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout_s
            )
        except grpc.RpcError as exc:
            print(f"rewardmesh health: {target} {args.service!r}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"rewardmesh health: {target} {args.service!r}: {status}", file=sys.stderr)
        return 1
    return 0


def _serve(args: argparse.Namespace) -> int:
    """Both `serve` commands: options from flags, environment and file; telemetry; run until SIGTERM/SIGINT."""
    _setup_logging(args.log_level)
    file_cfg = load_yaml(args.config or os.environ.get("REWARDMESH_CONFIG"))
    section = file_cfg.get("server") or {}
    run: Callable[[], Coroutine[Any, Any, None]]
    if args.service == "reward":
        from rewardmesh.server.reward.server import RewardServerConfig, serve_reward

        reward_cfg = resolve(RewardServerConfig, args, section)
        cfg: ServerOptions = reward_cfg
        run = functools.partial(serve_reward, reward_cfg, file_cfg.get("pipelines"), file_cfg.get("tenants"))
    else:
        from rewardmesh.server.rollout.server import RolloutServerConfig, serve_rollout

        rollout_cfg = resolve(RolloutServerConfig, args, section)
        cfg = rollout_cfg
        run = functools.partial(serve_rollout, rollout_cfg)
    setup_telemetry(args.service, prometheus_port=cfg.prometheus_port)
    try:
        asyncio.run(run())
    except ValueError as exc:  # a config mistake: say what to fix, not a traceback
        print(f"rewardmesh: configuration error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "health":
        return _health(args)
    if args.command == "tiny-models":
        from rewardmesh.demo.tiny_models import build_shaped_models, build_tiny_models

        _setup_logging("INFO")
        if args.shape:
            for name, path in build_shaped_models(args.out, args.shape, seed=args.seed).items():
                print(f"{name}: {path}")
            return 0
        paths = build_tiny_models(args.out, seed=args.seed)
        for name, path in vars(paths).items():
            print(f"{name}: {path}")
        return 0
    if args.command in ("demo", "reward-demo") and (missing := _missing_demo_extra()):
        print(f"rewardmesh {args.command}: needs the demo extra (missing {', '.join(missing)}): "
              "pip install 'rewardmesh[demo]' (`make demo` installs it)", file=sys.stderr)  # fmt: skip
        return 2
    if args.command == "demo":
        from rewardmesh.demo.rl_demo import run_demo

        _setup_logging("WARNING")
        if args.trace_out:
            from opentelemetry.sdk.trace.export import SimpleSpanProcessor
            from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

            from rewardmesh.common.otlp_json import OtlpJsonLinesExporter

            args.trace_memory = InMemorySpanExporter()
            telemetry = setup_telemetry("demo", span_exporters=[OtlpJsonLinesExporter(args.trace_out)],
                                        span_processors=[SimpleSpanProcessor(args.trace_memory)])  # fmt: skip
        else:
            telemetry = setup_telemetry("demo")
        try:
            return asyncio.run(run_demo(args))
        finally:
            telemetry.shutdown()
    if args.command == "reward-demo":
        from rewardmesh.demo.reward_demo import run_reward_demo

        _setup_logging("WARNING")
        return asyncio.run(run_reward_demo(args))
    return 2


if __name__ == "__main__":
    sys.exit(main())

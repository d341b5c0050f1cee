"""The rollout server process: a generation backend behind RolloutService, streaming samples to reward servers."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from grpc_health.v1 import health_pb2

from rewardmesh.client.reward_client import RewardClient
from rewardmesh.common.gc_tuning import freeze_startup_heap
from rewardmesh.common.planes.grpc_chunks import parse_update_request
from rewardmesh.server.registration import with_deserializers
from rewardmesh.server.rollout.backends.base import Backend
from rewardmesh.server.rollout.service import RolloutServicer
from rewardmesh.server.rollout.worker import RolloutWorker
from rewardmesh.server.serving import GrpcServer, MeshServer, ServerOptions
from rewardmesh.v1 import rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name
# UpdateWeights chunks parsed without copying their bytes (common/planes/grpc_chunks.py).
add_rollout_service = with_deserializers(
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server, UpdateWeights=parse_update_request
)


@dataclass
class RolloutServerConfig(ServerOptions):
    """Everything `rewardmesh serve rollout` reads from flags, REWARDMESH_* variables or the YAML `server:` section."""

    port: int = 50061
    backend: str = "hf"
    model: str = ""
    # Reward servers, comma-separated HOST:PORT (or one dns:///name:port balanced over every pod).
    reward_target: str = ""
    default_max_tokens: int = 256
    # Engine options. Both backends:
    dtype: str = "auto"  # auto: bf16 on a GPU that has it (else fp16), fp32 on CPU
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    # Most sequences decoded together (the hf backend's rows, vLLM's max_num_seqs); 0: the backend's own default.
    max_num_seqs: int = 0
    max_batch_size: int = 0  # deprecated (it also names a reward batch): read as max_num_seqs, with a warning
    # hf backend:
    device: str = "auto"
    max_batch_tokens: int = 0  # KV budget of the running batch, prompt + max_tokens per row; 0: rows only
    batch_wait_ms: float = 5.0  # an idle backend waits this long for company before its first prefill
    num_threads: int = -1  # torch threads of the decode thread; -1: half the usable cores (1-8), 0: torch's
    # vllm backend:
    gpu_memory_utilization: float = 0.85
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    attention_backend: str = ""  # "": vLLM's choice
    # Any other vllm.AsyncEngineArgs field, as KEY=VALUE (values read as YAML: 8, true, {"a": 1});
    # in YAML also a mapping; in the environment comma-separated.
    engine_arg: list[str] = field(default_factory=list)


def max_num_seqs(cfg: RolloutServerConfig) -> dict[str, int]:
    """``{"max_num_seqs": N}`` when the config sets it (or its deprecated name, max_batch_size), else nothing: the
    backend keeps its own default."""
    for name in ("max_num_seqs", "max_batch_size"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"{name} must be >= 1 (0: the backend's default), got {getattr(cfg, name)}")
    if cfg.max_batch_size:
        if cfg.max_num_seqs and cfg.max_num_seqs != cfg.max_batch_size:
            raise ValueError(
                f"max_batch_size {cfg.max_batch_size} and max_num_seqs {cfg.max_num_seqs} both set: max_batch_size "
                "is the deprecated name of max_num_seqs; set max_num_seqs only"
            )
        log.warning(
            "max_batch_size is deprecated for the rollout server (it also names a reward batch's size): read as "
            "max_num_seqs=%d, at most that many sequences decoded together by the %s backend; set max_num_seqs",
            cfg.max_batch_size,
            cfg.backend,
        )
        return {"max_num_seqs": cfg.max_batch_size}
    return {"max_num_seqs": cfg.max_num_seqs} if cfg.max_num_seqs else {}


def backend_options(cfg: RolloutServerConfig) -> dict[str, Any]:
    """The constructor options of ``cfg.backend`` from the server config."""
    max_model_len = cfg.max_model_len or None
    if cfg.backend == "hf":
        if cfg.engine_arg:
            raise ValueError("engine_arg: engine arguments are for --backend vllm; the hf backend takes none")
        return {
            "device": cfg.device,
            "dtype": cfg.dtype,
            "max_model_len": max_model_len,
            **max_num_seqs(cfg),
            "max_batch_tokens": cfg.max_batch_tokens or None,
            "batch_wait_ms": cfg.batch_wait_ms,
            "num_threads": None if cfg.num_threads < 0 else cfg.num_threads,
        }
    if cfg.backend == "vllm":
        from rewardmesh.server.rollout.backends.vllm_engine import parse_engine_args

        engine_args = parse_engine_args(cfg.engine_arg)
        seqs = max_num_seqs(cfg)
        if seqs and engine_args.get("max_num_seqs", seqs["max_num_seqs"]) != seqs["max_num_seqs"]:
            raise ValueError(
                f"max_num_seqs {seqs['max_num_seqs']} and engine_arg max_num_seqs={engine_args['max_num_seqs']} "
                "disagree: set it once"
            )
        return {
            "dtype": cfg.dtype,
            "max_model_len": max_model_len,
            "gpu_memory_utilization": cfg.gpu_memory_utilization,
            "tensor_parallel_size": cfg.tensor_parallel_size,
            "enforce_eager": cfg.enforce_eager,
            "attention_backend": cfg.attention_backend or None,
            **seqs,
            "engine_args": engine_args,
        }
    return {}


class RolloutServer(MeshServer):
    """Owns the backend, the reward client and the gRPC server."""

    def __init__(
        self, backend: Backend, reward_targets: list[str] | None = None, options: ServerOptions | None = None,
        *, default_max_tokens: int = 256,
    ) -> None:  # fmt: skip
        self.backend = backend
        self.options = options or ServerOptions(host="127.0.0.1", port=0)
        self.rewards = RewardClient(reward_targets) if reward_targets else None
        self.worker = RolloutWorker(backend, self.rewards)
        self.servicer = RolloutServicer(self.worker, default_max_tokens=default_max_tokens, limits=self.options)
        self.grpc = GrpcServer(self.options, [(add_rollout_service, self.servicer,
                                              SERVICE_NAME)], on_stopped=self._release)  # fmt: skip

    async def start(self, *, wait_ready: bool = True) -> int:
        """Serve at once, with RolloutService NOT_SERVING while the backend boots (off the event loop), then
        SERVING. ``wait_ready=False`` returns before the boot ends; :meth:`ready` awaits it."""
        self.servicer.booting = (f"the rollout server is still booting its {self.backend.name} backend; retry when it "
                                 "reports SERVING")  # fmt: skip
        port = await self.grpc.start(ready=False)
        # dns:/// targets resolve on first use: name them as configured until then.
        targets = ([s.address for s in self.rewards.streams] or self.rewards.pool.specs) if self.rewards else []
        log.info("rollout server listening on %s:%d (backend %s, model %s, reward targets %s); booting the engine",
                 self.options.host, port, self.backend.name, self.backend.model, targets)  # fmt: skip
        self._boot = asyncio.create_task(self._boot_backend(), name="rollout-backend-boot")
        if wait_ready:
            try:
                await self.ready()
            except BaseException:
                await self.grpc.stop(0)
                raise
        return port

    async def ready(self) -> None:
        """Wait until the backend has booted (raises what the boot raised)."""
        await asyncio.shield(self._boot)

    async def _boot_backend(self) -> None:
        started = time.perf_counter()
        self.backend.on_failure = self._engine_failed  # an engine that dies for good: health says so at once
        await self.backend.start()
        self.servicer.booting = ""
        await self.grpc.set_ready()
        log.info("rollout server ready: %s booted in %.1f s", self.backend.name, time.perf_counter() - started)

    def _engine_failed(self, exc: BaseException | None) -> None:
        log.error("rollout server: the %s backend can generate no more (%s): reporting NOT_SERVING", self.backend.name,
                  exc)  # fmt: skip
        self.servicer.booting = f"the {self.backend.name} backend failed and can generate no more: {exc}"
        for name in ("", SERVICE_NAME):
            asyncio.get_running_loop().create_task(
                self.grpc.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
            )

    async def _release(self) -> None:
        if self.rewards is not None:
            await self.rewards.close()
        await self.backend.close()


async def serve_rollout(cfg: RolloutServerConfig) -> None:
    """Entry point of `rewardmesh serve rollout`: runs until SIGTERM/SIGINT, then drains."""
    from rewardmesh.server.rollout.backends import make_backend

    if not cfg.model:
        raise ValueError("--model is required: a local model directory (try `rewardmesh tiny-models`)")
    backend = make_backend(cfg.backend, cfg.model, **backend_options(cfg))
    backend.check_engine_args()  # an unknown engine argument fails here, naming it, before minutes of booting
    targets = [t for t in cfg.reward_target.split(",") if t]
    server = RolloutServer(backend, targets, cfg, default_max_tokens=cfg.default_max_tokens)
    await server.start(wait_ready=False)
    serving = asyncio.create_task(server.serve_until_signalled())
    try:
        await server.ready()
    except Exception:
        log.exception("rollout server: the %s backend failed to boot", cfg.backend)
        await server.stop(0)
        await serving
        raise
    freeze_startup_heap()  # the engine is up: what the server holds from here on is never scanned
    await serving
    log.info("rollout server stopped")

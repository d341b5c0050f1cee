"""The rollout server process: a generation backend behind RolloutService, streaming samples to reward servers."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from client.reward_client import RewardClient
from rewardmesh.v1 import rollout_pb2, rollout_pb2_grpc
from server.backends.base import Backend
from server.rollout_service import RolloutServicer
from server.rollout_worker import RolloutWorker
from server.serving import GrpcServer, MeshServer, ServerOptions

log = logging.getLogger(__name__)

SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name


@dataclass
class RolloutServerConfig(ServerOptions):
    """Everything `rewardmesh serve rollout` reads from flags, REWARDMESH_* variables or the YAML `server:` section."""

    port: int = 50061
    backend: str = "hf"
    model: str = ""
    # Reward servers, comma-separated HOST:PORT (or one dns:///name:port balanced over every pod).
    reward_target: str = ""
    default_max_tokens: int = 256
    device: str = "auto"
    max_batch_size: int = 32


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
        self.servicer = RolloutServicer(self.worker, default_max_tokens=default_max_tokens)
        self.grpc = GrpcServer(self.options, [(rollout_pb2_grpc.add_RolloutServiceServicer_to_server, self.servicer,
                                              SERVICE_NAME)], on_stopped=self._release)  # fmt: skip

    async def start(self) -> int:
        await self.backend.start()
        port = await self.grpc.start()
        targets = [s.address for s in self.rewards.streams] if self.rewards else []
        log.info("rollout server listening on %s:%d (backend %s, model %s, reward targets %s)",
                 self.options.host, port, self.backend.name, self.backend.model, targets)  # fmt: skip
        return port

    async def _release(self) -> None:
        if self.rewards is not None:
            await self.rewards.close()
        await self.backend.close()


async def serve_rollout(cfg: RolloutServerConfig) -> None:
    """Entry point of `rewardmesh serve rollout`: runs until SIGTERM/SIGINT, then drains."""
    from server.backends import make_backend

    if not cfg.model:
        raise ValueError("--model is required: a local model directory (try `rewardmesh tiny-models`)")
    options = {"device": cfg.device, "max_batch_size": cfg.max_batch_size} if cfg.backend == "hf" else {}
    backend = make_backend(cfg.backend, cfg.model, **options)
    targets = [t for t in cfg.reward_target.split(",") if t]
    server = RolloutServer(backend, targets, cfg, default_max_tokens=cfg.default_max_tokens)
    await server.start()
    await server.serve_until_signalled()
    log.info("rollout server stopped")

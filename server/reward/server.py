"""The reward server process: an engine of pipelines behind RewardService, with health, reflection and drain."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from rewardmesh.common.gc_tuning import freeze_startup_heap
from rewardmesh.reward_engine.engine import RewardEngine
from rewardmesh.server.registration import with_deserializers
from rewardmesh.server.reward.sample_split import parse_score_batch_request, parse_score_request
from rewardmesh.server.reward.service import RewardServicer
from rewardmesh.server.reward.tenants import TenantTable
from rewardmesh.server.serving import GrpcServer, MeshServer, ServerOptions
from rewardmesh.v1 import reward_pb2, reward_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = reward_pb2.DESCRIPTOR.services_by_name["RewardService"].full_name
# Score and ScoreBatch requests parsed sample by sample when one sample would fail the whole message.
add_reward_service = with_deserializers(reward_pb2_grpc.add_RewardServiceServicer_to_server,
                                        Score=parse_score_request, ScoreBatch=parse_score_batch_request)  # fmt: skip


@dataclass
class RewardServerConfig(ServerOptions):
    """Everything `rewardmesh serve reward` reads from flags, REWARDMESH_* variables or the YAML `server:` section."""

    port: int = 50051
    # Offer every built-in rule (gsm8k, math, ...) as a pipeline of its own name.
    builtin_rules: bool = True
    # Policy tokenizer used to decode ids when a sample carries no text (rules and judges read text).
    tokenizer: str = ""
    # HTTP gateway for OpenRLHF (POST /get_reward) and slime (POST /score/{pipeline}); 0: off.
    http_port: int = 0
    # Pipeline of /get_reward when the request names none (?pipeline=NAME).
    http_pipeline: str = ""
    # Bearer token the gateway requires: this file's content, else REWARDMESH_HTTP_TOKEN, else the gRPC auth
    # token (the gateway is never open while gRPC is closed); none of them: no auth.
    http_token_file: str = ""
    # Backpressure: a Score stream with this many samples read but not yet answered is not read further.
    max_stream_unanswered: int = 2048
    # The isolation budget of the built-in rules that run in worker processes (math, auto): running time
    # and memory growth per sample, and worker processes per rule (configured sources set their own).
    rule_timeout_s: float = 10.0
    rule_memory_mb: int = 1024
    rule_workers: int = 2


def build_engine(
    pipelines: dict[str, Any] | None, *, builtin_rules: bool = True, rule_options: dict[str, Any] | None = None
) -> RewardEngine:
    engine = RewardEngine()
    engine.add_from_config(pipelines or {})
    if builtin_rules:
        engine.add_builtin_rules(**(rule_options or {}))
    return engine


def load_tokenizer(path: str) -> Any:
    if not path:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


class RewardServer(MeshServer):
    """Owns the engine and the gRPC server; `stop()` drains in-flight samples first."""

    def __init__(
        self,
        engine: RewardEngine,
        options: ServerOptions | None = None,
        tokenizer: Any = None,
        tenants: TenantTable | None = None,
        *,
        max_stream_unanswered: int = RewardServerConfig.max_stream_unanswered,
    ) -> None:
        self.engine = engine
        self.options = options or ServerOptions(host="127.0.0.1", port=0)
        self.tenants = tenants or TenantTable()
        self.servicer = RewardServicer(engine, tokenizer, max_stream_unanswered=max_stream_unanswered,
                                       limits=self.options, tenants=self.tenants)  # fmt: skip
        self.gateway: Any = None  # rewardmesh.server.reward.http_gateway.HttpGateway when --http-port is set
        self.grpc = GrpcServer(
            self.options,
            [(add_reward_service, self.servicer, SERVICE_NAME)],
            on_drain=self._drain,
            on_stopped=self._release,
            tenant_tokens=self.tenants.tokens,
        )

    async def start(self, *, ready: bool = True) -> int:
        """Warm up and serve; ``ready=False``: NOT_SERVING and no port file until ``grpc.set_ready()``."""
        await self.engine.warmup()
        if len(self.tenants.tenants) > 1:
            self._hint_shared_loop()
        port = await self.grpc.start(ready=ready)
        log.info(
            "reward server listening on %s:%d with pipelines: %s",
            self.options.host,
            port,
            ", ".join(sorted(self.engine.pipelines)),
        )
        return port

    async def say_if_code_rewards_are_off(self) -> None:
        """A code pipeline proven only on first use would fail its first sample with the sandbox's reason and say
        nothing before: prove its isolation now (one probe, no sandbox started) and say at start if code rewards
        are off, and the usual cause in a container (its seccomp profile, not the kernel)."""
        from rewardmesh.reward_engine.sandbox.executor import SandboxUnavailable
        from rewardmesh.reward_engine.sources.code import CodeSource

        for name, pipeline in sorted(self.engine.pipelines.items()):
            for weighted in pipeline.sources:
                source = weighted.source
                if not isinstance(source, CodeSource) or source.prestart:
                    continue
                try:
                    await source.sandbox.start()
                except SandboxUnavailable as exc:
                    log.warning(
                        "code rewards are off: pipeline %r answers UNAVAILABLE: %s. In a container this is usually "
                        "its seccomp profile refusing user namespaces (Kubernetes' RuntimeDefault does), not the "
                        "kernel: on Kubernetes use k8s/components/code-sandbox (docs/deployment.md)",
                        name,
                        exc,
                    )

    def _hint_shared_loop(self) -> None:
        """Tenants share this server, and a pipeline scoring on the event loop shares with them the loop that reads
        every tenant's messages: fair share orders its queue, but a flood's messages still take turns of that loop,
        which worker processes would leave to the pipeline's own samples."""
        names = [name for name, p in sorted(self.engine.pipelines.items()) if p.limits(lent=False).inline]
        if names:
            log.info(
                "pipelines scoring on the event loop, which also reads every tenant's messages: %s. Under another "
                "tenant's flood a small step there waits for the flood's turns of the loop, beyond what fair share "
                "decides; to keep its median latency as it is alone, run it in worker processes (a rule's "
                "`isolation: process`, a function's `executor: process`), at a cost in throughput",
                ", ".join(names),
            )

    async def _drain(self) -> None:
        """Both fronts at once: the gateway stops taking work as gRPC goes NOT_SERVING, and both drain."""
        if self.gateway is None:
            await self.servicer.drain()
        else:
            await asyncio.gather(self.servicer.drain(), self.gateway.drain())

    async def _release(self) -> None:
        if self.gateway is not None:  # HTTP callers of the same engine stop before it closes
            await self.gateway.stop(self.options.grace_s)
        await self.engine.close(drain=False)


async def serve_reward(
    cfg: RewardServerConfig, pipelines: dict[str, Any] | None, tenants: dict[str, Any] | None = None
) -> None:
    """Entry point of `rewardmesh serve reward`: runs until SIGTERM/SIGINT, then drains. `tenants`: the YAML
    file's `tenants:` section (server/reward/tenants.py)."""
    table = TenantTable.from_config(tenants)
    rule_options = {"timeout_s": cfg.rule_timeout_s, "memory_mb": cfg.rule_memory_mb, "workers": cfg.rule_workers}
    engine = build_engine(pipelines, builtin_rules=cfg.builtin_rules, rule_options=rule_options)
    server = RewardServer(engine, cfg, load_tokenizer(cfg.tokenizer), table,
                          max_stream_unanswered=cfg.max_stream_unanswered)  # fmt: skip
    if cfg.http_port:
        from rewardmesh.server.reward.http_gateway import HttpGateway, gateway_token, server_ssl_context

        server.gateway = HttpGateway(
            server.engine,
            host=cfg.host,
            port=cfg.http_port,
            default_pipeline=cfg.http_pipeline,
            token=gateway_token(cfg.http_token_file, cfg.auth_token_file),
            ssl_context=server_ssl_context(cfg.tls_cert, cfg.tls_key, cfg.tls_ca),
            limits=cfg,
        )
    # SIGTERM drains from here on; the port file (what a parent waits for) comes once both fronts listen.
    server.grpc.stop_on_signals()
    await server.start(ready=False)
    if server.gateway is not None:
        await server.gateway.start()
    freeze_startup_heap()  # models loaded, sources warm: what the server holds from here on is never scanned
    await server.grpc.set_ready()
    await server.say_if_code_rewards_are_off()
    await server.serve_until_signalled()
    svc = server.servicer
    log.info(
        "reward server stopped after sending %d results (Score messages: %d in, %d out)",
        svc.results_sent,
        svc.messages_in,
        svc.messages_out,
    )

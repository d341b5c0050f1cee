"""The one in-process mesh: reward and rollout servers on 127.0.0.1, port 0, in this process.

`rewardmesh demo`, the benchmarks and the tests all start their servers here, so a change to how a
server is built or stopped is made once.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rewardmesh.server.reward.server import RewardServer, build_engine
from rewardmesh.server.serving import ServerOptions

if TYPE_CHECKING:
    from rewardmesh.server.rollout.backends.base import Backend
    from rewardmesh.server.rollout.server import RolloutServer

LOCAL = "127.0.0.1"


@contextlib.asynccontextmanager
async def reward_server(
    pipelines: dict[str, Any] | None = None,
    tokenizer: Any = None,
    *,
    grace_s: float = 5.0,
    stop_grace_s: float = 0.5,
) -> AsyncIterator[RewardServer]:
    """A reward server offering `pipelines` plus the built-in rules."""
    server = RewardServer(build_engine(pipelines), ServerOptions(host=LOCAL, port=0, grace_s=grace_s), tokenizer)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace=stop_grace_s)


@contextlib.asynccontextmanager
async def rollout_server(
    backend: Backend,
    reward_targets: list[str] | None = None,
    *,
    grace_s: float = 2.0,
    stop_grace_s: float = 0.5,
) -> AsyncIterator[RolloutServer]:
    """A rollout server over `backend`, streaming its samples to `reward_targets` (none: unscored)."""
    from rewardmesh.server.rollout.server import RolloutServer

    server = RolloutServer(backend, reward_targets, ServerOptions(host=LOCAL, port=0, grace_s=grace_s))
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace=stop_grace_s)


@dataclass
class Mesh:
    reward: RewardServer
    rollouts: list[RolloutServer]

    @property
    def rollout_addresses(self) -> list[str]:
        return [r.address for r in self.rollouts]


@contextlib.asynccontextmanager
async def local_mesh(
    policy: str | Path,
    pipelines: dict[str, Any] | None = None,
    *,
    rollout_servers: int = 1,
    max_num_seqs: int = 64,
    num_threads: int | None = 1,
    batch_wait_ms: float | None = None,
    reward_targets: bool = True,
    tokenizer: Any = None,
    backend_name: str = "hf",
) -> AsyncIterator[Mesh]:
    """One reward server and `rollout_servers` rollout servers (hf, or vllm) on the policy at `policy`.

    hf: one torch thread per decode loop by default: two threads each on a loaded 2-core machine slow every step;
    ``max_num_seqs`` rows decoded together (the vllm engine keeps vLLM's own max_num_seqs).
    vllm: the engine computes in float32, as the learner does, so its log-probs match the learner's; further
    engine arguments come from REWARDMESH_ENGINE_ARG (KEY=VALUE,...), as for `rewardmesh serve rollout`.
    """
    async with contextlib.AsyncExitStack() as stack:
        reward = await stack.enter_async_context(reward_server(pipelines, tokenizer, grace_s=2.0, stop_grace_s=1.0))
        rollouts = []
        for _ in range(rollout_servers):
            backend: Backend
            if backend_name == "vllm":
                from rewardmesh.server.rollout.backends.vllm_backend import VLLMBackend
                from rewardmesh.server.rollout.backends.vllm_engine import engine_args_from_env

                backend = VLLMBackend(
                    str(policy), dtype="float32", enforce_eager=True, engine_args=engine_args_from_env()
                )
            else:
                from rewardmesh.server.rollout.backends.hf import HFBackend

                options: dict[str, Any] = {"batch_wait_ms": batch_wait_ms} if batch_wait_ms is not None else {}
                backend = HFBackend(str(policy), device="cpu", max_num_seqs=max_num_seqs, num_threads=num_threads,
                                    **options)  # fmt: skip
            targets = [reward.address] if reward_targets else None
            rollouts.append(await stack.enter_async_context(rollout_server(backend, targets, stop_grace_s=1.0)))
        yield Mesh(reward, rollouts)

"""The policy the rollout servers serve: its version, the weights that make it, pushed to every reachable server,
and given to a server that joins (or comes back restarted) before it gets any work."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

import grpc
import torch
from grpc import aio

from rewardmesh.client.fanout import RolloutTarget
from rewardmesh.client.targets import TargetPool
from rewardmesh.client.weight_sync import SyncResult, WeightSync, WeightSyncError
from rewardmesh.v1 import rollout_pb2

log = logging.getLogger(__name__)

__all__ = ["PolicyWeights"]


class PolicyWeights:
    """The current policy version and its weights, for every member of the pool (see TrainerClient.update_weights)."""

    def __init__(self, pool: TargetPool[RolloutTarget]) -> None:
        self.pool = pool
        self.policy_version = 0
        self.weight_sync = WeightSync()
        self.last_weight_sync: SyncResult | None = None
        # Servers that join (a new address behind dns:///, or back after failing: maybe restarted with the base
        # weights) get the current weights before any work; a group of their own keeps the others' group intact.
        self._join_sync = WeightSync(delta=False)  # a joiner serves another version: whole weights, no copy kept
        self._weights: Mapping[str, torch.Tensor] | None = None
        self._weights_stamp: tuple[int, ...] = ()  # the version counters of `_weights` when they were sent
        self._weights_lock = asyncio.Lock()
        self.join_updates = 0

    def close(self) -> None:
        self.weight_sync.close()
        self._join_sync.close()

    async def update(
        self, state: Mapping[str, torch.Tensor], *, version: int | None, transport: str, chunk_bytes: int
    ) -> int:
        """Push ``state`` as ``version`` (default: the next one) to every reachable server; the version applied."""
        async with self._weights_lock:
            version = version if version is not None else self.policy_version + 1
            reachable = await self._reachable()
            targets = [(t.address, t.channel) for t, _ in reachable]
            infos = [i for _, i in reachable if i is not None]
            sync = await self.weight_sync.push(targets, state, version, transport, chunk_bytes=chunk_bytes,
                                               infos=infos if len(infos) == len(targets) else None)  # fmt: skip
            self.last_weight_sync = sync
            self.policy_version = version
            self._weights = state
            self._weights_stamp = stamp(state)
        return version

    async def _reachable(self) -> list[tuple[RolloutTarget, rollout_pb2.GetInfoResponse | None]]:
        """The members that answer now, with their GetInfo (the push reuses it). One that cannot be reached (a pod
        restarting) is marked down instead of failing the update: the pool's join hook brings it to the current
        version before it gets work again. When none answers (every pod restarting at once), ask again as their
        backoffs end, until one does or `weight_sync.timeout_s` has passed."""
        deadline = time.monotonic() + self.weight_sync.timeout_s
        while True:
            members = await self.pool.wait_for_members()
            infos = await asyncio.gather(
                *(self._join_sync.infos([(m.address, m.channel)]) for m in members), return_exceptions=True
            )
            up: list[tuple[RolloutTarget, rollout_pb2.GetInfoResponse | None]] = []
            for member, info in zip(members, infos, strict=True):
                if isinstance(info, aio.AioRpcError) and info.code() == grpc.StatusCode.UNAVAILABLE:
                    self.pool.mark_failed(member, f"unreachable for a weight update: {info.details()}")
                else:  # any other failure surfaces from the push (which asks again), naming the server
                    up.append((member, None if isinstance(info, BaseException) else info[0]))
            remaining = deadline - time.monotonic()
            if up or remaining <= 0:
                break
            await asyncio.sleep(min(remaining, self.pool.retry_in()))
        if not up:
            raise WeightSyncError(
                f"no rollout server was reachable for the weight update within {self.weight_sync.timeout_s:g}s",
                {m.address: "UNAVAILABLE" for m in members},
            )
        return up

    async def bring_up_to_date(self, target: RolloutTarget) -> None:
        """The pool's join hook: a server behind the current policy version gets the current weights first."""
        async with self._weights_lock:
            if self._weights is None:
                return  # nothing pushed yet: every server holds the base weights
            me = [(target.address, target.channel)]
            infos = await self._join_sync.infos(me)
            if infos[0].policy_version >= self.policy_version:
                return
            if stamp(self._weights) != self._weights_stamp:  # raising keeps it out of the pool; retried later
                raise RuntimeError(
                    f"rollout server {target.address} needs policy version {self.policy_version}, but the tensors "
                    "passed to update_weights for it were changed in place since: it waits for the next update"
                )
            log.info("rollout server %s serves policy version %d: sending it version %d before any work",
                     target.address, infos[0].policy_version, self.policy_version)  # fmt: skip
            await self._join_sync.push(me, self._weights, self.policy_version, infos=infos)
            self.join_updates += 1


def stamp(state: Mapping[str, torch.Tensor]) -> tuple[int, ...]:
    """Each tensor's autograd version counter: any in-place change (an optimizer step, `copy_`) bumps it.
    Tensors made under inference mode have none (-1): they cannot be changed in place outside it."""
    out = []
    for t in state.values():
        try:
            out.append(int(t._version))
        except RuntimeError:
            out.append(-1)
    return tuple(out)

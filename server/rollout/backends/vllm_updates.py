"""The engine side of a vLLM backend's weight updates: stream, pause, commit, label, resume.

Tensors go to the workers through ``collective_rpc`` as safetensors chunks of at most ``CHUNK_BYTES`` (staged while
generation goes on), or as CUDA IPC handles through vLLM's own weight-transfer engine. Either way the engine is
paused with its requests kept where the release allows (else the load happens between scheduler steps and the
prefix cache is reset), the new version is labelled, and a load that fails part-way marks the model torn: it
refuses work until an update covers every tensor of that one. The worker side is in vllm_weights.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import pickle
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from rewardmesh.common.planes.cuda_ipc import device_uuid, rebuild_args
from rewardmesh.common.planes.manifest import Entry, WeightsError, validate_weights
from rewardmesh.server.rollout.backends.base import Backend, WeightsNotApplied
from rewardmesh.server.rollout.backends.vllm_weights import (
    CHUNK_BYTES,
    checkpoint_specs,
    iter_chunks,
    model_dir,
    weight_transfer_requests,
)

# The backend's logger: these lines read as the rest of the backend's.
logger = logging.getLogger("rewardmesh.server.rollout.backends.vllm_backend")


class VLLMWeightUpdates(Backend):
    """Weight updates of :class:`~rewardmesh.server.rollout.backends.vllm_backend.VLLMBackend`, which sets the state
    below and runs the engine."""

    config: Any  # the checkpoint's transformers config
    _engine: Any  # vLLM's AsyncLLM once started, else None
    _model_config: Any  # the engine's model config once started, else None
    _update_lock: asyncio.Lock  # one update at a time
    _updates: int  # weight updates begun: a request that saw none knows every token's version
    _torn: set[str]  # tensors a failed load may have left half-applied
    _specs: dict[str, tuple[tuple[int, ...], torch.dtype]] | None  # the checkpoint's, read once
    _ipc: bool  # the engine runs vLLM's "ipc" weight transfer
    _ipc_ready: bool  # init_weight_transfer_engine done

    def _checkpoint_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        if self._specs is None:
            path = model_dir(self.model)
            if path is None:
                raise RuntimeError(f"{self.model}: checkpoint not found locally; await start() first")
            self._specs = checkpoint_specs(path)
        return self._specs

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Checkpoint names and shapes; the dtype is the one the engine computes in once started."""
        specs = self._checkpoint_specs()
        if self._engine is None:
            return dict(specs)
        dtype = self._model_config.dtype
        return {
            name: (shape, dtype if spec_dtype.is_floating_point else spec_dtype)
            for name, (shape, spec_dtype) in specs.items()
        }

    def quantization(self) -> str | None:
        """The model's quantization method, from the engine once started, else from the checkpoint config."""
        method = getattr(self._model_config, "quantization", None) if self._model_config is not None else None
        if method:
            return str(method)
        config = getattr(self.config, "quantization_config", None)
        if config:
            return str(config.get("quant_method", "yes") if isinstance(config, dict) else config)
        return None

    def _refuse_quantized(self) -> None:
        quantized = self.quantization()
        if quantized:
            raise WeightsError(
                f"{self.model} is quantized ({quantized}): in-place weight updates need vLLM's reload path, which "
                "this backend does not use yet; serve an unquantized checkpoint to update weights"
            )

    def validate_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        self._refuse_quantized()
        validate_weights(tensors, self._checkpoint_specs())

    async def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Validate, stream chunks into the workers, then pause (keeping requests), commit, label, resume.

        All or nothing: every tensor is validated before the first byte moves, and the worker checks the
        staged set is complete before loading any of it. The version is set right after the commit.
        """
        self.validate_weights(tensors)
        if self._engine is None:
            await self.start()
        engine = self._engine
        skip = {"lm_head.weight"} if self._tied() else set()  # vLLM ignores it for tied embeddings
        expected = [name for name in tensors if name not in skip]
        async with self._update_lock:
            chunks = 0
            try:
                stream = iter_chunks(tensors, skip=skip, chunk_bytes=CHUNK_BYTES)
                while (blob := await asyncio.to_thread(next, stream, None)) is not None:
                    await engine.collective_rpc("rewardmesh_stage_weights", args=(blob,))
                    chunks += 1
                refused = [r for r in await engine.collective_rpc("rewardmesh_check_weights", args=(expected,)) if r]
                if refused:  # a chunk or piece went missing: nothing is loaded
                    raise WeightsNotApplied(refused[0])
                self._updates += 1
                paused = await self._pause(engine)
            except BaseException:  # nothing loaded yet: drop what was staged, the old weights serve on
                with contextlib.suppress(Exception):
                    await engine.collective_rpc("rewardmesh_discard_weights")
                raise
            await self._load(engine, paused, expected, version,
                             lambda: engine.collective_rpc("rewardmesh_commit_weights", args=(expected,)))  # fmt: skip
        logger.info(
            "vllm backend: applied %d tensors in %d chunk(s), policy_version=%d", len(expected), chunks, version
        )

    async def _load(
        self, engine: Any, paused: bool, names: list[str], version: int, load: Callable[[], Awaitable[Any]]
    ) -> None:
        """Load (the engine paused, or between steps), label the version, resume; a load that fails part-way
        marks the model torn."""
        try:
            try:
                await load()
            except BaseException as exc:
                self._mark_torn(names, version, exc)
                raise
            self._torn.difference_update(names)
            if not self._torn:
                self.unusable = None
            self.policy_version = int(version)
            if hasattr(engine, "update_weight_version"):
                try:
                    await engine.update_weight_version(str(version))
                except Exception:
                    logger.warning("vllm backend: update_weight_version(%s) failed", version, exc_info=True)
        finally:
            if paused:
                await engine.resume_generation()
        if not paused:
            await self._reset_prefix_cache()

    @property
    def cuda_device_uuid(self) -> str:
        """The engine's GPU when it takes CUDA IPC updates (vLLM's "ipc" weight transfer), else ""."""
        return device_uuid(0) if self._ipc else ""

    async def update_weights_ipc(self, entries: list[Entry], source: Any, version: int) -> None:
        """CUDA IPC handles of a colocated trainer's tensors (checked by the receiver), loaded by vLLM's own
        weight-transfer engine: pause (requests kept), start, update (the workers open the handles and load
        device to device), finish, label the version, resume. Unverified: needs a GPU and vLLM."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        self._refuse_quantized()
        if self._engine is None:
            await self.start()
        engine = self._engine
        init_request, update_request = weight_transfer_requests()
        skip = {"lm_head.weight"} if self._tied() else set()  # vLLM ignores it for tied embeddings
        chosen = [(h, e) for h, e in zip(source.handles, entries, strict=True) if e.name not in skip]
        handles = [{source.device_uuid: (rebuild_cuda_tensor, rebuild_args(h, e, 0))} for h, e in chosen]
        names = [e.name for _, e in chosen]
        info = {"names": names, "dtype_names": [str(e.dtype).removeprefix("torch.") for _, e in chosen],
                "shapes": [list(e.shape) for _, e in chosen],
                "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode()}  # fmt: skip
        async with self._update_lock:
            if not self._ipc_ready:
                await engine.init_weight_transfer_engine(init_request(init_info={}))
                self._ipc_ready = True
            self._updates += 1
            paused = await self._pause(engine)

            async def load() -> None:
                if hasattr(engine, "start_weight_update"):  # releases with the four-phase protocol
                    await engine.start_weight_update()
                await engine.update_weights(update_request(update_info=info))
                if hasattr(engine, "finish_weight_update"):
                    await engine.finish_weight_update()

            await self._load(engine, paused, names, version, load)
        logger.info("vllm backend: loaded %d tensors over CUDA IPC, policy_version=%d", len(names), version)

    def _mark_torn(self, names: list[str], version: int, exc: BaseException) -> None:
        """A commit that failed inside ``load_weights`` may have applied some tensors: stop serving.

        The worker's own checks fail before loading anything (WeightsNotApplied); any other failure leaves an
        unknown mix of versions, which must not produce samples labelled with either.
        """
        if isinstance(exc, WeightsNotApplied):
            return
        self._torn.update(names)
        self.unusable = (
            f"loading weights version {version} failed part-way ({exc}); the model mixes two versions and "
            "serves again after a weight update that includes every tensor of that one"
        )
        logger.error("vllm backend: %s", self.unusable)

    async def _pause(self, engine: Any) -> bool:
        """vLLM's async-RL pause: running requests stay (their KV is dropped and recomputed on resume)."""
        if not (hasattr(engine, "pause_generation") and hasattr(engine, "resume_generation")):
            return False
        try:
            await engine.pause_generation(mode="keep", clear_cache=True)
        except TypeError:  # a release whose pause_generation has no mode
            return False
        return True

    def _tied(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))

    async def _reset_prefix_cache(self) -> None:
        """Releases without pause/resume: cached prefixes hold KV from the old weights; drop them.

        Recent vLLM can also reset running requests (they are preempted and recomputed with the new
        weights); older releases refuse to reset while blocks are in use, which is only logged.
        """
        engine = self._engine
        try:
            try:
                ok = await engine.reset_prefix_cache(reset_running_requests=True)
            except TypeError:
                ok = await engine.reset_prefix_cache()
        except Exception:
            logger.warning("vllm backend: prefix cache reset failed; stale prefixes may be reused", exc_info=True)
            return
        if ok is False:
            logger.warning("vllm backend: prefix cache not reset (requests in flight); stale prefixes may be reused")

"""vLLM's in-process async engine behind the Backend protocol: continuous batching, token ids in and out.

Supported vLLM releases: 0.26 to 0.33 (each pins one torch: 0.26.0 torch 2.11.0, 0.27.1-0.32.0 torch 2.13.0,
0.33.0 torch 2.14.0). Where the API moved between them the backend detects what is there: ``tokens_input()``
or ``TokensPrompt`` for prompts, ``logprobs_mode``, ``pause_generation``/``resume_generation`` and
``update_weight_version`` for the weight swap, ``CompletionOutput.weight_versions`` for per-token versions.

vLLM is imported only inside functions, so this module (and the worker extension, which vLLM imports by name in
its worker processes) loads on machines without vLLM. Its parts: engine options (vllm_engine), requests and outputs
(vllm_outputs), the weight updates on the engine's side (vllm_updates), and weight chunks, checkpoint specs and the
worker extension (vllm_weights).

Weight updates travel through ``collective_rpc`` to methods that :class:`RewardMeshWorkerExtension` mixes
into vLLM's worker class (``worker_extension_cls``). Tensors go as safetensors bytes, which every vLLM
version's IPC layer carries without pickling, one chunk of at most ``CHUNK_BYTES`` at a time (a larger tensor
is split), so host memory stays bounded. Chunks are staged in the worker while generation goes on; then the
engine is paused with its running requests kept (vLLM's async-RL sequence:
``pause_generation(mode="keep", clear_cache=True)``), the staged set is checked complete and loaded in one
commit RPC, the new version is labelled (``update_weight_version``) and generation resumes. Releases without
pause/resume fall back to committing between scheduler steps and resetting the prefix cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from typing import Any

import torch

from rewardmesh.common.errors import Unavailable
from rewardmesh.server.rollout.backends.base import GenerationOutput, GenerationRequest, SampleDone
from rewardmesh.server.rollout.backends.requests import validate_request
from rewardmesh.server.rollout.backends.vllm_engine import (
    build_engine,
    check_engine_args,
    complete_engine_args,
    engine_arg_names,
    parse_engine_args,
    shutdown_engine,
    uses_ipc_transfer,
)
from rewardmesh.server.rollout.backends.vllm_outputs import SampleDeltas, sampling_params, to_output, token_prompt
from rewardmesh.server.rollout.backends.vllm_updates import VLLMWeightUpdates
from rewardmesh.server.rollout.backends.vllm_weights import (
    CHUNK_BYTES,
    WORKER_EXTENSION,
    RewardMeshWorkerExtension,
    checkpoint_specs,
    iter_chunks,
    join_parts,
    pack_chunks,
)

__all__ = [
    "CHUNK_BYTES",
    "RewardMeshWorkerExtension",
    "VLLMBackend",
    "checkpoint_specs",
    "iter_chunks",
    "join_parts",
    "pack_chunks",
    "parse_engine_args",
]

logger = logging.getLogger(__name__)

GREEDY_BELOW = 1e-5  # vLLM samples greedily below this temperature (its _SAMPLING_EPS)

# ------------------------------------------------------------------------------------------------- backend


class VLLMBackend(VLLMWeightUpdates):
    """vLLM AsyncLLM (V1) behind the Backend protocol (see base.py)."""

    name = "vllm"
    loads_cuda_ipc = True  # through vLLM's weight-transfer engine (update_weights_ipc)

    def __init__(
        self,
        model: str,
        *,
        gpu_memory_utilization: float = 0.85,
        tensor_parallel_size: int = 1,
        max_model_len: int | None = None,
        dtype: str = "auto",
        enforce_eager: bool = False,
        attention_backend: str | None = None,
        seed: int = 0,
        engine_args: dict[str, Any] | None = None,
        **engine_options: Any,
    ) -> None:
        """The named options are the common engine arguments; ``engine_args`` (and any other keyword) pass
        through to ``vllm.AsyncEngineArgs`` unchanged and win over the named ones. Unknown keys fail at
        :meth:`start` (or :meth:`check_engine_args`) with a ValueError naming them."""
        from transformers import AutoConfig, AutoTokenizer

        self.model = str(model)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model)
        self.config = AutoConfig.from_pretrained(self.model)
        options: dict[str, Any] = {
            "gpu_memory_utilization": gpu_memory_utilization,
            "tensor_parallel_size": tensor_parallel_size,
            "max_model_len": max_model_len,
            "dtype": dtype,
            "enforce_eager": enforce_eager,
            "seed": seed,
        }
        if attention_backend:
            options["attention_backend"] = attention_backend
        options.update(engine_options)
        options.update(engine_args or {})
        self.engine_options = options
        limit = getattr(self.config, "max_position_embeddings", None)
        requested = options.get("max_model_len")
        self.max_model_len = int(requested if requested is not None else (limit or 0))
        self.vocab_size: int | None = getattr(self.config, "vocab_size", None)
        self.policy_version = 0

        self._engine: Any = None
        self._model_config: Any = None
        self._start_lock = asyncio.Lock()
        self._update_lock = asyncio.Lock()
        self._updates = 0  # weight updates begun: a request that saw none knows every token's version
        # Why the engine must not serve (None: it may). Set when loading an update failed part-way: the model
        # then holds a mix of two versions, so it refuses work until a later update covers `_torn`.
        self.unusable: str | None = None
        self._torn: set[str] = set()
        self._inflight: dict[str, asyncio.Future[GenerationOutput]] = {}
        self._groups = 0  # requests of n > 1 samples in flight
        self._tasks: set[asyncio.Task[Any]] = set()
        self._specs: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
        self._closed = False
        self._id_prefix = f"rm-{uuid.uuid4().hex[:12]}-"  # request ids: this prefix and a counter (no uuid each)
        self._ids = itertools.count()
        self._ipc = False  # the engine runs vLLM's "ipc" weight transfer (set when it is built)
        self._ipc_ready = False  # init_weight_transfer_engine done

    # ------------------------------------------------------------------------------------------ lifecycle

    @property
    def ready(self) -> bool:
        return self._engine is not None

    def engine_kwargs(self) -> dict[str, Any]:
        """Everything given to AsyncEngineArgs (model, options, the worker extension, processed log-probs)."""
        kwargs: dict[str, Any] = {"model": self.model, "tokenizer": self.model, **self.engine_options}
        kwargs["worker_extension_cls"] = WORKER_EXTENSION
        return kwargs

    def check_engine_args(self) -> None:
        """Validate the options against the installed vLLM's AsyncEngineArgs (needs vLLM, not a GPU)."""
        check_engine_args(self.engine_kwargs(), engine_arg_names())

    def _build_engine(self) -> Any:
        """Create the engine; blocking (vLLM loads and profiles the model), so it runs in a worker thread."""
        kwargs = complete_engine_args(self.engine_kwargs(), engine_arg_names())
        self._ipc = uses_ipc_transfer(kwargs)
        return build_engine(kwargs)

    async def start(self) -> None:
        """Boot the engine off the event loop (minutes for a large model); the loop keeps serving meanwhile."""
        async with self._start_lock:
            if self._closed:
                raise RuntimeError("VLLMBackend is closed")
            if self._engine is not None:
                return
            engine = await asyncio.to_thread(self._build_engine)
            model_config = getattr(engine, "model_config", None)
            if model_config is None:  # the V0 engine only offers the async getter
                model_config = await engine.get_model_config()
            self._model_config = model_config
            self.max_model_len = int(model_config.max_model_len)
            self.vocab_size = int(model_config.get_vocab_size())
            if hasattr(engine, "update_weight_version"):
                with contextlib.suppress(Exception):  # label tokens from the start, so spans are never unlabelled
                    await engine.update_weight_version(str(self.policy_version))
            self._engine = engine
            if self._closed:  # closed while booting
                await shutdown_engine(engine)
                self._engine = None
                raise RuntimeError("VLLMBackend is closed")
            logger.info(
                "vllm backend: %s ready (dtype %s, max_model_len %d)",
                self.model,
                model_config.dtype,
                self.max_model_len,
            )

    async def close(self) -> None:
        """Fail in-flight requests and shut the engine (and its worker processes) down."""
        self._closed = True
        error = RuntimeError("VLLMBackend closed")
        for future in self._inflight.values():
            if not future.done():
                future.set_exception(error)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        engine, self._engine = self._engine, None
        if engine is not None:
            await shutdown_engine(engine)

    # --------------------------------------------------------------------------------------------- serving

    @property
    def running(self) -> int:
        """Engine requests in flight (a group of samples is one)."""
        return self._groups + sum(1 for f in self._inflight.values() if not f.done())

    def sampling_params(self, request: GenerationRequest, n: int = 1) -> Any:
        return sampling_params(request, n)

    @staticmethod
    def prompt(prompt_ids: list[int]) -> Any:
        return token_prompt(prompt_ids)

    async def _admit(self, request: GenerationRequest) -> None:
        """Refuse what must not reach the engine (closed, torn weights, a bad request); boot it if need be."""
        if self._closed:
            raise RuntimeError("VLLMBackend is closed")
        if self.unusable:
            raise Unavailable(self.unusable)
        validate_request(request, max_model_len=self.max_model_len, vocab_size=self.vocab_size)
        if self._engine is None:
            await self.start()

    async def generate(self, request: GenerationRequest) -> GenerationOutput:
        await self._admit(request)
        request_id = f"{self._id_prefix}{next(self._ids)}"
        future: asyncio.Future[GenerationOutput] = asyncio.get_running_loop().create_future()
        self._inflight[request_id] = future
        task = asyncio.create_task(self._consume(request_id, request, future), name=f"vllm-{request_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            return await future
        finally:
            self._inflight.pop(request_id, None)
            if not task.done():
                # We were cancelled (or closed): cancelling the consumer makes vLLM's generate() abort the
                # request; abort again explicitly in case this vLLM version does not.
                task.cancel()
                self._spawn(self._abort(request_id))

    async def _consume(
        self, request_id: str, request: GenerationRequest, future: asyncio.Future[GenerationOutput]
    ) -> None:
        version = self.policy_version  # the oldest weights that can contribute tokens to this request
        updates = self._updates
        try:
            final: Any = None
            prompt = self.prompt(list(request.prompt_ids))
            async for out in self._engine.generate(prompt, self.sampling_params(request), request_id):
                final = out
            if final is None or not final.outputs:
                raise RuntimeError(f"vLLM returned no output for request {request_id}")
            result = self._to_output(request, final, version, same_weights=updates == self._updates)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not future.done():
                future.set_exception(exc)
            return
        if not future.done():
            future.set_result(result)

    def _to_output(
        self, request: GenerationRequest, final: Any, version: int, same_weights: bool = False
    ) -> GenerationOutput:
        return to_output(self.tokenizer, request, final.outputs[0], getattr(final, "metrics", None), version,
                         same_weights)  # fmt: skip

    async def generate_group(self, request: GenerationRequest, n: int, on_sample: SampleDone) -> None:
        """One engine request with n samples (vLLM prepares the prompt once; sample k has seed `seed + k`), each
        reported the moment vLLM finishes it. vLLM refuses n > 1 greedy: those samples are requests of their own."""
        if n == 1 or request.temperature < GREEDY_BELOW:
            await super().generate_group(request, n, on_sample)
            return
        await self._admit(request)
        request_id = f"{self._id_prefix}{next(self._ids)}"
        version, updates = self.policy_version, self._updates
        samples = SampleDeltas()
        left = n
        self._groups += 1
        try:
            prompt = self.prompt(list(request.prompt_ids))
            async for out in self._engine.generate(prompt, self.sampling_params(request, n), request_id):
                # A request's metrics are its one sample's only when the output carries that sample alone.
                metrics = getattr(out, "metrics", None) if len(out.outputs) == 1 else None
                for delta in out.outputs:
                    completion = samples.add(delta)
                    if completion is None:
                        continue
                    left -= 1
                    try:
                        result = to_output(self.tokenizer, request, completion, metrics, version,
                                           same_weights=updates == self._updates)  # fmt: skip
                    except Exception as exc:  # this sample's failure (vLLM's finish_reason "error")
                        on_sample(completion.index, exc)
                    else:
                        on_sample(completion.index, result)
        finally:
            self._groups -= 1
            if left:  # cancelled or failed part-way: make sure vLLM drops the samples still running
                self._spawn(self._abort(request_id))

    async def _abort(self, request_id: str) -> None:
        engine = self._engine
        if engine is not None:
            with contextlib.suppress(Exception):
                await engine.abort(request_id)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

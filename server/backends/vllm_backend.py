"""vLLM's in-process async engine behind the Backend protocol: continuous batching, token ids in and out.

vLLM is imported only inside functions, so this module (and the worker extension below, which vLLM imports
by name in its worker processes) loads on machines without vLLM.

Weight updates travel through ``collective_rpc`` to methods that :class:`RewardMeshWorkerExtension` mixes
into vLLM's worker class (``worker_extension_cls``). Tensors go as safetensors bytes, which every vLLM
version's IPC layer carries without pickling; chunks are staged in the worker and applied by one final
commit RPC. The engine core runs utility RPCs between scheduler steps, so the swap is atomic with respect
to decoding: no step ever sees half of the new weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from pathlib import Path
from typing import Any

import torch

from client.weights import validate_weights
from server.backends.base import GenerationOutput, GenerationRequest
from server.backends.hf import trim_at_stop, validate_request

logger = logging.getLogger(__name__)

WORKER_EXTENSION = f"{__name__}.RewardMeshWorkerExtension"
CHUNK_BYTES = 512 * 1024 * 1024  # one RPC message; keeps peak host memory bounded for large models

_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class RewardMeshWorkerExtension:
    """Mixed into vLLM's GPU worker; each method runs inside a worker process, next to the model.

    vLLM requires the methods not to clash with the worker's own, hence the prefix.
    """

    model_runner: Any  # provided by the vLLM worker this class is mixed into

    def rewardmesh_stage_weights(self, blob: bytes) -> int:
        """Decode one chunk and hold it until commit, so a half-sent update is never applied."""
        from safetensors.torch import load

        staged: dict[str, torch.Tensor] = self.__dict__.setdefault("_rewardmesh_staged", {})
        staged.update(load(bytes(blob)))
        return len(staged)

    def rewardmesh_commit_weights(self) -> int:
        """Load everything staged in one call: it runs between engine steps, so decoding sees old or new."""
        staged: dict[str, torch.Tensor] = self.__dict__.pop("_rewardmesh_staged", {})
        if staged:
            # The worker's get_model() unwraps CUDA-graph wrappers; model_runner.model is the older spelling.
            getter = getattr(self, "get_model", None)
            model = getter() if callable(getter) else self.model_runner.model
            model.load_weights(list(staged.items()))
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        return len(staged)

    def rewardmesh_discard_weights(self) -> int:
        staged: dict[str, torch.Tensor] = self.__dict__.pop("_rewardmesh_staged", {})
        return len(staged)


# ---------------------------------------------------------------------------------------- checkpoint specs


def _model_dir(model: str) -> Path | None:
    """The local directory holding the checkpoint: the path itself, or the Hugging Face cache's snapshot."""
    path = Path(model)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True, allow_patterns=["*.json", "*.safetensors"]))
    except Exception:  # not cached (yet): vLLM downloads it at start
        return None


def checkpoint_specs(model_dir: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Tensor names, shapes and dtypes from the safetensors headers (no tensor data is read).

    These are the checkpoint (Hugging Face) names that vLLM's ``load_weights`` accepts; vLLM's own parameter
    names differ (fused qkv / gate_up projections), so this, not ``named_parameters``, is what a trainer's
    state dict must match. Tied embeddings also accept ``lm_head.weight``, as a transformers state dict has it.
    """
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files (only safetensors checkpoints are supported)")
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                part = f.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(part.get_dtype(), torch.float32)
                specs[name] = (tuple(int(d) for d in part.get_shape()), dtype)
    config = _read_json(model_dir / "config.json") or {}
    embed = specs.get("model.embed_tokens.weight")
    if config.get("tie_word_embeddings") and embed is not None and "lm_head.weight" not in specs:
        specs["lm_head.weight"] = embed
    return specs


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def pack_chunks(
    tensors: dict[str, torch.Tensor], *, skip: set[str] | None = None, chunk_bytes: int = CHUNK_BYTES
) -> list[bytes]:
    """safetensors-encode CPU copies of ``tensors`` in chunks of about ``chunk_bytes``."""
    from safetensors.torch import save

    skip = skip or set()
    chunks: list[bytes] = []
    current: dict[str, torch.Tensor] = {}
    size = 0
    seen: set[int] = set()
    for name, tensor in tensors.items():
        if name in skip:
            continue
        t = tensor.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:  # tied tensors share storage, which safetensors refuses to write twice
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        current[name] = t
        size += t.numel() * t.element_size()
        if size >= chunk_bytes:
            chunks.append(save(current))
            current, size, seen = {}, 0, set()
    if current:
        chunks.append(save(current))
    return chunks


# ------------------------------------------------------------------------------------------------- backend


class VLLMBackend:
    """vLLM AsyncLLM (V1) behind the Backend protocol (see base.py)."""

    name = "vllm"

    def __init__(
        self,
        model: str,
        *,
        gpu_memory_utilization: float = 0.85,
        max_model_len: int | None = None,
        dtype: str = "auto",
        enforce_eager: bool = False,
        seed: int = 0,
        **engine_options: Any,
    ) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.model = str(model)
        self.gpu_memory_utilization = gpu_memory_utilization
        self.dtype = dtype
        self.enforce_eager = enforce_eager
        self.seed = seed
        self.engine_options = engine_options  # passed through to AsyncEngineArgs
        self.tokenizer = AutoTokenizer.from_pretrained(self.model)
        self.config = AutoConfig.from_pretrained(self.model)
        self._requested_max_model_len = max_model_len
        limit = getattr(self.config, "max_position_embeddings", None)
        self.max_model_len = int(max_model_len if max_model_len is not None else (limit or 0))
        self.vocab_size: int | None = getattr(self.config, "vocab_size", None)
        self.policy_version = 0

        self._engine: Any = None
        self._model_config: Any = None
        self._start_lock = asyncio.Lock()
        self._update_lock = asyncio.Lock()
        self._inflight: dict[str, asyncio.Future[GenerationOutput]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._specs: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
        self._closed = False

    # ------------------------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Boot the engine. This blocks the event loop while vLLM loads and profiles: call it before serving."""
        async with self._start_lock:
            if self._closed:
                raise RuntimeError("VLLMBackend is closed")
            if self._engine is not None:
                return
            from vllm import AsyncEngineArgs

            try:
                from vllm.v1.engine.async_llm import AsyncLLM as engine_cls
            except ImportError:  # older releases: the V0 async engine has the same generate/abort API
                from vllm import AsyncLLMEngine as engine_cls

            args = AsyncEngineArgs(
                model=self.model,
                tokenizer=self.model,
                dtype=self.dtype,
                seed=self.seed,
                max_model_len=self._requested_max_model_len,
                gpu_memory_utilization=self.gpu_memory_utilization,
                enforce_eager=self.enforce_eager,
                worker_extension_cls=WORKER_EXTENSION,
                **self.engine_options,
            )
            self._engine = engine_cls.from_engine_args(args)
            model_config = getattr(self._engine, "model_config", None)
            if model_config is None:  # the V0 engine only offers the async getter
                model_config = await self._engine.get_model_config()
            self._model_config = model_config
            self.max_model_len = int(model_config.max_model_len)
            self.vocab_size = int(model_config.get_vocab_size())
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
            shutdown = getattr(engine, "shutdown", None) or getattr(engine, "shutdown_background_loop", None)
            if shutdown is not None:
                shutdown()

    # --------------------------------------------------------------------------------------------- serving

    @property
    def running(self) -> int:
        return sum(1 for f in self._inflight.values() if not f.done())

    def sampling_params(self, request: GenerationRequest) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=1,
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k if request.top_k > 0 else -1,  # -1: off, in every vLLM version
            seed=request.seed,
            stop=list(request.stop) or None,
            stop_token_ids=list(request.stop_token_ids) or None,
            detokenize=bool(request.stop),  # stop strings are matched on text; otherwise skip the work
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    async def generate(self, request: GenerationRequest) -> GenerationOutput:
        if self._closed:
            raise RuntimeError("VLLMBackend is closed")
        validate_request(request, max_model_len=self.max_model_len, vocab_size=self.vocab_size)
        if self._engine is None:
            await self.start()
        request_id = f"rm-{uuid.uuid4().hex}"
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
        from vllm import TokensPrompt

        version = self.policy_version  # the oldest weights that can contribute tokens to this request
        try:
            final: Any = None
            prompt = TokensPrompt(prompt_token_ids=list(request.prompt_ids))
            async for out in self._engine.generate(prompt, self.sampling_params(request), request_id):
                final = out
            if final is None or not final.outputs:
                raise RuntimeError(f"vLLM returned no output for request {request_id}")
            result = self._to_output(request, final, version)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not future.done():
                future.set_exception(exc)
            return
        if not future.done():
            future.set_result(result)

    def _to_output(self, request: GenerationRequest, final: Any, version: int) -> GenerationOutput:
        completion = final.outputs[0]
        token_ids = [int(t) for t in completion.token_ids]
        reason = completion.finish_reason or "abort"
        if request.stop and isinstance(completion.stop_reason, str):
            # vLLM cuts the stop string from the text but not always from token_ids; drop whole tokens the
            # same way HFBackend does, so both backends return the same ids.
            kept = trim_at_stop(self.tokenizer, token_ids, request.stop)
            if kept is not None:
                token_ids = kept
        if reason not in ("stop", "length", "abort"):
            reason = "stop"
        preempted = getattr(final, "num_preempted", None)  # not reported per request by vLLM V1 (see module doc)
        return GenerationOutput(
            token_ids=token_ids,
            finish_reason=reason,
            num_preempted=int(preempted) if isinstance(preempted, int) else -1,
            policy_version=version,
        )

    async def _abort(self, request_id: str) -> None:
        engine = self._engine
        if engine is not None:
            with contextlib.suppress(Exception):
                await engine.abort(request_id)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -------------------------------------------------------------------------------------------- weights

    def _checkpoint_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        if self._specs is None:
            model_dir = _model_dir(self.model)
            if model_dir is None:
                raise RuntimeError(f"{self.model}: checkpoint not found locally; await start() first")
            self._specs = checkpoint_specs(model_dir)
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

    def validate_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        validate_weights(tensors, self._checkpoint_specs())

    async def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Validate, stage in the workers, commit atomically, then drop KV computed by the old weights."""
        self.validate_weights(tensors)
        if self._engine is None:
            await self.start()
        skip = {"lm_head.weight"} if self._tied() else set()  # vLLM ignores it for tied embeddings
        async with self._update_lock:
            chunks = await asyncio.to_thread(pack_chunks, tensors, skip=skip)
            try:
                for blob in chunks:
                    await self._engine.collective_rpc("rewardmesh_stage_weights", args=(blob,))
                await self._engine.collective_rpc("rewardmesh_commit_weights")
            except BaseException:
                with contextlib.suppress(Exception):
                    await self._engine.collective_rpc("rewardmesh_discard_weights")
                raise
            await self._reset_prefix_cache()
            self.policy_version = int(version)
        logger.info(
            "vllm backend: applied %d tensors in %d chunk(s), policy_version=%d", len(tensors), len(chunks), version
        )

    def _tied(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))

    async def _reset_prefix_cache(self) -> None:
        """Cached prefixes hold KV from the old weights; new requests must not reuse them.

        Recent vLLM can also reset running requests (they are preempted and recomputed with the new
        weights); older releases refuse to reset while blocks are in use, which is only logged.
        """
        engine = self._engine
        try:
            ok = await engine.reset_prefix_cache(reset_running_requests=True)
        except TypeError:
            ok = await engine.reset_prefix_cache()
        if ok is False:
            logger.warning("vllm backend: prefix cache not reset (requests in flight); stale prefixes may be reused")

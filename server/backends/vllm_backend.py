"""vLLM's in-process async engine behind the Backend protocol: continuous batching, token ids in and out.

Supported vLLM releases: 0.26 to 0.33 (each pins one torch: 0.26.0 torch 2.11.0, 0.27.1-0.32.0 torch 2.13.0,
0.33.0 torch 2.14.0). Where the API moved between them the backend detects what is there: ``tokens_input()``
or ``TokensPrompt`` for prompts, ``logprobs_mode``, ``pause_generation``/``resume_generation`` and
``update_weight_version`` for the weight swap, ``CompletionOutput.weight_versions`` for per-token versions.

vLLM is imported only inside functions, so this module (and the worker extension below, which vLLM imports
by name in its worker processes) loads on machines without vLLM.

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
import base64
import contextlib
import dataclasses
import difflib
import json
import logging
import math
import os
import pickle
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from rewardmesh.common.cuda_ipc import device_uuid, rebuild_args
from rewardmesh.common.weights import Entry, WeightsError, validate_weights
from rewardmesh.reward_engine.errors import Unavailable
from rewardmesh.server.backends.base import GenerationFailed, GenerationOutput, GenerationRequest
from rewardmesh.server.backends.requests import trim_at_stop, validate_request

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


PART_SEP = "#"  # "name#i/n#d0xd1...": piece i of n of a tensor split to fit a chunk; never in a parameter name


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

    def rewardmesh_commit_weights(self, expected: list[str] | None = None) -> int:
        """Join split tensors, check the staged set is exactly ``expected``, then load it in one call.

        Everything is checked before the first tensor is loaded, so a missing chunk or piece applies nothing.
        The call runs between engine steps (or while the engine is paused), so decoding sees old or new.
        """
        staged: dict[str, torch.Tensor] = self.__dict__.pop("_rewardmesh_staged", {})
        tensors = join_parts(staged)
        if expected is not None and set(tensors) != set(expected):
            missing = sorted(set(expected) - set(tensors))[:5]
            extra = sorted(set(tensors) - set(expected))[:5]
            raise ValueError(f"staged weights incomplete: missing {missing}, unexpected {extra}; nothing applied")
        if tensors:
            # The worker's get_model() unwraps CUDA-graph wrappers; model_runner.model is the older spelling.
            getter = getattr(self, "get_model", None)
            model = getter() if callable(getter) else self.model_runner.model
            model.load_weights(list(tensors.items()))
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        return len(tensors)

    def rewardmesh_discard_weights(self) -> int:
        staged: dict[str, torch.Tensor] = self.__dict__.pop("_rewardmesh_staged", {})
        return len(staged)


def join_parts(staged: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole tensors from staged chunks: pieces named ``name#i/n#shape`` are concatenated and reshaped."""
    whole: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    meta: dict[str, tuple[int, tuple[int, ...]]] = {}
    for key, tensor in staged.items():
        if PART_SEP not in key:
            whole[key] = tensor
            continue
        name, index, dims = key.split(PART_SEP)
        i, n = (int(x) for x in index.split("/"))
        parts.setdefault(name, {})[i] = tensor
        meta[name] = (n, tuple(int(d) for d in dims.split("x")) if dims else ())
    for name, pieces in parts.items():
        n, shape = meta[name]
        if sorted(pieces) != list(range(n)):
            raise ValueError(f"tensor {name!r}: {len(pieces)} of {n} pieces arrived; nothing applied")
        whole[name] = torch.cat([pieces[i] for i in range(n)]).reshape(shape)
    return whole


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


def iter_chunks(
    tensors: dict[str, torch.Tensor], *, skip: set[str] | None = None, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[bytes]:
    """safetensors-encode CPU copies of ``tensors``, one chunk of about ``chunk_bytes`` at a time.

    Only the chunk being built is held on the host; a tensor larger than ``chunk_bytes`` is split into
    flat pieces (``name#i/n#shape``) that :func:`join_parts` puts back together in the worker.
    """
    from safetensors.torch import save

    skip = skip or set()
    current: dict[str, torch.Tensor] = {}
    size = 0
    seen: set[int] = set()
    for name, tensor in tensors.items():
        if name in skip:
            continue
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > chunk_bytes:
            if current:
                yield save(current)
                current, size, seen = {}, 0, set()
            flat = tensor.detach().reshape(-1)
            per = max(1, chunk_bytes // tensor.element_size())
            n = math.ceil(flat.numel() / per)
            shape = "x".join(str(d) for d in tensor.shape)
            for i in range(n):
                piece = flat[i * per : (i + 1) * per].to("cpu").clone()
                yield save({f"{name}{PART_SEP}{i}/{n}{PART_SEP}{shape}": piece})
            continue
        t = tensor.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:  # tied tensors share storage, which safetensors refuses to write twice
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        current[name] = t
        size += nbytes
        if size >= chunk_bytes:
            yield save(current)
            current, size, seen = {}, 0, set()
    if current:
        yield save(current)


def pack_chunks(
    tensors: dict[str, torch.Tensor], *, skip: set[str] | None = None, chunk_bytes: int = CHUNK_BYTES
) -> list[bytes]:
    """Every chunk of :func:`iter_chunks` at once (tests; the backend streams them)."""
    return list(iter_chunks(tensors, skip=skip, chunk_bytes=chunk_bytes))


# -------------------------------------------------------------------------------------------- engine args


def parse_engine_args(items: list[str] | dict[str, Any] | None) -> dict[str, Any]:
    """``KEY=VALUE`` strings (flags, environment) or a mapping (YAML) -> engine keyword arguments.

    Values are read as YAML scalars, so ``0.5`` is a float, ``true`` a bool and ``{"a": 1}`` a dict;
    ``-`` in keys becomes ``_`` so vLLM's CLI spelling works too.
    """
    import yaml

    if not items:
        return {}
    if isinstance(items, dict):
        return {str(k).replace("-", "_"): v for k, v in items.items()}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"engine arg {item!r}: expected KEY=VALUE")
        try:
            parsed = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError:
            parsed = value
        out[key.strip().replace("-", "_")] = parsed
    return out


def check_engine_args(kwargs: dict[str, Any], known: set[str]) -> None:
    """Raise ValueError naming every key the engine's argument dataclass does not have (with a suggestion)."""
    unknown = sorted(k for k in kwargs if k not in known)
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, sorted(known), n=1)
        hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise ValueError(f"unknown vLLM engine argument(s): {', '.join(hints)}; see vllm.AsyncEngineArgs")


def engine_arg_names() -> set[str]:
    """The fields of the installed vLLM's AsyncEngineArgs."""
    from vllm import AsyncEngineArgs

    return {f.name for f in dataclasses.fields(AsyncEngineArgs)}


# ------------------------------------------------------------------------------------------------- backend


class VLLMBackend:
    """vLLM AsyncLLM (V1) behind the Backend protocol (see base.py)."""

    name = "vllm"

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
        self._tasks: set[asyncio.Task[Any]] = set()
        self._specs: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
        self._closed = False
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
        from vllm import AsyncEngineArgs

        try:
            from vllm.v1.engine.async_llm import AsyncLLM as engine_cls
        except ImportError:  # older releases: the V0 async engine has the same generate/abort API
            from vllm import AsyncLLMEngine as engine_cls

        known = engine_arg_names()
        kwargs = self.engine_kwargs()
        check_engine_args(kwargs, known)
        if "logprobs_mode" in known and "logprobs_mode" not in kwargs:
            # the log-prob of the distribution actually sampled from (after temperature, top-k, top-p)
            kwargs["logprobs_mode"] = "processed_logprobs"
        if "weight_transfer_config" in known and "weight_transfer_config" not in kwargs:
            from vllm.config import WeightTransferConfig

            # CUDA IPC updates from a colocated trainer. The handles reach the workers as a pickle this server
            # builds itself from checked fields (update_weights_ipc); vLLM unpickles them only with this set.
            os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
            kwargs["weight_transfer_config"] = WeightTransferConfig(backend="ipc")
        config = kwargs.get("weight_transfer_config")
        self._ipc = getattr(config, "backend", None) == "ipc" or (
            isinstance(config, dict) and config.get("backend") == "ipc"
        )
        return engine_cls.from_engine_args(AsyncEngineArgs(**kwargs))

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
                await self._shutdown(engine)
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
            await self._shutdown(engine)

    @staticmethod
    async def _shutdown(engine: Any) -> None:
        shutdown = getattr(engine, "shutdown", None) or getattr(engine, "shutdown_background_loop", None)
        if shutdown is not None:
            result = shutdown()
            if asyncio.iscoroutine(result):
                await result

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
            logprobs=0 if request.logprobs else None,  # 0: only the sampled token's
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    @staticmethod
    def prompt(prompt_ids: list[int]) -> Any:
        """A token prompt: ``vllm.inputs.tokens_input()`` where vLLM has it (TokensPrompt is deprecated)."""
        try:
            from vllm.inputs import tokens_input
        except ImportError:
            from vllm import TokensPrompt

            return TokensPrompt(prompt_token_ids=prompt_ids)
        return tokens_input(prompt_ids)

    async def generate(self, request: GenerationRequest) -> GenerationOutput:
        if self._closed:
            raise RuntimeError("VLLMBackend is closed")
        if self.unusable:
            raise Unavailable(self.unusable)
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
        """vLLM's final RequestOutput -> GenerationOutput; finish_reason "error" raises GenerationFailed.

        ``same_weights``: no weight update began while the request ran, so every token is ``version``'s
        even where vLLM reports no per-token versions.
        """
        completion = final.outputs[0]
        reason = completion.finish_reason or "abort"
        if reason == "error":
            raise GenerationFailed(
                f"vLLM failed this request (finish_reason 'error', stop_reason {completion.stop_reason!r})"
            )
        if reason not in ("stop", "length", "abort"):
            reason = "stop"  # e.g. "repetition": the engine ended the sequence on purpose
        token_ids = [int(t) for t in completion.token_ids]
        logprobs = _token_logprobs(completion, token_ids) if request.logprobs else None
        versions = _token_versions(completion, len(token_ids))
        if versions is None and same_weights:
            versions = [version] * len(token_ids)
        if request.stop and isinstance(completion.stop_reason, str):
            # vLLM cuts the stop string from the text but not always from token_ids; drop whole tokens the
            # same way HFBackend does, so both backends return the same ids.
            kept = trim_at_stop(self.tokenizer, token_ids, request.stop)
            if kept is not None:
                token_ids = kept
        n = len(token_ids)
        metrics = getattr(final, "metrics", None)
        preempted = getattr(metrics, "num_preemptions", None)
        if not isinstance(preempted, int):
            preempted = getattr(final, "num_preempted", None)  # older releases' spelling, where present
        return GenerationOutput(
            token_ids=token_ids,
            finish_reason=reason,
            num_preempted=int(preempted) if isinstance(preempted, int) else -1,
            policy_version=min(versions[:n], default=version) if versions else version,
            logprobs=logprobs[:n] if logprobs is not None else None,
            token_versions=versions[:n] if versions is not None else None,
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

        The worker's own checks fail before loading anything and say "nothing applied"; any other failure
        leaves an unknown mix of versions, which must not produce samples labelled with either.
        """
        if "nothing applied" in str(exc):
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


def weight_transfer_requests() -> tuple[Any, Any]:
    """vLLM's request types for its weight-transfer engine (init, update)."""
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest

    return WeightTransferInitRequest, WeightTransferUpdateRequest


def _token_logprobs(completion: Any, token_ids: list[int]) -> list[float] | None:
    """The sampled token's log-prob at each position, from vLLM's per-position {token id: Logprob} maps."""
    positions = getattr(completion, "logprobs", None)
    if positions is None or len(positions) < len(token_ids):
        return None
    out: list[float] = []
    for i, token in enumerate(token_ids):
        entry = positions[i].get(token) if positions[i] is not None else None
        if entry is None:
            return None
        out.append(float(getattr(entry, "logprob", entry)))
    return out


def _token_versions(completion: Any, n: int) -> list[int] | None:
    """Per-token versions from vLLM 0.33's ``weight_versions`` spans (labels this backend set: int strings)."""
    spans = getattr(completion, "weight_versions", None)
    if not spans:
        return None
    versions: list[int] = [-1] * n
    for span in spans:
        try:
            label = int(span.version)
        except (TypeError, ValueError):
            return None  # labelled by someone else: unknown
        for i in range(max(0, span.start), min(n, span.end)):
            versions[i] = label
    return None if -1 in versions else versions

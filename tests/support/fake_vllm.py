"""A CPU stand-in for the few vLLM APIs VLLMBackend calls, installed into ``sys.modules`` by a fixture.

Beside the tests on vLLM itself, this stand-in runs everywhere (no vLLM installed) and reaches what one
engine on one machine cannot show (injected failures, CUDA IPC, per-token version spans): engine argument
validation and defaults, booting off the event loop, prompt construction, log-prob / version / preemption
extraction, error finishes, and the weight-update sequence with the real worker extension (through the model
runner's in-place reload, as vLLM 0.32 has it) and a real model state dict. The API shapes follow vLLM 0.33's
source (``AsyncEngineArgs``, ``AsyncLLM``, ``RequestOutput``, ``CompletionOutput.weight_versions``,
``pause_generation(mode=..., clear_cache=...)``, the weight-transfer engine's requests and its IPC backend's
``update_info``).
"""

from __future__ import annotations

import asyncio
import base64
import os
import pickle
import sys
import time
import types
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from types import SimpleNamespace
from typing import Any, ClassVar

import torch

from rewardmesh.server.rollout.backends.vllm_weights import RewardMeshWorkerExtension


@dataclass
class AsyncEngineArgs:
    model: str = ""
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    attention_backend: str | None = None
    worker_extension_cls: str = ""
    logprobs_mode: str = "raw_logprobs"
    max_num_seqs: int = 256
    quantization: str | None = None
    compilation_config: dict[str, Any] = field(default_factory=dict)
    weight_transfer_config: Any = None
    disable_log_stats: bool = False
    max_logprobs: int = 20


@dataclass
class WeightTransferConfig:
    backend: str = "nccl"


@dataclass
class WeightTransferInitRequest:
    init_info: dict[str, Any]


@dataclass
class WeightTransferUpdateRequest:
    update_info: dict[str, Any]


class RequestOutputKind(Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class UsageContext(Enum):
    ENGINE_CONTEXT = "ENGINE_CONTEXT"
    LLM_CLASS = "LLM_CLASS"


class SamplingParams(SimpleNamespace):
    pass


class TokensPrompt(dict):
    pass


def tokens_input(prompt_token_ids: list[int]) -> dict[str, Any]:
    return {"type": "token", "prompt_token_ids": prompt_token_ids}


class FakeModel:
    """What ``load_weights`` sees in a vLLM worker: here a plain state dict; unknown names fail."""

    def __init__(self, state: dict[str, torch.Tensor], fail_after: int | None = None) -> None:
        self.state = state
        self.fail_after = fail_after
        self.loads: list[list[str]] = []

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.loads.append([name for name, _ in weights])
        for i, (name, tensor) in enumerate(weights):
            if self.fail_after is not None and i >= self.fail_after:
                raise RuntimeError("simulated failure inside load_weights")
            self.state[name].copy_(tensor)


class FakeRunner:
    """The model runner's in-place reload (vLLM 0.32's ``reload_weights``), over the stand-in model."""

    def __init__(self, model: FakeModel) -> None:
        self.model = model
        self.reloads = 0

    def reload_weights(
        self, weights_iterator: Any = None, weights_path: str | None = None, is_checkpoint_format: bool = True
    ) -> None:
        assert weights_iterator is not None and is_checkpoint_format
        self.reloads += 1
        self.model.load_weights(list(weights_iterator))


class FakeWorker(RewardMeshWorkerExtension):
    def __init__(self, model: FakeModel) -> None:
        self.model_runner = FakeRunner(model)

    def reload_weights(self, *args: Any, **kwargs: Any) -> None:
        self.model_runner.reload_weights(*args, **kwargs)


# respond(prompt_ids, params, engine) -> dict with token_ids, finish_reason, stop_reason, logprob, preemptions
Respond = Callable[[list[int], Any, "FakeEngine"], dict[str, Any]]


def echo(prompt_ids: list[int], params: Any, engine: FakeEngine) -> dict[str, Any]:
    tokens = (list(reversed(prompt_ids)) * params.max_tokens)[: params.max_tokens]
    return {"token_ids": tokens, "finish_reason": "length", "stop_reason": None, "logprob": -0.25, "preemptions": 2}


class FakeEngine:
    """AsyncLLM's surface: generate, abort, collective_rpc, pause/resume, weight version, prefix cache."""

    last: FakeEngine | None = None
    boot_seconds = 0.0
    state: ClassVar[dict[str, torch.Tensor]] = {}
    # What a CUDA IPC storage handle opens to; a GPU's driver maps the trainer's memory, the stand-in looks it up.
    ipc_memory: ClassVar[dict[bytes, torch.Tensor]] = {}

    def __init__(self, args: AsyncEngineArgs) -> None:
        self.args = args
        self.calls: list[tuple[Any, ...]] = []
        self.prompts: list[Any] = []
        self.params: list[Any] = []
        self.respond: Respond = echo
        self.label: str | None = None
        self.paused = False
        self.usage_context = UsageContext.ENGINE_CONTEXT
        self.model = FakeModel({k: v.clone() for k, v in self.state.items()})
        self.worker = FakeWorker(self.model)
        self.model_config = SimpleNamespace(
            max_model_len=args.max_model_len or 512,
            dtype=torch.float32,
            quantization=args.quantization,
            get_vocab_size=lambda: 512,
        )

    @classmethod
    def from_engine_args(
        cls, args: AsyncEngineArgs, usage_context: UsageContext = UsageContext.ENGINE_CONTEXT
    ) -> FakeEngine:
        time.sleep(cls.boot_seconds)  # vLLM's boot blocks its thread for a long while
        cls.last = cls(args)
        cls.last.usage_context = usage_context
        return cls.last

    async def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        """n = 1: the final output. n > 1 (deltas): each sample's first token, then each sample's end, in the order
        of its `seconds`, as vLLM's parallel sampling does with a long stream interval (sample k: seed + k)."""
        self.prompts.append(prompt)
        self.params.append(params)
        ids = list(prompt["prompt_token_ids"])
        if params.n == 1:
            spec = self.respond(ids, params, self)
            await asyncio.sleep(spec.get("seconds", 0.0))
            yield self._output(spec, params, 0, spec["token_ids"], True)
            return
        assert params.output_kind == RequestOutputKind.DELTA
        seed = params.seed
        children = [SamplingParams(**{**vars(params), "n": 1, "seed": None if seed is None else seed + k})
                    for k in range(params.n)]  # fmt: skip
        specs = [self.respond(ids, child, self) for child in children]
        for k, spec in enumerate(specs):
            yield self._output(spec, params, k, spec["token_ids"][:1], False)
        elapsed = 0.0
        for k, spec in sorted(enumerate(specs), key=lambda ks: ks[1].get("seconds", 0.0)):
            await asyncio.sleep(spec.get("seconds", 0.0) - elapsed)
            elapsed = spec.get("seconds", 0.0)
            yield self._output(spec, params, k, spec["token_ids"][1:], True, first=1)

    def _output(
        self, spec: dict[str, Any], params: Any, index: int, tokens: list[int], final: bool, first: int = 0
    ) -> Any:
        logprobs = None
        if params.logprobs is not None:
            logprobs = [{t: SimpleNamespace(logprob=spec["logprob"] - (first + i) / 100)} for i, t in enumerate(tokens)]
        spans = spec.get("weight_versions")
        if spans is None and self.label is not None:
            spans = [SimpleNamespace(version=self.label, start=0, end=len(spec["token_ids"]))]
        completion = SimpleNamespace(
            index=index,
            token_ids=tokens,
            finish_reason=spec["finish_reason"] if final else None,
            stop_reason=spec["stop_reason"] if final else None,
            logprobs=logprobs,
            weight_versions=spans if final else None,
        )
        return SimpleNamespace(outputs=[completion], metrics=SimpleNamespace(num_preemptions=spec["preemptions"]))

    async def abort(self, request_id: str) -> None:
        self.calls.append(("abort", request_id))

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> Any:
        self.calls.append((method,))
        return [getattr(self.worker, method)(*args)]  # one result per worker, as vLLM's

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        self.calls.append(("pause_generation", mode, clear_cache))
        self.paused = True

    async def resume_generation(self) -> None:
        self.calls.append(("resume_generation",))
        self.paused = False

    async def update_weight_version(self, new_version: str) -> None:
        self.calls.append(("update_weight_version", new_version))
        self.label = new_version

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.calls.append(("reset_prefix_cache", reset_running_requests))
        return True

    async def init_weight_transfer_engine(self, request: WeightTransferInitRequest) -> None:
        self.calls.append(("init_weight_transfer_engine", request.init_info))

    async def start_weight_update(self) -> None:
        self.calls.append(("start_weight_update",))

    async def update_weights(self, request: WeightTransferUpdateRequest) -> None:
        """vLLM's IPC engine: unpickle the handles (only where allowed), open each, load them in one call."""
        self.calls.append(("update_weights",))
        info = request.update_info
        if os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") != "1":
            raise ValueError(
                "Refusing to deserialize `ipc_handles_pickled` without VLLM_ALLOW_INSECURE_SERIALIZATION=1"
            )
        handles = pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))
        weights = []
        for name, dtype_name, shape, handle in zip(
            info["names"], info["dtype_names"], info["shapes"], handles, strict=True
        ):
            ((func, args),) = handle.values()  # vLLM calls func(*args) on its GPU; here the storage is looked up
            assert func.__name__ == "rebuild_cuda_tensor" and list(args[1]) == shape
            assert str(args[5]).removeprefix("torch.") == dtype_name
            storage = self.ipc_memory[args[7]]
            weights.append((name, storage.as_strided(args[1], args[2], args[3])))
        self.model.load_weights(weights)

    async def finish_weight_update(self) -> None:
        self.calls.append(("finish_weight_update",))

    def shutdown(self) -> None:
        self.calls.append(("shutdown",))


@contextmanager
def installed(state: dict[str, torch.Tensor]) -> Iterator[type[FakeEngine]]:
    """Put the stand-in at ``vllm`` (and the submodules the backend imports) for the duration."""
    FakeEngine.state = state
    FakeEngine.last = None
    FakeEngine.boot_seconds = 0.0
    FakeEngine.ipc_memory = {}
    root = types.ModuleType("vllm")
    root.AsyncEngineArgs = AsyncEngineArgs  # type: ignore[attr-defined]
    root.SamplingParams = SamplingParams  # type: ignore[attr-defined]
    root.TokensPrompt = TokensPrompt  # type: ignore[attr-defined]
    sampling = types.ModuleType("vllm.sampling_params")
    sampling.RequestOutputKind = RequestOutputKind  # type: ignore[attr-defined]
    inputs = types.ModuleType("vllm.inputs")
    inputs.tokens_input = tokens_input  # type: ignore[attr-defined]
    async_llm = types.ModuleType("vllm.v1.engine.async_llm")
    async_llm.AsyncLLM = FakeEngine  # type: ignore[attr-defined]
    config = types.ModuleType("vllm.config")
    config.WeightTransferConfig = WeightTransferConfig  # type: ignore[attr-defined]
    usage = types.ModuleType("vllm.usage.usage_lib")
    usage.UsageContext = UsageContext  # type: ignore[attr-defined]
    transfer = types.ModuleType("vllm.distributed.weight_transfer.base")
    transfer.WeightTransferInitRequest = WeightTransferInitRequest  # type: ignore[attr-defined]
    transfer.WeightTransferUpdateRequest = WeightTransferUpdateRequest  # type: ignore[attr-defined]
    modules = {
        "vllm": root,
        "vllm.sampling_params": sampling,
        "vllm.inputs": inputs,
        "vllm.v1": types.ModuleType("vllm.v1"),
        "vllm.v1.engine": types.ModuleType("vllm.v1.engine"),
        "vllm.v1.engine.async_llm": async_llm,
        "vllm.config": config,
        "vllm.usage": types.ModuleType("vllm.usage"),
        "vllm.usage.usage_lib": usage,
        "vllm.distributed": types.ModuleType("vllm.distributed"),
        "vllm.distributed.weight_transfer": types.ModuleType("vllm.distributed.weight_transfer"),
        "vllm.distributed.weight_transfer.base": transfer,
    }
    saved = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        yield FakeEngine
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module

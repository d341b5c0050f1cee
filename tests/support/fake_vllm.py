"""A CPU stand-in for the few vLLM APIs VLLMBackend calls, installed into ``sys.modules`` by a fixture.

vLLM cannot run here (it needs CUDA), so this stand-in lets the backend's own logic run for real: engine
argument validation, booting off the event loop, prompt construction, log-prob / version / preemption
extraction, error finishes, and the weight-update sequence with the real worker extension and a real model
state dict. The API shapes follow vLLM 0.33's source (``AsyncEngineArgs``, ``AsyncLLM``, ``RequestOutput``,
``CompletionOutput.weight_versions``, ``pause_generation(mode=..., clear_cache=...)``).
"""

from __future__ import annotations

import asyncio
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

from server.backends.vllm_backend import RewardMeshWorkerExtension


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


class RequestOutputKind(Enum):
    FINAL_ONLY = 2


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


class FakeWorker(RewardMeshWorkerExtension):
    def __init__(self, model: FakeModel) -> None:
        self.model_runner = SimpleNamespace(model=model)


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

    def __init__(self, args: AsyncEngineArgs) -> None:
        self.args = args
        self.calls: list[tuple[Any, ...]] = []
        self.prompts: list[Any] = []
        self.params: list[Any] = []
        self.respond: Respond = echo
        self.label: str | None = None
        self.paused = False
        self.model = FakeModel({k: v.clone() for k, v in self.state.items()})
        self.worker = FakeWorker(self.model)
        self.model_config = SimpleNamespace(
            max_model_len=args.max_model_len or 512,
            dtype=torch.float32,
            quantization=args.quantization,
            get_vocab_size=lambda: 512,
        )

    @classmethod
    def from_engine_args(cls, args: AsyncEngineArgs) -> FakeEngine:
        time.sleep(cls.boot_seconds)  # vLLM's boot blocks its thread for a long while
        cls.last = cls(args)
        return cls.last

    async def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        self.prompts.append(prompt)
        self.params.append(params)
        ids = list(prompt["prompt_token_ids"])
        spec = self.respond(ids, params, self)
        await asyncio.sleep(spec.get("seconds", 0.0))
        tokens = spec["token_ids"]
        logprobs = None
        if params.logprobs is not None:
            logprobs = [{t: SimpleNamespace(logprob=spec["logprob"] - i / 100)} for i, t in enumerate(tokens)]
        spans = spec.get("weight_versions")
        if spans is None and self.label is not None:
            spans = [SimpleNamespace(version=self.label, start=0, end=len(tokens))]
        completion = SimpleNamespace(
            token_ids=tokens,
            finish_reason=spec["finish_reason"],
            stop_reason=spec["stop_reason"],
            logprobs=logprobs,
            weight_versions=spans,
        )
        yield SimpleNamespace(outputs=[completion], metrics=SimpleNamespace(num_preemptions=spec["preemptions"]))

    async def abort(self, request_id: str) -> None:
        self.calls.append(("abort", request_id))

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> Any:
        self.calls.append((method,))
        return getattr(self.worker, method)(*args)

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

    def shutdown(self) -> None:
        self.calls.append(("shutdown",))


@contextmanager
def installed(state: dict[str, torch.Tensor]) -> Iterator[type[FakeEngine]]:
    """Put the stand-in at ``vllm`` (and the submodules the backend imports) for the duration."""
    FakeEngine.state = state
    FakeEngine.last = None
    FakeEngine.boot_seconds = 0.0
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
    modules = {
        "vllm": root,
        "vllm.sampling_params": sampling,
        "vllm.inputs": inputs,
        "vllm.v1": types.ModuleType("vllm.v1"),
        "vllm.v1.engine": types.ModuleType("vllm.v1.engine"),
        "vllm.v1.engine.async_llm": async_llm,
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

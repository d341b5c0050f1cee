"""The interface every generation backend implements (token ids in, token ids out, async), with defaults for
the weight capabilities an engine may not have."""

from __future__ import annotations

import abc
import asyncio
import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rewardmesh.common.planes.cuda_ipc import device_uuid
from rewardmesh.common.planes.manifest import Entry, WeightsError  # the one weight validator's error

__all__ = [
    "Backend",
    "GenerationFailed",
    "GenerationOutput",
    "GenerationRequest",
    "SampleDone",
    "WeightsError",
    "WeightsNotApplied",
]


@dataclass
class GenerationRequest:
    """One generation turn of one sample."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    stop_token_ids: list[int] = field(default_factory=list)  # beside the model's eos
    stop: list[str] = field(default_factory=list)  # stop strings; the matched text is not returned
    seed: int | None = None
    logprobs: bool = False  # return the log-prob of each sampled token (GenerationOutput.logprobs)
    ignore_eos: bool = False  # the model's eos tokens do not end the turn (stop_token_ids and stop strings do)
    min_tokens: int = 0  # eos and stop_token_ids cannot end the turn before this many tokens


@dataclass
class GenerationOutput:
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    num_preempted: int = -1  # -1: the backend cannot tell
    policy_version: int = 0  # the oldest weights version that generated any of these tokens
    # Per token, when the request asked: log-prob of the sampled token under the distribution the engine
    # sampled from (after temperature, top-k and top-p; greedy rows at temperature 1), as vLLM's
    # "processed_logprobs".
    logprobs: list[float] | None = None
    # Per token, where the engine knows it: the weights version that produced that token (None: unknown).
    token_versions: list[int] | None = None


# `on_sample(k, result)`: sample k of a group finished; an exception is that one sample's failure.
SampleDone = Callable[[int, "GenerationOutput | Exception"], None]


class GenerationFailed(RuntimeError):
    """The engine failed this one request (vLLM's finish_reason "error"): the sample's error, not a completion."""


class WeightsNotApplied(WeightsError):
    """A weight update refused before any tensor was loaded (a staged set that is incomplete or inconsistent): the
    old weights serve on, whole. Any other failure while loading may have applied part of the update."""


class Backend(abc.ABC):
    """A generation engine with many requests in flight.

    Cancelling the task awaiting `generate` aborts that request and frees its slot.
    `update_weights` validates everything first (WeightsError naming the tensor, nothing applied),
    then swaps weights atomically between generation steps and sets `policy_version`.

    The weight capabilities below have defaults for an engine that copies every update in through
    `update_weights`; an engine that can do better overrides them (hf adopts staged tensors, vLLM loads CUDA IPC
    handles with its own weight-transfer engine).
    """

    name: str  # "hf" | "vllm" | ...
    model: str  # path or name
    max_model_len: int
    tokenizer: Any  # a transformers tokenizer (chat template, decode, eos)
    policy_version: int

    # Where the weights live in this process: updates over torch.distributed are received onto it. None: not in
    # this process (an engine's own workers hold them), so that data plane is not offered.
    device: torch.device | None = None
    # Why the engine must not serve now (say, weights torn by a load that failed part-way); None while it may.
    unusable: str | None = None
    # True: CUDA IPC updates go to `update_weights_ipc` (the engine opens the handles); False: the receiver opens
    # them on `device` and hands the tensors to `update_weights`.
    loads_cuda_ipc: bool = False
    # True: `served_weights` returns the tensors the model serves, so an update may be a delta against them.
    takes_deltas: bool = False
    # Called (on the event loop) when the engine can generate no more, for good: the server reports NOT_SERVING.
    on_failure: Callable[[BaseException | None], None] | None = None

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def generate(self, request: GenerationRequest) -> GenerationOutput: ...

    async def generate_group(self, request: GenerationRequest, n: int, on_sample: SampleDone) -> None:
        """`n` samples of one prompt, each reported by `on_sample(k, output)` the moment it finishes (an exception:
        sample k failed, the others go on). Sample k is drawn with seed `request.seed + k` (unseeded when the seed is
        None), the seeds vLLM gives the samples of one request with n > 1, so it equals `generate` with that seed.
        Returns once every sample is reported; cancelling it aborts those still generating.

        By default, n `generate` calls; an engine that prepares a prompt once for many samples overrides it.
        """

        async def one(k: int) -> None:
            sample = request
            if request.seed is not None and k:
                sample = copy.copy(request)  # a shallow copy: the lists are shared, never changed
                sample.seed = request.seed + k
            try:
                out = await self.generate(sample)
            except Exception as exc:  # that sample's failure: its siblings go on
                on_sample(k, exc)
            else:
                on_sample(k, out)

        await asyncio.gather(*(one(k) for k in range(n)))

    @abc.abstractmethod
    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]: ...

    @abc.abstractmethod
    async def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None: ...

    @property
    @abc.abstractmethod
    def running(self) -> int: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    def check_engine_args(self) -> None:
        """Raise ValueError naming every option the engine does not know, before it boots; by default none."""
        return None

    @property
    def cuda_device_uuid(self) -> str:
        """The GPU whose memory a trainer may share by CUDA IPC handles ("" if none): by default `device`'s."""
        device = self.device
        return device_uuid(device) if device is not None and device.type == "cuda" else ""

    def served_weights(self) -> dict[str, torch.Tensor]:
        """The tensors the model serves now, by name, read-only (where `takes_deltas`); by default none."""
        return {}

    def adoptable(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Whether `adopt_weights` would take these tensors themselves rather than copy them; by default never."""
        return False

    async def adopt_weights(self, tensors: dict[str, torch.Tensor], version: int) -> bool:
        """Like `update_weights`, but the engine may keep the tensors themselves (the caller hands them over and
        never writes them again); True when it did. By default they are copied in (False)."""
        await self.update_weights(tensors, version)
        return False

    async def update_weights_ipc(self, entries: list[Entry], source: Any, version: int) -> None:
        """Load a colocated trainer's tensors from CUDA IPC handles (`source`, checked against the manifest
        `entries`) as `version`; called only where `loads_cuda_ipc` is True."""
        raise NotImplementedError(f"the {self.name} backend does not load CUDA IPC handles itself")

"""What every trainer adapter shares: Samples from a framework's fields, and a RewardClient per event loop.

grpc.aio channels belong to the event loop that created them. A verl reward-loop worker, TRL's reward
thread and slime's rollout loop each run their own loop, created after the adapter was constructed, so
the client is made lazily inside the running loop, one per loop.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from rewardmesh.client.reward_client import RewardClient
from rewardmesh.common.status_codes import code_name
from rewardmesh.common.tensors import ids_tensor
from rewardmesh.v1 import common_pb2, reward_pb2

log = logging.getLogger(__name__)

DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
# Where the adapters whose framework has no config slot for them read the target and pipeline, the per-sample
# deadline, and the opt-in score of a failed sample (unset: a failed sample fails the step).
TARGET_ENV, PIPELINE_ENV = "REWARDMESH_REWARD_TARGET", "REWARDMESH_PIPELINE"
TIMEOUT_ENV, DEFAULT_TIMEOUT_S = "REWARDMESH_TIMEOUT_S", 300.0
ERROR_SCORE_ENV = "REWARDMESH_ERROR_SCORE"
ERROR_KEY = "rewardmesh_error"  # 1.0 on a sample scored the error score after an error, else 0.0


class RewardMeshError(RuntimeError):
    """A sample the reward service could not score: the gRPC code and message, never a silent 0."""


# Errors of the service, not of a sample (no server reachable, the caller's credentials, a pipeline that does not
# exist): they raise even where failed samples are scored `error_score` or masked, since every sample would fail.
SERVICE_ERRORS = frozenset(
    c.value[0]
    for c in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.UNIMPLEMENTED,
    )
)


def _env_number(name: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number") from None


def env_timeout_s() -> float:
    """The per-sample deadline from REWARDMESH_TIMEOUT_S (seconds; 300 when unset; set, it must be a number)."""
    value = os.environ.get(TIMEOUT_ENV)
    return DEFAULT_TIMEOUT_S if value is None else _env_number(TIMEOUT_ENV, value)


def env_error_score() -> float | None:
    """The score for a failed sample from REWARDMESH_ERROR_SCORE; None (failures fail the step) when unset or empty."""
    value = os.environ.get(ERROR_SCORE_ENV)
    return _env_number(ERROR_SCORE_ENV, value) if value else None


def failure(pipeline: str, what: str, result: reward_pb2.RewardResult, hint: str = "") -> RewardMeshError:
    """The error naming the sample (`what`: the framework's own handle on it) and the cause."""
    tail = f" ({hint})" if hint and result.error.code not in SERVICE_ERRORS else ""
    return RewardMeshError(f"rewardmesh pipeline '{pipeline}' could not score {what}: {error_text(result)}{tail}")


def describe(index: Any, prompt: Any) -> str:
    """ "sample 3 (prompt 'What is 2 + ...')": how an error names a sample to a person (index: the framework's)."""
    text = " ".join(str(prompt or "").split())
    name = "a sample" if index is None else f"sample {index}"
    return f"{name} (prompt {(text[:60] + '...') if len(text) > 60 else text!r})"


def _jsonable(value: Any) -> Any:
    """numpy scalars and arrays, tuples and other objects made JSON-safe for google.protobuf.Struct."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def make_sample(
    sample_id: str,
    *,
    prompt_text: str = "",
    response_text: str = "",
    prompt_ids: Sequence[int] | None = None,
    response_ids: Sequence[int] | None = None,
    response_mask: Sequence[int] | None = None,
    ground_truth: Any = "",
    data_source: str = "",
    extra_info: dict[str, Any] | None = None,
) -> common_pb2.Sample:
    """A Sample with ids (reward models need them) and text (rules and judges read it), whichever are known."""
    sample = common_pb2.Sample(
        sample_id=sample_id,
        prompt_text=prompt_text,
        response_text=response_text,
        data_source=data_source or "",
        ground_truth="" if ground_truth is None else str(ground_truth),
    )
    if prompt_ids is not None and len(prompt_ids):
        sample.prompt_ids.CopyFrom(ids_tensor(prompt_ids))
    if response_ids is not None and len(response_ids):
        sample.response_ids.CopyFrom(ids_tensor(response_ids))
        if response_mask is not None:
            sample.response_mask.CopyFrom(ids_tensor(response_mask))
    if extra_info:
        sample.extra_info.update(json.loads(json.dumps(extra_info, default=_jsonable)))
    return sample


@dataclass
class MeshScorer:
    """Scores Samples on one pipeline; every wait is bounded, and a result always comes back (errors inside)."""

    target: str | Sequence[str]
    pipeline: str
    timeout_s: float = 300.0
    max_attempts: int = 5
    _clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, RewardClient] = field(
        default_factory=weakref.WeakKeyDictionary, init=False, repr=False
    )
    _prefix: str = field(default_factory=lambda: uuid.uuid4().hex[:12], init=False, repr=False)
    _ids: itertools.count[int] = field(default_factory=itertools.count, init=False, repr=False)
    _extra_keys: tuple[str, ...] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.target:
            raise ValueError("rewardmesh: set the reward server target (HOST:PORT, a list, or dns:///NAME:PORT)")
        if not self.pipeline:
            raise ValueError("rewardmesh: set the reward pipeline name")

    def next_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    def client(self) -> RewardClient:
        """This loop's client, made here on first use (never on another loop)."""
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            client = RewardClient(self.target, max_attempts=self.max_attempts)
            self._clients[loop] = client
        return client

    async def score(self, samples: Sequence[common_pb2.Sample]) -> list[reward_pb2.RewardResult]:
        """Results in input order. The server bounds each sample by `timeout_s`; a silent server is bounded here."""
        client = self.client()
        futures = [client.submit(s, self.pipeline, timeout=self.timeout_s) for s in samples]
        done, _ = await asyncio.wait(futures, timeout=self.timeout_s + 10.0) if futures else (set(), set())
        results = []
        for sample, fut in zip(samples, futures, strict=True):
            if fut in done:
                results.append(fut.result())
            else:
                fut.cancel()
                message = f"no result for sample '{sample.sample_id}' within {self.timeout_s + 10.0:.0f}s"
                results.append(
                    reward_pb2.RewardResult(
                        sample_id=sample.sample_id,
                        reward=self.pipeline,
                        error=common_pb2.Status(code=DEADLINE_EXCEEDED, message=message),
                    )
                )
        return results

    async def extra_keys(self) -> tuple[str, ...]:
        """The pipeline's extras as the server announces them (ListRewards), asked once per scorer.

        Every worker of a framework gets the same answer, so columns built from them agree without configuration.
        """
        if self._extra_keys is None:
            try:
                reply = await asyncio.wait_for(self.client().list_rewards(), self.timeout_s)
            except grpc.RpcError as exc:
                raise RewardMeshError(f"rewardmesh: ListRewards failed: {exc.code().name}: {exc.details()}") from None
            known = {p.name: tuple(p.extra_keys) for p in reply.pipelines}
            self._extra_keys = known.get(self.pipeline, ())
        return self._extra_keys

    async def close(self) -> None:
        """Close the client of the running loop (others close with their loops)."""
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.close()


def error_text(result: reward_pb2.RewardResult) -> str:
    """'CODE: message' of a failed result."""
    return f"{code_name(result.error.code)}: {result.error.message}"


def label_fields(label: Any, where: str = "label") -> tuple[str, str, dict[str, Any]]:
    """(ground_truth, data_source, extra_info) from a label: a plain string, or a JSON object carrying them (as
    OpenRLHF's and slime's datasets hold them). Bad input is a ValueError naming `where`."""
    if label is None:
        return "", "", {}
    if isinstance(label, str):
        stripped = label.strip()
        if not stripped.startswith("{"):
            return label, "", {}
        try:
            label = json.loads(stripped)
        except json.JSONDecodeError:
            return label, "", {}
        except RecursionError:
            raise ValueError(f"{where}: JSON nested too deeply") from None
    if isinstance(label, dict):
        extra = label.get("extra_info") or {}
        if not isinstance(extra, dict):
            raise ValueError(f"{where}.extra_info must be an object, got {type(extra).__name__}")
        truth = label.get("ground_truth", label.get("label", ""))
        return str(truth if truth is not None else ""), str(label.get("data_source") or ""), extra
    if isinstance(label, int | float):
        return str(label), "", {}
    raise ValueError(f"{where} must be a string or an object, got {type(label).__name__}")


def extra_info_from(value: Any) -> dict[str, Any]:
    """A framework's extra_info column as a dict (None, a dict, or a JSON string)."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            return {"value": value}
        return parsed if isinstance(parsed, dict) else {"value": parsed}
    return {"value": value}

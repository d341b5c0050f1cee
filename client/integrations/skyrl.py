"""SkyRL (skyrl-gym 0.4.0): `RewardMeshTextEnv`, a single-turn BaseTextEnv whose step() scores on a rewardmesh pipeline.

skyrl_gym.make finds environments only in its registry of the process it runs in (it cannot import `module:name`),
so register the env where the generator runs, in the entrypoint that builds the experiment:

    from rewardmesh.client.integrations import skyrl as mesh_skyrl

    @ray.remote(num_cpus=1)
    def skyrl_entrypoint(cfg):
        mesh_skyrl.register()  # id "rewardmesh"
        BasePPOExp(cfg).run()

and configure it (`environment.env_class=rewardmesh`, or `env_class` per dataset row):

    environment:
      skyrl_gym:
        rewardmesh: {target: "reward:50051", pipeline: gsm8k}   # timeout_s: 300, error_score: unset

Each row's `reward_spec.ground_truth` is the sample's ground truth; `data_source` and `extra_info` go with it when
present (target and pipeline may also come from REWARDMESH_REWARD_TARGET / REWARDMESH_PIPELINE). The pipeline's
extras are in the step's `metadata` and in `get_metrics()`.

SkyRL calls step() synchronously, from its environment thread pool (or its event loop's thread). Every env of the
process scores on one event loop of this module, in a thread of its own, so one reward client per process serves
every thread. A sample the service cannot score raises RewardMeshError naming the sample and the cause, which fails
SkyRL's `generate()` call: the default. Opt-in: `error_score` scores it that value, flagged by `rewardmesh_error` in
the metadata and metrics. A server that is down, refuses the token or lacks the pipeline raises either way.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from rewardmesh.client.integrations.scoring import (
    ERROR_KEY,
    PIPELINE_ENV,
    SERVICE_ERRORS,
    TARGET_ENV,
    MeshScorer,
    describe,
    error_text,
    extra_info_from,
    failure,
    make_sample,
)

try:  # skyrl-gym is optional: this module imports without it
    import skyrl_gym
    from skyrl_gym.envs.base_text_env import BaseTextEnv
except ImportError:  # pragma: no cover - exercised where skyrl-gym is absent
    skyrl_gym = None
    BaseTextEnv = object

log = logging.getLogger(__name__)
ENV_ID = "rewardmesh"
T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_scorers: dict[tuple[tuple[str, ...], str, float], MeshScorer] = {}


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """Run on the process's scoring loop (started on first use) and wait: callable from any thread but that loop's."""
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="rewardmesh-skyrl", daemon=True).start()
        loop = _loop
    return asyncio.run_coroutine_threadsafe(coro, loop).result()


def _scorer(target: str | list[str], pipeline: str, timeout_s: float) -> MeshScorer:
    """One scorer per (target, pipeline, timeout) in the process, shared by every env SkyRL makes."""
    key = ((target,) if isinstance(target, str) else tuple(target), pipeline, timeout_s)
    with _lock:
        if key not in _scorers:
            _scorers[key] = MeshScorer(target, pipeline, timeout_s=timeout_s)
        return _scorers[key]


def _option(config: Any, key: str, default: Any) -> Any:
    value = config.get(key) if config is not None else None
    return default if value is None else value


def _prompt_text(prompt: Any) -> str:
    """The last user message of a chat prompt (what rules and judges read)."""
    if isinstance(prompt, list):
        users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        return str(users[-1].get("content", "")) if users else ""
    return str(prompt or "")


class RewardMeshTextEnv(BaseTextEnv):
    """One step: the model's reply scored on a rewardmesh pipeline, then done."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        extras = extras or {}
        spec = extras.get("reward_spec") or {}
        if not isinstance(spec, dict) or "ground_truth" not in spec:
            raise ValueError("rewardmesh env: each row needs reward_spec.ground_truth (the sample's ground truth)")
        target = _option(env_config, "target", os.environ.get(TARGET_ENV, ""))
        pipeline = str(_option(env_config, "pipeline", os.environ.get(PIPELINE_ENV, "")))
        self.scorer = _scorer(
            target if isinstance(target, str) else [str(t) for t in target],  # a list (omegaconf's too)
            pipeline,
            float(_option(env_config, "timeout_s", 300.0)),
        )
        error_score = _option(env_config, "error_score", None)
        self.error_score: float | None = None if error_score is None else float(error_score)
        self.ground_truth = spec["ground_truth"]
        self.data_source = str(extras.get("data_source") or "")
        self.extra_info = extra_info_from(extras.get("extra_info"))
        self.prompt_text = ""
        self.metrics: dict[str, float] = {}

    def init(self, prompt: Any) -> tuple[Any, dict[str, Any]]:
        self.prompt_text = _prompt_text(prompt)
        return prompt, {}

    def step(self, action: str) -> Any:
        """Score the reply (blocking this thread, not SkyRL's loop: the scoring runs on this module's loop)."""
        self.turns += 1
        sample = make_sample(
            self.scorer.next_id(),
            prompt_text=self.prompt_text,
            response_text=action,
            ground_truth=self.ground_truth,
            data_source=self.data_source,
            extra_info=self.extra_info,
        )
        (result,) = _run(self.scorer.score([sample]))
        if result.HasField("error"):
            what = describe(self.extra_info.get("index"), self.prompt_text)
            if self.error_score is None or result.error.code in SERVICE_ERRORS:
                hint = f"set environment.skyrl_gym.{ENV_ID}.error_score to score failed samples instead"
                raise failure(self.scorer.pipeline, what, result, hint)
            log.warning("rewardmesh: %s scored %s after an error: %s", what, self.error_score, error_text(result))
            reward, self.metrics = self.error_score, {ERROR_KEY: 1.0}
        else:
            reward, self.metrics = result.score, {**result.extras, ERROR_KEY: 0.0}
        return {"observations": [], "reward": reward, "done": True, "metadata": dict(self.metrics)}

    def get_metrics(self) -> dict[str, Any]:
        return dict(self.metrics)


def register(env_id: str = ENV_ID) -> None:
    """Register RewardMeshTextEnv in skyrl_gym's registry under `env_id`, in this process (once; again is a no-op)."""
    if skyrl_gym is None:
        raise ImportError("rewardmesh's SkyRL env needs skyrl-gym (pip install skyrl-gym==0.4.0)")
    from skyrl_gym.envs.registration import registry

    if env_id not in registry:
        skyrl_gym.register(id=env_id, entry_point=RewardMeshTextEnv)

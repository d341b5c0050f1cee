"""AReaL 1.0.4: `RewardMeshRLVRWorkflow`, AReaL's RLVRWorkflow whose reward step awaits a rewardmesh pipeline.

    from rewardmesh.client.integrations.areal import RewardMeshRLVRWorkflow

    workflow = RewardMeshRLVRWorkflow(
        gconfig=config.gconfig, tokenizer=tokenizer, target="reward:50051", pipeline="gsm8k"
    )
    rollout.prepare_batch(dataloader, workflow=workflow)
    # or workflow="rewardmesh.client.integrations.areal.RewardMeshRLVRWorkflow", workflow_kwargs={...}

Generation, tokenization and the trajectory are RLVRWorkflow's own; only the reward differs. AReaL's
`reward_fn` path runs a sync function in a process pool through AsyncRewardWrapper, which after 15 s (three
retries) returns 0 without an error: a slow reward fleet trains on zeros. This workflow never uses it: the
reward is awaited on AReaL's own event loop (its rollout thread's uvloop), one reward client per loop (closed
before AReaL closes the loop), bounded by `timeout_s` per sample (default 300), and a slow fleet only makes the
episode slower.

Dataset columns feed the sample: `ground_truth_key` (default: the first of ground_truth, answer, solution, label
present), `data_source` and `extra_info`. The pipeline's extras go to AReaL's stats tracker as `rewardmesh/<key>`.

A sample the service cannot score raises RewardMeshError from `arun_episode`, naming the sample and the cause.
AReaL's workflow executor catches an episode's exception, logs it at ERROR ("Workflow execution failed") and
counts the episode rejected; training would go on without the sample, or, with every sample failing (a fleet that
is down), wait for a batch that never comes. So the workflow also hands the error to AReaL's rollout dispatcher as
a failure of its threads (AReaL's own fail-fast path), and the trainer's next `prepare_batch`/`wait`/`submit`
raises it: RuntimeError "Background thread failed: <this error>". Opt-in: `mask_errors=True` returns None for a
failed sample, AReaL's own way of rejecting a trajectory, with a warning naming it. A server that is down, refuses
the token or lacks the pipeline stops the rollouts either way.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Sequence
from typing import Any

from rewardmesh.client.integrations.scoring import (
    SERVICE_ERRORS,
    MeshScorer,
    RewardMeshError,
    describe,
    error_text,
    extra_info_from,
    failure,
    make_sample,
)

try:  # AReaL is optional: this module imports without it
    from areal import workflow_context
    from areal.infra.utils.concurrent import register_loop_cleanup
    from areal.utils import stats_tracker
    from areal.utils.perf_tracer import trace_session
    from areal.workflow.rlvr import RLVRWorkflow
except ImportError:  # pragma: no cover - exercised where AReaL is absent
    RLVRWorkflow = object
    workflow_context = stats_tracker = register_loop_cleanup = None

    def trace_session(phase: str) -> Any:
        return lambda fn: fn


log = logging.getLogger(__name__)
GROUND_TRUTH_KEYS = ("ground_truth", "answer", "solution", "label")


class _Masked(Exception):
    """An episode whose reward failed and is masked (mask_errors): arun_episode returns None for it."""


def _stop_rollouts(engine: Any, exc: Exception) -> None:
    """Hand `exc` to AReaL's rollout dispatcher as a failure of its own threads (the fail-fast path AReaL uses for
    them), so the trainer's next wait or submit raises it: AReaL only logs an episode's own exception and counts the
    episode rejected, so a failed sample would be dropped, and with every sample failing (a fleet that is down),
    training would wait for a batch that never comes. An engine without AReaL's executor is left alone."""
    try:
        dispatcher = engine.workflow_executor.dispatcher
    except (AttributeError, RuntimeError):  # no executor, or not initialized
        return
    setter = getattr(dispatcher, "_set_thread_exception", None)
    if callable(setter):
        setter(exc)


def _prompt_text(data: dict[str, Any], fallback: str) -> str:
    """The last user message of a chat prompt (what rules and judges read), else the decoded prompt."""
    messages = data.get("messages")
    if isinstance(messages, list):
        users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
        if users:
            return str(users[-1].get("content", ""))
    prompt = data.get("prompt")
    return prompt if isinstance(prompt, str) else fallback


class RewardMeshRLVRWorkflow(RLVRWorkflow):
    """AReaL's single-turn RLVR workflow, rewarded by a rewardmesh pipeline (ids and text)."""

    def __init__(
        self,
        gconfig: Any,
        tokenizer: Any,
        *,
        target: str | Sequence[str],
        pipeline: str,
        timeout_s: float = 300.0,
        mask_errors: bool = False,
        ground_truth_key: str | None = None,
        **workflow: Any,
    ) -> None:
        # A dotted path keeps RLVRWorkflow from starting AsyncRewardWrapper's process pool; it is never imported.
        super().__init__(
            reward_fn=f"{__name__}:RewardMeshRLVRWorkflow", gconfig=gconfig, tokenizer=tokenizer, **workflow
        )
        self.scorer = MeshScorer(target, pipeline, timeout_s=timeout_s)
        self.reward_fn = self.scorer  # not a string: arun_episode never imports a reward function
        self.mask_errors = mask_errors
        self.ground_truth_key = ground_truth_key
        self._loops: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()

    def _truth(self, data: dict[str, Any]) -> Any:
        for key in (self.ground_truth_key,) if self.ground_truth_key else GROUND_TRUTH_KEYS:
            if data.get(key) is not None:
                return data[key]
        return ""

    @trace_session("reward")
    async def _compute_rewards(self, resp: Any, prompt_str: str, task_data: dict[str, Any]) -> float:
        """The rewardmesh score of one response, awaited on this loop (no process pool, no timeout to 0)."""
        prompt_text = _prompt_text(task_data, prompt_str)
        extra = extra_info_from(task_data.get("extra_info"))
        sample = make_sample(
            self.scorer.next_id(),
            prompt_text=prompt_text,
            response_text=self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True),
            prompt_ids=list(resp.input_tokens),
            response_ids=list(resp.output_tokens),
            ground_truth=self._truth(task_data),
            data_source=str(task_data.get("data_source") or ""),
            extra_info=extra,
        )
        loop = asyncio.get_running_loop()
        if register_loop_cleanup is not None and loop not in self._loops:
            # this loop's reward client closes before the loop does (AReaL's rollout loop ends on destroy):
            # grpc.aio work left on a closed loop would break the calls of the next one
            self._loops.add(loop)
            register_loop_cleanup(self.scorer.close, loop=loop)
        (result,) = await self.scorer.score([sample])
        if result.HasField("error"):
            what = describe(extra.get("index", task_data.get("query_id")), prompt_text)
            if not self.mask_errors or result.error.code in SERVICE_ERRORS:
                raise failure(self.scorer.pipeline, what, result, "pass mask_errors=True to reject it instead")
            log.warning("rewardmesh: %s rejected (mask_errors): %s", what, error_text(result))
            raise _Masked(what)
        if result.extras and stats_tracker is not None:
            stats_tracker.get(workflow_context.stat_scope()).scalar(
                **{f"rewardmesh/{k}": float(v) for k, v in result.extras.items()}
            )
        return float(result.score)

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, Any] | None:
        """RLVRWorkflow's episode; None (AReaL rejects it) for a masked failure; other failures stop the rollouts."""
        try:
            return await super().arun_episode(engine, data)
        except _Masked:
            return None
        except RewardMeshError as exc:
            _stop_rollouts(engine, exc)
            raise

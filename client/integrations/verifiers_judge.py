"""verifiers 0.4.0 (the `verifiers.v1` API): a judge plugin scoring a task's trace on a rewardmesh pipeline.

In a task config (TOML, or `--env.taskset.task.judges`):

    [[env.taskset.task.judges]]
    id = "rewardmesh_judge"
    target = "reward:50051"
    pipeline = "gsm8k"
    # name = "correct"       the reward's key (default: "rewardmesh_judge"), weight = 1.0
    # answer_field = "answer" the task field sent as the ground truth
    # view = "last_reply"     or "full_trace": what is sent as the response
    # timeout_s = 300

verifiers resolves a judge id by importing a top-level module of that name and taking the one Judge subclass
it exports (a dotted id fails), hence the `rewardmesh_judge` package, which exports this judge. `Task.score`
runs it after the task's own `@vf.reward`s on verifiers' event loop, with one reward client per loop; the
target and pipeline may also come from REWARDMESH_REWARD_TARGET / REWARDMESH_PIPELINE.

The score is the reward (times the judge's weight). The pipeline's extras go to `trace.metrics` as
`<name>/<extra>` through `trace.record_metrics`: a reward returning a dict would count every key into the total.

A sample the service cannot score raises RewardMeshError naming the task and the cause; `Task.score` turns it
into a TaskError, and verifiers records it on the trace with the rewards left None: the rollout is an error,
never a zero. That is also verifiers' own way of leaving a sample out, so there is no mask option.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Literal

from rewardmesh.client.integrations.scoring import (
    PIPELINE_ENV,
    TARGET_ENV,
    MeshScorer,
    describe,
    failure,
    make_sample,
)

try:  # verifiers is optional: this module imports without it (the judge is defined where it is installed)
    from verifiers.v1.configs.judge import JudgeConfig
    from verifiers.v1.judge import Judge, judge_response
    from verifiers.v1.task import TaskData
except ImportError:  # pragma: no cover - exercised where verifiers is absent
    JudgeConfig = Judge = judge_response = TaskData = None

log = logging.getLogger(__name__)
PLUGIN_ID = "rewardmesh_judge"
_scorers: dict[tuple[tuple[str, ...], str, float], MeshScorer] = {}


def _scorer(config: Any) -> MeshScorer:
    """One scorer per (target, pipeline, timeout) in the process: verifiers builds the judge anew on every score."""
    target = config.target or os.environ.get(TARGET_ENV, "")
    targets = (target,) if isinstance(target, str) else tuple(target)
    pipeline = config.pipeline or os.environ.get(PIPELINE_ENV, "")
    key = (targets, pipeline, float(config.timeout_s))
    if key not in _scorers:
        _scorers[key] = MeshScorer(target, pipeline, timeout_s=float(config.timeout_s))
    return _scorers[key]


async def close() -> None:
    """Close the running loop's reward clients, before a loop that scored ends (asyncio.run per call)."""
    for scorer in _scorers.values():
        await scorer.close()


if Judge is not None:
    # TaskData's own fields; the task's others (its answer, metadata) go to the sample's extra_info.
    _BASE_FIELDS = frozenset(TaskData.model_fields) - {"idx", "id", "name"}

    class RewardMeshJudgeConfig(JudgeConfig):
        """Where and how to score: the reward server, the pipeline and what the sample carries."""

        id: str = PLUGIN_ID
        target: str | list[str] = ""
        """Reward server HOST:PORT, a list of them, or dns:///NAME:PORT (default: REWARDMESH_REWARD_TARGET)."""
        pipeline: str = ""
        """The pipeline that scores (default: REWARDMESH_PIPELINE)."""
        timeout_s: float = 300.0
        """Per-sample deadline on the server; the client waits 10 s longer at most."""
        answer_field: str = "answer"
        """The task field sent as the sample's ground truth (empty if the task has none)."""
        view: Literal["last_reply", "full_trace"] = "last_reply"
        """What is sent as the response: the final reply, or the transcript of the last branch."""

    class RewardMeshJudge(Judge[float, RewardMeshJudgeConfig]):
        """Scores a trace on a rewardmesh pipeline: the task's prompt, the reply and the task's answer field."""

        async def score(self, task: TaskData, trace: Any) -> float:
            scorer = _scorer(self.config)
            prompt = task.prompt_text
            truth = getattr(task, self.config.answer_field, None) if self.config.answer_field else None
            sample = make_sample(
                scorer.next_id(),
                prompt_text=prompt,
                response_text=judge_response(trace, self.config.view),
                ground_truth="" if truth is None else truth,
                data_source=str(getattr(task, "data_source", "") or ""),
                extra_info=task.model_dump(mode="json", exclude_none=True, exclude=set(_BASE_FIELDS)),
            )
            (result,) = await scorer.score([sample])
            if result.HasField("error"):
                index = task.id if task.id is not None else task.idx
                raise failure(scorer.pipeline, describe(index, prompt), result)
            if result.extras:
                trace.record_metrics({f"{self.reward_name}/{k}": float(v) for k, v in result.extras.items()})
            return float(result.score)

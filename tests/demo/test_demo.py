"""The demo's tasks, flags and summary line (fast: no mesh; the end-to-end run is in test_trainer.py)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from rewardmesh.demo.rl_demo import TASKS, summary
from rewardmesh.reward_engine.sources.rules import RULES
from rewardmesh.server.cli import build_parser


@pytest.mark.parametrize("task", sorted(TASKS))
def test_every_task_answer_is_one_policy_token_the_rule_scores(tok: Any, task: str) -> None:
    """The demo samples one token (max_tokens=1): an answer needing two could never score."""
    prompts = TASKS[task](tok, 200, random.Random(0))
    assert len(prompts) == 200 and {p.data_source for p in prompts} == {task}
    for p in prompts:
        answer = tok.encode(p.ground_truth)
        assert len(answer) == 1, f"{p.ground_truth!r} is {len(answer)} tokens"
        for rule in ("first_number", "near_number"):
            out = RULES[rule](task, tok.decode(answer), p.ground_truth, None)
            assert isinstance(out, dict) and out["acc"] == 1.0 and out["score"] == 1.0


def test_count_prompts_continue_the_count(tok: Any) -> None:
    for p in TASKS["count"](tok, 50, random.Random(1)):
        numbers = [int(x) for x in tok.decode(p.token_ids).split()]
        assert len(numbers) == 3 and numbers[1] == numbers[0] + 1 and numbers[2] == numbers[1] + 1
        assert int(p.ground_truth) == numbers[2] + 1


def test_demo_defaults_are_the_tuned_recipe() -> None:
    """docs/benchmarks.md's curve is measured with these; a change here must re-measure it (bench.demo_learning)."""
    args = build_parser().parse_args(["demo"])
    assert (args.task, args.n, args.steps, args.lr, args.min_lr_ratio) == ("count", 16, 150, 5e-3, 0.2)
    assert (args.entropy_coeff, args.norm_adv_by_std) == (0.02, False)
    assert args.off_policy_steps == 1 and args.rollout_servers == 0 and args.backend == "hf"  # 0: 2 hf servers
    args = build_parser().parse_args(["demo", "--task", "addition", "--norm-adv-by-std", "--reward", "near_number"])
    assert (args.task, args.norm_adv_by_std, args.reward) == ("addition", True, "near_number")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--task", "multiplication"])


def test_summary_reports_time_rate_score_and_accuracy_of_first_and_last_ten() -> None:
    history = [{"score": i / 20, "acc": 0.0 if i < 10 else 1.0} for i in range(20)]
    line = summary(history, 10.0)
    assert line.startswith("20 steps in 10.0s (2.00 steps/s)")
    assert "mean score first 10 steps 0.225 -> last 10 steps 0.725" in line
    assert "accuracy first 10 steps 0.000 -> last 10 steps 1.000" in line
    assert summary(history[:3], 1.0).endswith("accuracy first 1 steps 0.000 -> last 1 steps 0.000")
    assert summary([], 0.5) == "0 steps in 0.5s"

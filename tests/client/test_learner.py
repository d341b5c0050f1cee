"""The reference learner: PPO clipped loss by hand, ratio 1 on-policy, rollout log-probs in verl's layout,
failed samples kept out of the loss and the group statistics (real servers, a checker failing some samples)."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest
import torch

from rewardmesh.client.batch import ScoredSample, assemble_batch, compute_metrics, grpo_advantages, set_group_advantages
from rewardmesh.client.grpo import GRPOLearner, PolicyLossConfig, aggregate, policy_loss
from rewardmesh.client.trainer import PromptSpec, Sampling, TrainerClient
from rewardmesh.demo.tiny_models import TinyModelPaths
from rewardmesh.server.reward.server import load_tokenizer
from tests.support.scripted_backend import ScriptedBackend
from tests.support.servers import FNS, reward_server, rollout_server


def scored(sid: str, group: str, response: list[int], score: float, *, logprobs: list[float] | None = None,
           error: str = "", code: int = 0) -> ScoredSample:  # fmt: skip
    timing = dict.fromkeys(("generate_sequences", "tool_calls", "reward", "reward_queue", "reward_compute"), 0.0)
    timing.update(num_preempted=0.0, num_turns=1.0, prompt_length=2.0, response_length=float(len(response)))
    return ScoredSample(sid, group, np.array([5, 6], np.int32), np.array(response, np.int32),
                        np.ones(len(response), np.int32), score, {"acc": score}, timing, 0, error=error,
                        error_code=code,
                        response_logprobs=None if logprobs is None else np.array(logprobs, np.float32))  # fmt: skip


# ------------------------------------------------------------------------------------------ loss by hand


def hand_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Four tokens, old log-prob 0, ratios 1.5 / 0.5 / 1.1 / 5.0, advantages +1 / +1 / -1 / -1."""
    log_prob = torch.log(torch.tensor([[1.5, 0.5, 1.1, 5.0]])).requires_grad_()
    return log_prob, torch.zeros(1, 4), torch.tensor([[1.0, 1.0, -1.0, -1.0]])


def test_clipped_loss_dual_clip_and_metrics_by_hand() -> None:
    log_prob, old, adv = hand_case()
    loss, m = policy_loss(log_prob, old, adv, torch.ones(1, 4), PolicyLossConfig(clip_ratio=0.2, clip_ratio_c=3.0))
    # token 0: max(-1.5, -1.2) = -1.2 (clipped); token 1: max(-0.5, -0.8) = -0.5; token 2: 1.1;
    # token 3: max(5, 1.2) = 5, bounded by the dual clip at 3.
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.1 + 3.0) / 4)
    assert m["actor/pg_loss"] == pytest.approx(0.6)
    assert m["actor/pg_clipfrac"] == pytest.approx(0.25) and m["actor/pg_clipfrac_lower"] == pytest.approx(0.25)
    assert m["actor/ppo_kl"] == pytest.approx(-sum(math.log(r) for r in (1.5, 0.5, 1.1, 5.0)) / 4, rel=1e-5)
    loss.backward()
    assert log_prob.grad is not None  # clipped tokens get no gradient; d(-A r)/d log r = -A r for the others
    assert log_prob.grad.tolist()[0] == pytest.approx([0.0, -0.5 / 4, 1.1 / 4, 0.0])


def test_asymmetric_clip_and_the_mask() -> None:
    log_prob, old, adv = hand_case()
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the 5x token is padding: it must not count
    loss, m = policy_loss(log_prob, old, adv, mask, PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28))
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 1.1) / 3)
    assert m["actor/pg_clipfrac"] == pytest.approx(1 / 3) and m["actor/pg_clipfrac_lower"] == 0.0


def test_ratio_is_one_when_behaviour_equals_current() -> None:
    log_prob = torch.log(torch.tensor([[0.2, 0.7, 0.1], [0.9, 0.5, 0.3]])).requires_grad_()
    adv = torch.tensor([[2.0, 2.0, 2.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    loss, m = policy_loss(log_prob, log_prob.detach(), adv, mask, PolicyLossConfig())
    assert m["actor/ppo_kl"] == 0.0 and m["actor/pg_clipfrac"] == 0.0 and m["actor/pg_clipfrac_lower"] == 0.0
    assert loss.item() == pytest.approx(-(2 + 2 - 1 - 1 - 1) / 5)  # -mean advantage: every ratio is 1
    loss.backward()
    assert log_prob.grad is not None  # the plain policy gradient: -A / tokens on every policy token
    assert torch.allclose(log_prob.grad, -adv * mask / 5)


def test_truncated_importance_sampling_weights_each_token() -> None:
    log_prob = torch.zeros(1, 3, requires_grad=True)
    rollout = torch.log(torch.tensor([[1.0, 1 / 3, 2.0]]))  # pi_old / pi_rollout = 1, 3, 0.5
    adv = torch.ones(1, 3)
    config = PolicyLossConfig(tis_imp_ratio_cap=2.0)
    loss, m = policy_loss(log_prob, log_prob.detach(), adv, torch.ones(1, 3), config, rollout)
    assert loss.item() == pytest.approx(-(1.0 + 2.0 + 0.5) / 3)  # the 3x token is capped at 2
    assert m["actor/tis_ratio_mean"] == pytest.approx((1 + 3 + 0.5) / 3, rel=1e-5)
    assert m["actor/tis_clipfrac"] == pytest.approx(1 / 3)
    plain, _ = policy_loss(log_prob, log_prob.detach(), adv, torch.ones(1, 3), PolicyLossConfig(), rollout)
    assert plain.item() == pytest.approx(-1.0)  # without a cap the rollout log-probs do not enter


def test_loss_aggregation_modes() -> None:
    loss = torch.tensor([[1.0, 3.0, 0.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # the last row: a failed sample
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(8 / 3)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx((4 + 4) / 2)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate(loss, mask, "sum")
    with pytest.raises(ValueError, match="clip_ratio_c"):
        PolicyLossConfig(clip_ratio_c=1.0)


# ------------------------------------------------------------------------------- rollout log-probs layout


def test_rollout_log_probs_are_right_padded_like_responses() -> None:
    a = scored("a", "g", [8, 9], 1.0, logprobs=[-0.5, -1.5])
    b = scored("b", "g", [1, 2, 3], 0.0, logprobs=[-0.1, -0.2, -0.3])
    batch = assemble_batch([a, b])
    assert batch.rollout_log_probs is not None
    assert torch.allclose(batch.rollout_log_probs, torch.tensor([[-0.5, -1.5, 0.0], [-0.1, -0.2, -0.3]]))
    assert batch.rollout_log_probs.shape == batch.responses.shape
    b.response_logprobs = None  # one scored sample without them: no half-filled tensor
    assert assemble_batch([a, b]).rollout_log_probs is None
    failed = scored("c", "g", [], 0.0, error="generation failed", code=13)  # a failed sample need not have them
    assert assemble_batch([a, failed]).rollout_log_probs is not None


@pytest.mark.slow
def test_learner_ratio_is_one_against_its_own_log_probs(tiny_models: TinyModelPaths) -> None:
    """Behaviour = current policy: the PPO loss against rollout log-probs is the on-policy loss, ratio 1."""
    policy = str(tiny_models.policy)
    samples = [scored(f"s{i}", "g", [7 + i, 20 + i], float(i % 2)) for i in range(4)]
    set_group_advantages(samples)
    batch = assemble_batch(samples)
    probe = GRPOLearner(policy, temperature=0.7)
    with torch.no_grad():
        logp, _ = probe.log_probs(batch)
    for s, row in zip(samples, logp, strict=True):
        s.response_logprobs = row[: s.response_ids.shape[0]].numpy()
    off = GRPOLearner(policy, temperature=0.7, require_rollout_log_probs=True)
    on = GRPOLearner(policy, temperature=0.7)
    m_off = off.step(assemble_batch(samples))
    m_on = on.step(batch)
    assert abs(m_off["actor/ppo_kl"]) < 1e-6 and m_off["actor/pg_clipfrac"] == 0.0
    assert m_off["actor/pg_loss"] == pytest.approx(m_on["actor/pg_loss"], abs=1e-6)
    assert m_off["training/rollout_probs_diff_max"] < 1e-6
    for p_off, p_on in zip(off.model.parameters(), on.model.parameters(), strict=True):
        assert torch.allclose(p_off, p_on, atol=1e-6)  # the same update
    with pytest.raises(ValueError, match="rollout_log_probs"):
        off.step(batch)  # an off-policy learner refuses a batch without them


def test_several_updates_per_batch_are_clipped_against_the_old_policy(tiny_models: TinyModelPaths) -> None:
    """ppo_epochs x ppo_mini_batches optimizer steps: later ones see a moved policy (ppo_kl, clipping)."""
    samples = [scored(f"s{i}", "g", [7 + i, 20 + i], float(i % 2)) for i in range(8)]
    set_group_advantages(samples)
    batch = assemble_batch(samples)
    single = GRPOLearner(str(tiny_models.policy), lr=0.05).step(batch)
    several = GRPOLearner(str(tiny_models.policy), lr=0.05, ppo_epochs=3, ppo_mini_batches=2).step(batch)
    assert single["actor/ppo_kl"] == 0.0 and single["actor/pg_clipfrac"] == 0.0
    assert several["actor/ppo_kl"] != 0.0 and several["actor/pg_clipfrac"] > 0.0
    with pytest.raises(ValueError, match="ppo_epochs"):
        GRPOLearner(str(tiny_models.policy), ppo_epochs=0)


def test_cosine_lr_falls_to_its_floor_over_total_steps_and_drives_the_optimizer(tiny_models: TinyModelPaths) -> None:
    """verl's cosine schedule: full lr at the first step, lr x min_lr_ratio from `total_steps` on; the optimizer
    steps with it (a step at lr 0 leaves the weights as they were)."""
    samples = [scored(f"s{i}", "g", [7 + i, 20 + i], float(i % 2)) for i in range(4)]
    set_group_advantages(samples)
    batch = assemble_batch(samples)
    learner = GRPOLearner(str(tiny_models.policy), lr=0.01, total_steps=4, min_lr_ratio=0.0)
    lrs = [learner.step(batch)["actor/lr"] for _ in range(4)]
    assert lrs[0] == pytest.approx(0.01) and lrs == sorted(lrs, reverse=True)
    assert lrs[2] == pytest.approx(0.005)  # half way: half the range
    before = {k: v.clone() for k, v in learner.state_dict().items()}
    assert learner.step(batch)["actor/lr"] == 0.0  # past total_steps: the floor
    assert all(torch.equal(before[k], v) for k, v in learner.state_dict().items())
    assert GRPOLearner(str(tiny_models.policy), lr=0.01).step(batch)["actor/lr"] == 0.01  # constant by default
    with pytest.raises(ValueError, match="min_lr_ratio"):
        GRPOLearner(str(tiny_models.policy), min_lr_ratio=1.5)


# ------------------------------------------------------------------------------------------ failed samples


def test_failed_samples_move_no_group_statistic_and_are_masked() -> None:
    group = [
        scored("a", "g", [1, 2], 1.0),
        scored("b", "g", [1, 2], 0.0),
        scored("c", "g", [1, 2], 0.0, error="checker crashed", code=13),
        scored("d", "g", [1], 0.0, error="timed out", code=4),
    ]
    set_group_advantages(group)
    assert [s.advantage for s in group] == pytest.approx([*grpo_advantages([1.0, 0.0]), 0.0, 0.0])
    batch = assemble_batch(group)
    assert batch.response_mask.tolist() == [[1, 1], [1, 1], [0, 0], [0, 0]]
    assert batch.advantages.tolist()[2:] == [0.0, 0.0] and batch.token_level_scores[2:].abs().sum() == 0
    m = compute_metrics(group)
    assert m["rewardmesh/failed_samples"] == 2
    assert m["rewardmesh/failed_samples/INTERNAL"] == 1 and m["rewardmesh/failed_samples/DEADLINE_EXCEEDED"] == 1
    assert m["critic/score/mean"] == pytest.approx(0.5)  # over the scored samples only
    lone = [scored("x", "h", [1], 1.0), scored("y", "h", [1], 0.0, error="boom", code=13)]
    set_group_advantages(lone)
    assert [s.advantage for s in lone] == [0.0, 0.0]  # one survivor has no baseline: nothing to learn


def fail_script() -> Any:
    """Answers cycle through a right, a wrong, a crashing and a hanging one, call by call."""
    replies = itertools.cycle(["#### 4", "#### 5", "boom", "slow"])

    def script(text: str, turn: int) -> tuple[str, float]:
        return next(replies), 0.0

    return script


def checker() -> dict[str, Any]:
    source = {"type": "function", "function": f"{FNS}:fails_some", "executor": "auto", "timeout_s": 0.3}
    return {"check": {"sources": [source]}}


def prompts(tok: Any, count: int) -> list[PromptSpec]:
    return [PromptSpec(token_ids=tok.encode(f"q{i}"), ground_truth="4") for i in range(count)]


async def test_failed_rewards_over_real_servers_are_masked_and_counted(tok: Any) -> None:
    async with reward_server(checker()) as rs, rollout_server(ScriptedBackend(tok, fail_script()), [rs.address]) as r:
        async with TrainerClient([r.address], reward="check", sampling=Sampling(max_tokens=16)) as client:
            batch = await client.generate_batch(prompts(tok, 4), n=4)
    assert len(batch) == 16
    by_text: dict[str, list[int]] = {}
    for i, s in enumerate(batch.samples):
        by_text.setdefault(s.response_text.replace("<|im_end|>", "").strip(), []).append(i)
    assert {k: len(v) for k, v in by_text.items()} == {"#### 4": 4, "#### 5": 4, "boom": 4, "slow": 4}
    for i in by_text["boom"] + by_text["slow"]:
        assert batch.samples[i].failed and batch.response_mask[i].sum() == 0 and batch.advantages[i] == 0
    for i in by_text["#### 4"] + by_text["#### 5"]:
        assert not batch.samples[i].failed and batch.response_mask[i].sum() > 0
    for g in set(batch.group_ids):  # each group's advantages come from its scored samples alone
        ok = [s for s in batch.samples if s.group_id == g and not s.failed]
        expected = grpo_advantages([s.score for s in ok]) if len(ok) > 1 else [0.0] * len(ok)
        assert [s.advantage for s in ok] == pytest.approx(expected)
    m = batch.metrics
    assert m["rewardmesh/failed_samples"] == 8
    assert m["rewardmesh/failed_samples/INTERNAL"] == 4 and m["rewardmesh/failed_samples/DEADLINE_EXCEEDED"] == 4
    assert m["critic/score/mean"] == pytest.approx(0.5)  # 4 right, 4 wrong; the failures are not zeros


async def test_drop_failed_groups_leaves_out_every_group_with_a_failure(tok: Any) -> None:
    async with reward_server(checker()) as rs, rollout_server(ScriptedBackend(tok, fail_script()), [rs.address]) as r:
        async with TrainerClient([r.address], reward="check", drop_failed_groups=True) as client:
            batch = await client.generate_batch(prompts(tok, 8), n=2)
            kept_groups = set(batch.group_ids)
    assert all(not s.failed for s in batch.samples) and len(batch) == 2 * len(kept_groups)
    m = batch.metrics
    assert m["rewardmesh/failed_samples"] == 8  # counted though left out
    assert m["rewardmesh/dropped_groups"] == 8 - len(kept_groups) >= 4
    assert client.dropped_failed_samples == 16 - len(batch)


# ------------------------------------------------------------------------------- off-policy over the mesh


async def test_off_policy_batches_carry_rollout_log_probs_and_on_policy_ones_do_not(tok: Any) -> None:
    async with reward_server() as rs, rollout_server(ScriptedBackend(tok, fail_script()), [rs.address]) as r:
        async with TrainerClient([r.address], reward="first_number") as client:
            off = [b async for b in client.batches([prompts(tok, 2)], n=2, off_policy_steps=1)]
            on = [b async for b in client.batches([prompts(tok, 2)], n=2, off_policy_steps=0)]
    assert off[0].rollout_log_probs is not None and on[0].rollout_log_probs is None
    mask = off[0].response_mask.bool()  # the scripted backend's log-prob is -0.1 on every token
    assert torch.allclose(off[0].rollout_log_probs[mask], torch.tensor(-0.1))


async def test_hf_rollout_log_probs_match_the_learner_at_the_same_weights(tiny_models: TinyModelPaths) -> None:
    """Engine and learner agree on every sampled token's log-prob (temperature applied on both sides), so
    the PPO ratio of a batch sampled with the learner's own weights is 1 up to fp32 noise."""
    from rewardmesh.server.rollout.backends.hf import HFBackend

    policy = str(tiny_models.policy)
    tokenizer = load_tokenizer(policy)
    specs = [PromptSpec(token_ids=tokenizer.encode(q), ground_truth="7") for q in ("3+4=", "12 + 30 =", "9+")]
    async with reward_server() as rs, rollout_server(HFBackend(policy, num_threads=1), [rs.address]) as r:
        sampling = Sampling(temperature=0.7, max_tokens=5, logprobs=True, seed=3)
        async with TrainerClient([r.address], reward="first_number", sampling=sampling) as client:
            batch = await client.generate_batch(specs, n=4)
    assert batch.rollout_log_probs is not None and int(batch.response_mask.sum()) > 12
    learner = GRPOLearner(policy, temperature=0.7, require_rollout_log_probs=True)
    with torch.no_grad():
        logp, _ = learner.log_probs(batch)
    mask = batch.response_mask.bool()
    assert torch.allclose(logp[mask], batch.rollout_log_probs[mask], atol=1e-4)
    with torch.no_grad():  # the check has teeth: at another temperature they differ
        hot, _ = GRPOLearner(policy, temperature=1.0).log_probs(batch)
    assert not torch.allclose(hot[mask], batch.rollout_log_probs[mask], atol=1e-2)
    m = learner.step(batch)
    assert abs(m["actor/ppo_kl"]) < 1e-4 and m["actor/pg_clipfrac"] == 0.0

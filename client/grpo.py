"""A minimal GRPO learner: the reference training step of the demo, on verl-layout batches.

Group-relative advantages (no critic, no KL penalty), one optimizer step per batch, and verl's
PPO clipped policy loss. Off-policy batches (one-step off-policy: the rollout servers sampled with
weights one version behind) carry `rollout_log_probs`, and the ratio is taken against them, so the
update is corrected for the policy having moved; on-policy the ratio is 1 and the loss is plain
policy gradient. With `tis_imp_ratio_cap` the learner instead follows verl's truncated importance
sampling: the PPO ratio is against the learner's own log-probs before the update and each token is
weighted by min(pi_old / pi_rollout, cap).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from rewardmesh.client.batch import RolloutBatch


@dataclass(frozen=True)
class PolicyLossConfig:
    """verl's actor options of the same names (`actor_rollout_ref.actor.*`)."""

    clip_ratio: float = 0.2  # epsilon of PPO's clip(ratio, 1 - eps, 1 + eps)
    clip_ratio_low: float | None = None  # asymmetric clipping (DAPO's clip-higher); None: clip_ratio
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0  # dual-clip: a negative-advantage token's loss is bounded by -A x clip_ratio_c
    tis_imp_ratio_cap: float = 0.0  # > 0: truncated importance sampling against the rollout log-probs
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"

    def __post_init__(self) -> None:
        if self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 (dual-clip lower bound), got {self.clip_ratio_c}")
        if min(self.low, self.high) < 0:
            raise ValueError("clip ratios must be >= 0")

    @property
    def low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """verl's agg_loss: over all policy tokens, or per sequence then over sequences that have any."""
    if mode == "token-mean":
        return masked_mean(loss, mask)
    per_seq = (loss * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1.0)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"loss_agg_mode {mode!r} is not token-mean, seq-mean-token-mean or seq-mean-token-sum")
    has_tokens = (mask.sum(-1) > 0).float()
    return (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)


def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: PolicyLossConfig,
    rollout_log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate with dual-clip, as verl's `compute_policy_loss` ([B, R] tensors, token advantages).

    Returns the loss and `actor/pg_loss`, `actor/ppo_kl` (mean old - new log-prob), `actor/pg_clipfrac`
    (tokens whose ratio was clipped), `actor/pg_clipfrac_lower` (negative-advantage tokens bounded by the
    dual clip), and with truncated IS, `actor/tis_ratio_mean` and `actor/tis_clipfrac`.
    """
    mask = mask.float()
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)  # exp() must not overflow
    ratio = torch.exp(log_ratio)
    losses1 = -advantages * ratio
    losses2 = -advantages * torch.clamp(ratio, 1.0 - config.low, 1.0 + config.high)
    clipped = torch.maximum(losses1, losses2)
    losses3 = -advantages * config.clip_ratio_c
    dual = torch.minimum(losses3, clipped)
    losses = torch.where(advantages < 0, dual, clipped)
    metrics = {
        "actor/ppo_kl": masked_mean(-log_ratio, mask).item(),
        "actor/pg_clipfrac": masked_mean((losses2 > losses1).float(), mask).item(),
        "actor/pg_clipfrac_lower": masked_mean(((clipped > losses3) & (advantages < 0)).float(), mask).item(),
    }
    if rollout_log_probs is not None and config.tis_imp_ratio_cap > 0:
        tis = torch.exp(torch.clamp(old_log_prob - rollout_log_probs, max=20.0)).detach()
        metrics["actor/tis_ratio_mean"] = masked_mean(tis, mask).item()
        metrics["actor/tis_clipfrac"] = masked_mean((tis > config.tis_imp_ratio_cap).float(), mask).item()
        losses = losses * torch.clamp(tis, max=config.tis_imp_ratio_cap)
    loss = aggregate(losses, mask, config.loss_agg_mode)
    metrics["actor/pg_loss"] = loss.item()
    return loss, metrics


class GRPOLearner:
    """verl's actor update on a verl-layout batch: `ppo_epochs` passes over `ppo_mini_batches` slices, one
    optimizer step per slice. Pass the rollout's sampling temperature so log-probs match the engine's."""

    def __init__(
        self,
        model_path: str,
        *,
        lr: float = 1e-3,
        max_grad_norm: float = 1.0,
        seed: int = 0,
        temperature: float = 1.0,
        loss: PolicyLossConfig | None = None,
        require_rollout_log_probs: bool = False,
        betas: tuple[float, float] = (0.9, 0.999),
        ppo_epochs: int = 1,
        ppo_mini_batches: int = 1,
        entropy_coeff: float = 0.0,
        total_steps: int = 0,
        min_lr_ratio: float = 1.0,
    ) -> None:
        from transformers import AutoModelForCausalLM

        if temperature <= 0:
            raise ValueError(
                f"temperature must be > 0 (log-probs of greedy decoding are not defined), got {temperature}"
            )
        if ppo_epochs < 1 or ppo_mini_batches < 1:
            raise ValueError(f"ppo_epochs and ppo_mini_batches must be >= 1, got {ppo_epochs}, {ppo_mini_batches}")
        if not 0.0 <= min_lr_ratio <= 1.0 or total_steps < 0:
            raise ValueError(f"min_lr_ratio must be in [0, 1] and total_steps >= 0, got {min_lr_ratio}, {total_steps}")
        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=torch.float32)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0, betas=betas)
        self.max_grad_norm = max_grad_norm
        self.temperature = temperature
        self.loss = loss or PolicyLossConfig()
        # Off-policy training without the behaviour policy's log-probs would silently assume ratio 1.
        self.require_rollout_log_probs = require_rollout_log_probs
        self.ppo_epochs = ppo_epochs
        self.ppo_mini_batches = ppo_mini_batches
        self.entropy_coeff = entropy_coeff
        # verl's cosine schedule: lr falls from `lr` to `lr * min_lr_ratio` over `total_steps` calls of `step`
        # (0: constant), so a policy that has learned is not shaken out of it by full-size steps.
        self.base_lr, self.total_steps, self.min_lr_ratio = lr, total_steps, min_lr_ratio
        self.steps_done = 0

    @property
    def lr(self) -> float:
        """The learning rate of the next step."""
        if not self.total_steps or self.min_lr_ratio == 1.0:
            return self.base_lr
        progress = min(1.0, self.steps_done / self.total_steps)
        return self.base_lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    def log_probs(self, batch: RolloutBatch, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs of the responses (of `rows` only, if given) and each position's entropy, at the
        rollout temperature."""
        index = slice(None) if rows is None else rows
        responses = batch.responses[index]
        logits = self.model(
            input_ids=batch.input_ids[index],
            attention_mask=batch.attention_mask[index],
            position_ids=batch.position_ids[index],
        ).logits[:, batch.prompts.shape[1] - 1 : -1]  # position t predicts response token t
        logp_all = torch.log_softmax(logits.float() / self.temperature, dim=-1)
        logp = logp_all.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp, entropy

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        """Update on one batch; returns verl's actor metrics, averaged over the optimizer steps."""
        if self.require_rollout_log_probs and batch.rollout_log_probs is None:
            raise ValueError("off-policy batch without rollout_log_probs: request them (Sampling(logprobs=True))")
        rollout = batch.rollout_log_probs
        updates = self.ppo_epochs * self.ppo_mini_batches
        old: torch.Tensor | None = None
        if rollout is not None and self.loss.tis_imp_ratio_cap <= 0:
            old = rollout  # PPO-clip against the behaviour policy itself
        elif updates > 1:  # the weights before this step's first update (verl's old_log_prob)
            with torch.no_grad():
                old = self.log_probs(batch)[0]
        lr = self.lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        totals: dict[str, float] = {}
        for _epoch in range(self.ppo_epochs):
            for rows in torch.arange(len(batch)).chunk(self.ppo_mini_batches):
                for key, value in self._update(batch, rows, old).items():
                    totals[key] = totals.get(key, 0.0) + value / updates
        totals["actor/lr"] = lr
        self.steps_done += 1
        return totals

    def _update(self, batch: RolloutBatch, rows: torch.Tensor, old: torch.Tensor | None) -> dict[str, float]:
        logp, entropy = self.log_probs(batch, rows)
        mask = batch.response_mask[rows].float()
        advantages = batch.advantages[rows, None].expand_as(logp)
        rollout = None if batch.rollout_log_probs is None else batch.rollout_log_probs[rows]
        old_rows = logp.detach() if old is None else old[rows]  # one update per batch: the weights are still old
        loss, metrics = policy_loss(logp, old_rows, advantages, mask, self.loss, rollout)
        entropy_mean = masked_mean(entropy, mask)
        if self.entropy_coeff:
            loss = loss - self.entropy_coeff * entropy_mean
        if rollout is not None:  # verl's check on how far the learner's probabilities are from the engine's
            gap = (logp.detach().exp() - rollout.exp()).abs()
            metrics["training/rollout_probs_diff_mean"] = masked_mean(gap, mask).item()
            metrics["training/rollout_probs_diff_max"] = (gap * mask).max().item()
        self.optimizer.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        metrics["actor/grad_norm"] = float(grad_norm)
        metrics["actor/entropy"] = entropy_mean.item()
        return metrics

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}

"""Bounded staleness for one-step off-policy training: a step's groups with a sample produced by weights older than
the bound are dropped whole, never handed to the learner."""

from __future__ import annotations

import logging

from rewardmesh.client.batch import RolloutBatch, assemble_batch

log = logging.getLogger(__name__)

__all__ = ["drop_stale"]


def drop_stale(
    batch: RolloutBatch, *, policy_version: int, bound: int, pad_token_id: int
) -> tuple[RolloutBatch | None, int]:
    """Drop whole groups with a sample beyond the staleness bound: the batch left (None when nothing is) and how
    many samples were dropped."""
    oldest_allowed = policy_version - bound
    stale_groups = {s.group_id for s in batch.samples if s.policy_version < oldest_allowed}
    kept = [s for s in batch.samples if s.group_id not in stale_groups]
    dropped = len(batch.samples) - len(kept)
    if not kept:
        log.warning("all %d samples of a step were more than %d versions old; step skipped", len(batch), bound)
        return None, dropped
    metrics = dict(batch.metrics)
    metrics["off_policy/dropped_samples"] = float(dropped)
    metrics["off_policy/max_staleness"] = float(max((policy_version - s.policy_version for s in kept), default=0))
    if not stale_groups:
        batch.metrics = metrics
        return batch, dropped
    return assemble_batch(kept, pad_token_id=pad_token_id, metrics=metrics), dropped

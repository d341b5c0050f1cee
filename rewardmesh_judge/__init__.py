"""rewardmesh's verifiers judge plugin: verifiers resolves a judge id by importing a top-level module of that name
and taking the one Judge subclass it exports, so the plugin is `judges = [{id = "rewardmesh_judge", ...}]`
(rewardmesh.client.integrations.verifiers_judge holds it; see docs/integrations.md)."""

from rewardmesh.client.integrations.verifiers_judge import RewardMeshJudge

__all__ = ["RewardMeshJudge"]

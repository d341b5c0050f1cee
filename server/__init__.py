"""Servicers and entry points: the reward service, the rollout service, and the plumbing both use."""

from rewardmesh._links import only_as

only_as(__name__, "rewardmesh.server")

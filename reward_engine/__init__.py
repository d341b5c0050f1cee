"""Reward computation with no network in it: the dynamic batcher, reward sources, pipelines."""

from rewardmesh._links import only_as

only_as(__name__, "rewardmesh.reward_engine")

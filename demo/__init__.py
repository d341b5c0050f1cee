"""Runnable examples: the tiny models the project builds offline, the RL and reward demos; may import everything."""

from rewardmesh._links import only_as

only_as(__name__, "rewardmesh.demo")

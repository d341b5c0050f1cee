"""Runnable examples: the tiny models the project builds offline, the RL and reward demos; may import everything."""

"""The rollout service: the Generate servicer over a rollout worker, the agent loop, tools, weights, engines."""

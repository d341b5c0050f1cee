"""The reward service: the Score servicer over RewardEngine, its HTTP gateway, /run_code and tenants."""

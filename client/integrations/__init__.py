"""Adapters that let verl, TRL and slime score through rewardmesh (OpenRLHF uses the server's HTTP gateway)."""

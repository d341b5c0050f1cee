"""Adapters that let verl, TRL, OpenRLHF and slime score through rewardmesh (see docs/integrations.md)."""

"""Helpers shared by the tests (servers in-process, scripted backends, fake endpoints, reward functions)."""

"""Rollout types and generation over a chain of stages."""

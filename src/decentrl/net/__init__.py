"""Transports: how rollouts and weights move between the roles of a run."""

"""The roles of a run: rollout workers, the coordinator, and the loop that joins them."""

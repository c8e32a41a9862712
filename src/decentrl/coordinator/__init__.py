"""The run's coordinator: the training loop, its local and swarm backends, and the run owner."""

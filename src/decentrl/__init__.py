"""decentrl: reinforcement-learning post-training of language models on a swarm of untrusted peers."""

__version__ = "0.1.0"

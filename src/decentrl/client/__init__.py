"""What the coordinator calls stage peers with: inference sessions, the training client."""

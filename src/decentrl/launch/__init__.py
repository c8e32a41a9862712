"""Starting processes: a peer joining a run, a local swarm, and the demo's hostile peers."""

"""One stage peer in its own process, for the multi-process swarm test.

    python swarm_peer_process.py CONFIG_JSON STAGE ROLE OWNER [INITIAL_PEER ...]

Starts a SwarmNode and a StagePeer of the run OWNER (a peer id) owns, prints one line `READY {"peer_id", "sockets", "daemon_pid"}`
(the test removes the sockets itself if it kills this process), then serves until SIGTERM or
SIGINT, on which it shuts down cleanly (removing its sockets) and exits 0."""

from __future__ import annotations

import json
import logging
import signal
import sys
import tempfile
import threading
from pathlib import Path

import torch

from decentrl.config import parse_config
from decentrl.net.link import LinkProfile
from decentrl.net.node import SwarmNode
from decentrl.net.wire import TensorLimits
from decentrl.stage.peer import StagePeer


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    config_path, stage, role, owner, *initial_peers = argv
    config = parse_config(json.loads(Path(config_path).read_text()))
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    node = SwarmNode.start(f"proc-s{stage}", initial_peers, LinkProfile(), TensorLimits())
    try:
        with tempfile.TemporaryDirectory(prefix="decentrl-peer-") as checkpoints:
            peer = StagePeer(config, int(stage), role, node, owner,  # type: ignore[arg-type]
                             checkpoint_dir=Path(checkpoints), name=f"proc-s{stage}")
            peer.start()
            assert node.p2p is not None and node.p2p._child is not None
            info = {"peer_id": node.peer_id, "sockets": node.socket_paths(),
                    "daemon_pid": node.p2p._child.pid}
            print("READY " + json.dumps(info), flush=True)
            while not stop.wait(0.5):
                pass
            peer.stop()
    finally:
        node.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

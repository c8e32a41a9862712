"""A peer that joins a run by its name alone: it serves with every setting of the owner's config
(its node started before the config arrived), and it stops when the owner, and only the owner,
says the run ended."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from decentrl.net.identity import Identity
from decentrl.net.link import LinkProfile
from decentrl.net.node import SwarmNode
from decentrl.net.protocol import RunEnded, ended_key
from decentrl.net.wire import TensorLimits, encode_struct
from decentrl.swarm import launch
from decentrl.swarm.manifest import announce_run_end, publish_manifest, run_manifest
from swarm_helpers import tiny_run_config


@pytest.mark.network
def test_a_peer_joined_by_run_name_takes_its_config_and_stops_when_its_owner_ends_it(
        tiny_sharp_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "RUN_END_CHECK_S", 0.2)
    config = tiny_run_config(tiny_sharp_dir, 1, swarm={"link": {"rtt_ms": [30, 40],
                                                                "jitter_ms": 3}})
    owner = SwarmNode.start("owner", [], LinkProfile(), TensorLimits())
    stranger = SwarmNode.start("stranger", owner.addresses(), LinkProfile(), TensorLimits(),
                               identity=Identity.generate())
    events: list[dict[str, Any]] = []
    stop = threading.Event()
    peer = threading.Thread(target=launch.join, kwargs=dict(
        config=None, run=config.name, owner=owner.peer_id, stage=0, role="inference",
        initial_peers=owner.addresses(), checkpoint_dir=None, name="by-name", stop=stop,
        report=events.append, console=Console(quiet=True), config_wait_s=60), daemon=True)
    try:
        publish_manifest(owner, run_manifest(config, roster=[]), ttl_s=60)
        peer.start()
        deadline = time.monotonic() + 120
        while not any("ready" in e for e in events) and time.monotonic() < deadline:
            time.sleep(0.1)
        ready = next(e for e in events if "ready" in e)
        # The run's link emulation, though the node started before it knew the run.
        assert ready["link"]["rtt_ms"] == (30.0, 40.0) and ready["link"]["jitter_ms"] == 3.0
        # Anyone else's word that the run ended is not read...
        forged = encode_struct(RunEnded(run=config.name, steps=1))
        stranger.run(stranger.announce(ended_key(config.name), forged, 60), timeout=30)
        peer.join(timeout=2)
        assert peer.is_alive()
        # ...the owner's is: the peer stops by itself.
        announce_run_end(owner, config.name, steps=7)
        peer.join(timeout=30)
        assert not peer.is_alive()
    finally:
        stop.set()
        peer.join(timeout=30)
        stranger.shutdown()
        owner.shutdown()

"""A peer that joins a run by its name alone: it serves with every setting of the owner's config
and its own host settings (its node started before the config arrived), and it stops when the
owner, and only the owner, says the run ended, for the session it joined (not a record of an
earlier start)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from swarm_helpers import tiny_run_config

from decentrl.config import HostConfig, LinkConfig
from decentrl.coordinator.manifest import announce_run_end, publish_manifest, run_manifest
from decentrl.launch import join as launch_join
from decentrl.net.dht_storage import RunNamespace
from decentrl.net.identity import Identity
from decentrl.net.link import LinkProfile
from decentrl.net.node import SwarmNode
from decentrl.net.protocol import PeerRecord, RunEnded, ended_key, stage_key
from decentrl.net.records import decode_records
from decentrl.net.session import new_session
from decentrl.net.wire import TensorLimits, encode_struct


@pytest.mark.network
def test_a_peer_joined_by_run_name_takes_its_config_and_stops_when_its_owner_ends_it(
        tiny_sharp_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner's `RunEnded` of an earlier start, kept by a stranger's DHT node and served to
    the peers of the resumed run, does not stop them: it names another session."""
    monkeypatch.setattr(launch_join, "RUN_END_CHECK_S", 0.2)
    config = tiny_run_config(tiny_sharp_dir, 1, host={"link": {"rtt_ms": [30, 40],
                                                                "jitter_ms": 3}})
    owner_key = Identity.generate()
    earlier = SwarmNode.start("owner", [], LinkProfile(), TensorLimits(), identity=owner_key)
    stranger = SwarmNode.start("stranger", earlier.addresses(), LinkProfile(), TensorLimits(),
                               identity=Identity.generate())
    owner: SwarmNode | None = None
    events: list[dict[str, Any]] = []
    ignored = threading.Event()

    def report(event: dict[str, Any]) -> None:
        events.append(event)
        if "run_end_ignored" in event:
            ignored.set()
    stop = threading.Event()
    peer: threading.Thread | None = None
    try:
        # The earlier start of the run ended: its signed record lives a while, and the
        # stranger's DHT node (of the run, so it keeps the run's records) holds a copy once the
        # owner is gone.
        for node in (earlier, stranger):
            node.dht_storage.join(RunNamespace.of(config, earlier.peer_id))
        first = new_session()
        announce_run_end(earlier, config.name, steps=3, session=first)
        earlier.shutdown()
        assert stranger.run(stranger.lookup(ended_key(config.name)), timeout=30)
        owner = SwarmNode.start("owner", stranger.addresses(), LinkProfile(), TensorLimits(),
                                identity=owner_key)
        resumed = run_manifest(config, roster=[], session=new_session())
        publish_manifest(owner, resumed, ttl_s=60)
        peer = threading.Thread(target=launch_join.join, kwargs=dict(
            config=None, run=config.name, owner=owner.peer_id, stage=0, role="inference",
            initial_peers=owner.addresses(), checkpoint_dir=None, name="by-name", stop=stop,
            report=report, console=Console(quiet=True), config_wait_s=60, host=config.host),
            daemon=True)
        peer.start()
        deadline = time.monotonic() + 120
        while not any("ready" in e for e in events) and time.monotonic() < deadline:
            time.sleep(0.1)
        ready = next(e for e in events if "ready" in e)
        # Its own host's link emulation (the manifest carries none), seeded by the run it
        # learned of after its node started.
        assert ready["link"]["rtt_ms"] == (30.0, 40.0) and ready["link"]["jitter_ms"] == 3.0
        # Anyone else's word that the run ended is not read at all...
        forged = encode_struct(RunEnded(run=config.name, steps=1, session=resumed.session))
        stranger.run(stranger.announce(ended_key(config.name), forged, 60), timeout=30)
        # ...and the owner's of the earlier start is read, and ignored for its session.
        assert ignored.wait(timeout=60)
        reasons = [e["run_end_ignored"] for e in events if "run_end_ignored" in e]
        assert reasons == [f"the owner's RunEnded of session {first[:8]} is ignored: the run's "
                           f"manifest is of session {resumed.session[:8]} (a record signed at "
                           "an earlier start of the run)"]
        assert peer.is_alive() and not stop.is_set()
        # The owner's word for this session is: the peer stops by itself.
        announce_run_end(owner, config.name, steps=7, session=resumed.session)
        peer.join(timeout=30)
        assert not peer.is_alive()
    finally:
        stop.set()
        if peer is not None:
            peer.join(timeout=30)
        stranger.shutdown()
        earlier.shutdown()
        if owner is not None:
            owner.shutdown()


@pytest.mark.network
def test_a_gpu_like_and_a_cpu_peer_join_one_run_each_with_its_own_host_settings(
        tiny_sharp_dir: Path) -> None:
    """Two peers join the owner's run by its name, one with GPU-like host settings (bf16,
    several threads, its own folders and emulated links) and one with CPU ones (fp32, one
    thread): the owner's manifest accepts both, and both serve stage 0 of that run."""
    config = tiny_run_config(tiny_sharp_dir, 1)
    hosts = {
        "gpu-like": HostConfig(dtype="bf16", threads=2, checkpoint_dir=Path("unused"),
                               link=LinkConfig(rtt_ms=(20.0, 30.0))),
        "cpu": HostConfig(device="cpu", dtype="fp32", threads=1),
    }
    owner = SwarmNode.start("owner", [], LinkProfile(), TensorLimits(),
                            identity=Identity.generate())
    events: list[dict[str, Any]] = []
    stop = threading.Event()
    peers: list[threading.Thread] = []
    try:
        publish_manifest(owner, run_manifest(config, roster=[], session=new_session()), ttl_s=60)
        for name, host in hosts.items():
            peers.append(threading.Thread(target=launch_join.join, kwargs=dict(
                config=None, run=config.name, owner=owner.peer_id, stage=0, role="inference",
                initial_peers=owner.addresses(), checkpoint_dir=None, name=name, stop=stop,
                report=events.append, console=Console(quiet=True), config_wait_s=60,
                host=host), daemon=True))
            peers[-1].start()
        deadline = time.monotonic() + 120
        while sum("ready" in e for e in events) < len(hosts) and time.monotonic() < deadline:
            time.sleep(0.1)
        ready = {e["name"]: e for e in events if "ready" in e}
        assert sorted(ready) == sorted(hosts)
        assert {e["run"] for e in ready.values()} == {config.name}
        assert {e["stage"] for e in ready.values()} == {0}
        assert ready["gpu-like"]["link"]["rtt_ms"] == (20.0, 30.0)
        assert ready["cpu"]["link"]["rtt_ms"] == (0.0, 0.0)
        served: dict[str, PeerRecord] = {}
        while len(served) < len(hosts) and time.monotonic() < deadline:
            served, _ = decode_records(owner.run(owner.lookup(stage_key(config.name, 0)),
                                                 timeout=30), PeerRecord, 0)
            time.sleep(0.5)
        assert set(served) == {e["peer_id"] for e in ready.values()}
    finally:
        stop.set()
        for peer in peers:
            peer.join(timeout=30)
        owner.shutdown()

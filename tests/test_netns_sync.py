"""Weight sync between two homes behind NAT, through a relay that keeps libp2p's default limits
(128 KiB each way, 2 minutes per relayed connection): the replica asks for megabyte updates in
pieces that fit, on fresh circuits, and the relay never cuts a call."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from swarm_helpers import Swarm, publisher_of, tiny_run_config, weights_of
from test_netns import netns_or_skip
from test_sync import assert_serves_published, fake_step

from decentrl.config import RunConfig
from decentrl.model.tiny import make_tiny_model
from decentrl.net.circuits import CIRCUIT_BYTES, PIECE_BYTES
from decentrl.net.dialback import keep_routes_announced
from decentrl.net.link import LinkProfile
from decentrl.net.netns import HomeSpec, Internet
from decentrl.net.node import SwarmNode
from decentrl.net.reach import NetworkOptions, RouteRecord, relay_circuit
from decentrl.net.wire import TensorLimits
from decentrl.swarm.peer import StagePeer

pytestmark = pytest.mark.network


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Hidden size 128: about 600k parameters, so that an update is megabytes.
    return make_tiny_model(tmp_path_factory.mktemp("wide") / "model", seed=3, hidden_size=128)


def behind_nat(config: RunConfig, net: Internet, host: str, relay: str, owner: str,
               role: str, folder: Path) -> StagePeer:
    """A stage-0 peer on `host` that others reach only through `relay` (announced as its
    route), as `start_reachable` leaves one."""
    node = SwarmNode.start(host, [relay], LinkProfile(), TensorLimits(), network=NetworkOptions(
        (f"/ip4/{net.hosts[host].address}/tcp/0",), relays=(relay,), reachability="relayed",
        netns=net.hosts[host].namespace))
    try:
        head, _, relay_id = relay.rpartition("/p2p/")
        keep_routes_announced(node, RouteRecord(
            [relay_circuit(f"{head}/p2p/{relay_id}")], relayed=True))
        peer = StagePeer(config, 0, role, node, owner,  # type: ignore[arg-type]
                         checkpoint_dir=folder, name=host)
        peer.start()
    except BaseException:
        node.shutdown()
        raise
    return peer


@pytest.fixture
def two_homes(wide_model_dir: Path) -> Iterator[Swarm]:
    netns_or_skip()
    config = tiny_run_config(wide_model_dir, 1, sync={"density": 0.5, "chunks_per_update": 8})
    with Internet.start(["owner"], [HomeSpec(["trainer"]), HomeSpec(["replica"])]) as net, \
            tempfile.TemporaryDirectory(prefix="decentrl-netns-sync-") as folder:
        owner_host = net.hosts["owner"]
        owner = SwarmNode.start("owner", [], LinkProfile(), TensorLimits(), network=NetworkOptions(
            (f"/ip4/{owner_host.address}/tcp/0",), reachability="direct", relay_service=True,
            netns=owner_host.namespace))
        peers: list[StagePeer] = []
        swarm = Swarm(config, owner, peers, Path(folder))
        try:
            relay = owner.addresses()[0]
            peers.append(behind_nat(config, net, "trainer", relay, owner.peer_id, "training",
                                    Path(folder)))
            peers.append(behind_nat(config, net, "replica", relay, owner.peer_id, "inference",
                                    Path(folder)))
            yield swarm
        finally:
            if swarm.lineage is not None:
                swarm.lineage.close()
            for peer in peers:
                peer.stop()
                peer.node.shutdown()
            owner.shutdown()


def test_a_replica_behind_nat_takes_megabyte_updates_from_a_training_peer_behind_another(
        two_homes: Swarm) -> None:
    trainer, replica = two_homes.peers
    for step in (1, 2):
        fake_step(two_homes, trainer, step)
        assert replica.node.run(weights_of(replica).follow(), timeout=120) is True
        assert_serves_published(replica, trainer)
    circuits = replica.node.circuits
    circuit = circuits.get(trainer.node.peer_id)
    assert circuit is not None and "p2p-circuit" in circuit.address
    manifests = [publisher_of(trainer).updates[("delta", v)].manifest for v in (1, 2)]
    moved = sum(m.size for m in manifests)
    assert moved > 10 * CIRCUIT_BYTES  # megabytes, through a relay that cuts at 128 KiB
    assert all(m.chunk_size > PIECE_BYTES for m in manifests)  # so chunks came in pieces
    # Every call had room on its connection: none was cut, and the connections were replaced
    # about as often as the bytes required (before, the relay cut each one under a call).
    assert circuits.failures == 0
    assert circuits.renewals >= moved // CIRCUIT_BYTES - 2

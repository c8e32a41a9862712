"""Peers in homes behind NAT, in process (net/netns.py): weight sync between two homes through a
relay that keeps libp2p's default limits (128 KiB each way, 2 minutes per relayed connection:
the replica asks for megabyte updates in pieces that fit, on fresh circuits, and the relay never
cuts a call); a peer behind NAT that dials its coordinator again when their connection is lost;
and routing that moves new sessions away from a home whose uplink is throttled."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from hivemind.p2p import PeerID
from swarm_helpers import Swarm, publisher_of, tiny_run_config, weights_of

from decentrl.config import RunConfig
from decentrl.model.loading import load_model
from decentrl.model.tiny import make_tiny_model
from decentrl.net import daemon as daemon_module
from decentrl.net.circuits import CIRCUIT_BYTES, PIECE_BYTES
from decentrl.net.dht_storage import RunNamespace
from decentrl.net.dialback import keep_routes_announced
from decentrl.net.link import LinkProfile
from decentrl.net.netns import HomeSpec, Internet
from decentrl.net.node import RemoteError, Reply, Request, SwarmNode
from decentrl.net.protocol import Empty, Rpc, TensorRule
from decentrl.net.reach import RouteRecord, relay_circuit, through_relay
from decentrl.net.sizes import with_envelope
from decentrl.net.wire import TensorLimits
from decentrl.rollout.generate import generate
from decentrl.rollout.sampling import SamplingConfig
from decentrl.stage.peer import StagePeer
from tests.netns.test_netns import netns_or_skip
from tests.swarm.test_sync import assert_serves_published, fake_step

pytestmark = pytest.mark.network
GREEDY = SamplingConfig(temperature=0.0)


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Hidden size 128: about 600k parameters, so that an update is megabytes.
    return make_tiny_model(tmp_path_factory.mktemp("wide") / "model", seed=3, hidden_size=128)


def start_on(net: Internet, host: str, relay: str | None = None) -> SwarmNode:
    """A node on `host`, bootstrapped from `relay`: on the public segment reached directly;
    behind NAT only through `relay`, announced as its route (as `start_reachable` leaves one)."""
    relays = [relay] if relay else []
    node = SwarmNode.start(host, relays, LinkProfile(), TensorLimits(),
                           network=net.node_options(host, relays))
    if relay and net.hosts[host].behind_nat:
        try:
            keep_routes_announced(node, RouteRecord([relay_circuit(relay)], relayed=True))
        except BaseException:
            node.shutdown()
            raise
    return node


def behind_nat(config: RunConfig, net: Internet, host: str, relay: str, owner: str,
               role: str, folder: Path) -> StagePeer:
    """A stage-0 peer on `host` that others reach only through `relay`."""
    node = start_on(net, host, relay)
    try:
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
        owner = start_on(net, "owner")
        owner.dht_storage.join(RunNamespace.of(config, owner.peer_id))  # it keeps the run's keys
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
    assert circuit is not None and through_relay(circuit.address)
    manifests = [publisher_of(trainer).updates[("delta", v)].manifest for v in (1, 2)]
    moved = sum(m.size for m in manifests)
    assert moved > 10 * CIRCUIT_BYTES  # megabytes, through a relay that cuts at 128 KiB
    assert all(m.chunk_size > PIECE_BYTES for m in manifests)  # so chunks came in pieces
    # Every call had room on its connection: none was cut, and the connections were replaced
    # about as often as the bytes required (before, the relay cut each one under a call).
    assert circuits.failures == 0
    assert circuits.renewals >= moved // CIRCUIT_BYTES - 2


def test_new_sessions_move_away_from_a_home_whose_uplink_is_throttled(
        wide_model_dir: Path) -> None:
    """Two stage-0 replicas in two homes, generating 4 sessions at a time: about half the new
    sessions go to each, until one home's uplink drops to 0.1 Mbit/s; its replica's hidden
    states then crawl out, its sessions stay open, and routing gives it far fewer."""
    netns_or_skip()
    config = tiny_run_config(wide_model_dir, 2)
    model = load_model(str(wide_model_dir))
    with Internet.start(["owner", "server"], [HomeSpec(["fast"]), HomeSpec(["slow"])]) as net, \
            tempfile.TemporaryDirectory(prefix="decentrl-netns-routing-") as folder:
        owner = start_on(net, "owner")
        owner.dht_storage.join(RunNamespace.of(config, owner.peer_id))  # it keeps the run's keys
        peers: list[StagePeer] = []
        try:
            relay = owner.addresses()[0]
            for host in ("fast", "slow"):
                peers.append(behind_nat(config, net, host, relay, owner.peer_id, "inference",
                                        Path(folder)))
            server = start_on(net, "server", relay)
            last = StagePeer(config, 1, "inference", server, owner.peer_id,
                             checkpoint_dir=Path(folder), name="server")
            peers.append(last)
            last.start()
            chain = Swarm(config, owner, peers, Path(folder)).chain(model.spec)
            slow_id = peers[1].node.peer_id

            replicas = (peers[0].node.peer_id, slow_id)

            def slow_share(sessions: int) -> float:
                """The slow home's share of the next `sessions` sessions or so the routing
                opens (a count, not a time window: how fast this machine is does not matter)."""
                start = chain.directory.sessions_opened()

                def opened() -> dict[str, int]:
                    now = chain.directory.sessions_opened()
                    return {p: now.get(p, 0) - start.get(p, 0) for p in replicas}

                def generating() -> None:
                    while sum(opened().values()) < sessions:
                        generate(chain, [[1, 2, 3, 4]] * 8, 12, GREEDY, set(), 0)
                with ThreadPoolExecutor(4) as pool:
                    list(pool.map(lambda _: generating(), range(4)))
                counts = opened()
                return counts[slow_id] / sum(counts.values())

            before = slow_share(24)
            net.throttle(2, 0.1)
            after = slow_share(48)
            assert 0.3 <= before <= 0.7
            assert after < before / 2
        finally:
            for peer in peers:
                peer.stop()
                peer.node.shutdown()
            owner.shutdown()


ECHO = Rpc("echo_bytes", Empty, Empty, "any peer", {"data": TensorRule("float32")},
           max_bytes=with_envelope(2 * 2**20))


def test_large_calls_refused_through_a_relay_go_direct_once_the_peer_behind_nat_dials_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator lost its connection to a peer behind NAT: it reaches the peer through the
    relay, where a megabyte request cannot go (refused, saying why); the peer dials the
    coordinator again within seconds, and the same request then goes over that connection."""
    netns_or_skip()
    monkeypatch.setattr(daemon_module, "REDIAL_EVERY_S", 2.0)
    with Internet.start(["owner"], [HomeSpec(["home"]), HomeSpec(["away"])]) as net:
        owner = start_on(net, "owner")
        nodes = [owner]
        try:
            relay = owner.addresses()[0]
            for host in ("home", "away"):
                node = start_on(net, host, relay)
                nodes.append(node)

                async def echo(request: Request[Empty]) -> Reply:
                    return Reply(Empty(), {})
                node.serve(ECHO, echo)
            home, away = nodes[1], nodes[2]
            megabyte = {"data": torch.zeros(2**18)}
            # Two homes: only the relay joins them, and it cannot carry a megabyte.
            with pytest.raises(RemoteError, match="is more than a relayed connection carries"):
                away.call_sync(home.peer_id, ECHO, Empty(), megabyte)
            away.call_sync(home.peer_id, ECHO, Empty(), {"data": torch.zeros(16)})
            assert away.circuits.get(home.peer_id) is not None
            # The coordinator and a home: its connection, when lost, is back within seconds.
            owner.run(owner.p2p._client.disconnect(PeerID.from_base58(home.peer_id)), timeout=10)
            deadline = time.monotonic() + 30
            while True:
                try:
                    owner.call_sync(home.peer_id, ECHO, Empty(), megabyte, timeout=10)
                    break
                except RemoteError:
                    assert time.monotonic() < deadline, "the home never dialed the owner again"
                    time.sleep(0.5)
            assert owner.circuits.get(home.peer_id) is None
        finally:
            for node in reversed(nodes):
                node.shutdown()

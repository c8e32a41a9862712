"""What three unchecked claims of one stranger cost the swarm.

Each attack comes from a node that is not the coordinator, on loopback, in this one process:

- evaluation wait: the coordinator's wait, before an evaluation, for the replicas to serve the
  learner's version (coordinator/replica_wait.py), while a stranger announces a replica stuck at v0
  and the honest replica serves v1. Figure: seconds waited (`eval_wait_s`).
- joiners per stage: `--joiners` inference peers join a 2-stage run one after another with
  `--stage auto` (launch/join.py `choose_stage`, each announcing itself before the next one
  chooses) while a stranger's record claims BOASTED_SESSIONS free sessions at stage 0 (the
  `huge-capacity` adversary's claim). Figures: joiners at each stage.
- update with a fake chunk owner: a publisher and one replica following it (sync/distribute.py,
  synthetic float32 weights of `--params` entries, 1 %-density deltas, SyncConfig defaults),
  plus a stranger that announces an inference replica of the stage and holds every chunk request
  open without answering. Figures: seconds from the start of `sync_once` to the applied update,
  for each of `--updates` updates, with and without the stranger (`update_s`, `update_clean_s`:
  the medians; `update_first_s`, `update_worst_s`), and how many chunks came from the publisher
  in the stranger's stead.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import torch

from bench import common
from decentrl.config import SwarmConfig, SyncConfig, parse_config
from decentrl.coordinator.replica_wait import wait_for_routed_replicas
from decentrl.launch.adversary import BOASTED_SESSIONS
from decentrl.launch.join import choose_stage
from decentrl.net.authority import RunAuthority
from decentrl.net.dht_storage import RunNamespace
from decentrl.net.directory import Directory
from decentrl.net.link import LinkProfile
from decentrl.net.node import Reply, Request, SwarmNode
from decentrl.net.protocol import (
    SYNC_CHUNK,
    ChunkRequest,
    LineageRecord,
    PeerRecord,
    lineage_key,
    stage_key,
)
from decentrl.net.session import new_session
from decentrl.net.wire import TensorLimits, encode_struct
from decentrl.sync.delta import PublishedState
from decentrl.sync.distribute import WeightFollower, WeightPublisher

RUN = "unchecked-claims"
# Records live as long as the run's nodes keep them (net/dht_storage.py MAX_RECORD_TTL_S).
TTL_S = 60.0
# The followers' request timeout: that of the swarm tests' runs (tests/swarm_helpers.py).
TIMEOUT_S = 20.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    description = " ".join((__doc__ or "").split("\n\n")[0].split())
    parser = argparse.ArgumentParser(prog="decentrl bench unchecked-claims",
                                     description=description)
    parser.add_argument("--joiners", type=int, default=8)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--params", type=int, default=2**20, help="weights of the stage")
    args = parser.parse_args(argv)
    if args.joiners < 1 or args.updates < 1 or args.params < 1024:
        parser.error("--joiners and --updates >= 1, --params >= 1024")
    return args


def start(name: str, bootstrap: SwarmNode | None) -> SwarmNode:
    return SwarmNode.start(name, bootstrap.addresses() if bootstrap else [], LinkProfile(),
                           TensorLimits())


def announce(node: SwarmNode, stage: int, version: int = 0, free_sessions: int = 4) -> None:
    record = PeerRecord(name=node.name, stage=stage, layers=(0, 1), role="inference",
                        version=version, tokens_per_s=0.0, free_sessions=free_sessions,
                        training_ready=False)
    key = stage_key(RUN, stage)
    node.run(node.announce(key, encode_struct(record), TTL_S), timeout=30)
    if node.peer_id not in node.run(node.lookup(key), timeout=30):
        raise RuntimeError(f"{node.name} could not announce itself")


def hold_every_chunk_request(stranger: SwarmNode) -> None:
    """The stranger's node takes any request (its own code) and never answers a chunk one."""
    async def anyone(sender: str, rpc: object) -> None:
        pass

    async def hold(request: Request[ChunkRequest]) -> Reply:
        await asyncio.Event().wait()  # cancelled when the node stops
        raise AssertionError("never answers")
    stranger.authorize = anyone
    stranger.serve(SYNC_CHUNK, hold)


def evaluation_wait(nodes: list[SwarmNode]) -> float:
    coordinator, replica, stranger = nodes
    announce(replica, 0, version=1)
    announce(stranger, 0, version=0)
    directory = Directory(coordinator, RUN, 1, SwarmConfig())
    began = time.perf_counter()
    waited = wait_for_routed_replicas(directory, 1)
    print(f"  evaluation: {waited.text()}", flush=True)
    return time.perf_counter() - began


def joiners_per_stage(nodes: list[SwarmNode]) -> list[int]:
    boaster, *joiners = nodes
    config = parse_config({"name": RUN, "num_stages": 2})
    announce(boaster, 0, free_sessions=BOASTED_SESSIONS)
    chosen = []
    for joiner in joiners:
        stage = choose_stage(joiner, config, "inference")
        announce(joiner, stage)
        chosen.append(stage)
    return [chosen.count(stage) for stage in (0, 1)]


def update_times(nodes: list[SwarmNode], updates: int, params: int) -> list[float]:
    """Seconds per update for the follower on nodes[1] of the publisher on nodes[0] (also the
    run's owner, who signs each version); nodes[2:] are strangers owning chunks."""
    publisher_node, replica_node, *strangers = nodes
    owner = publisher_node.peer_id
    for node in (publisher_node, replica_node):
        authority = RunAuthority(node, RUN, owner, 0)
        node.run(authority.refresh(), timeout=30)
        node.authorize = authority.check
    announce(replica_node, 0)
    for stranger in strangers:
        hold_every_chunk_request(stranger)
        announce(stranger, 0)
    generator = torch.Generator().manual_seed(0)
    weights = {"w": 0.02 * torch.randn(params, generator=generator)}
    sync = SyncConfig()
    publisher = WeightPublisher(publisher_node, RUN, 0, sync, 0, weights, timeout_s=60)
    base = PublishedState.of(0, weights)
    follower = WeightFollower(replica_node, RUN, 0, sync, base, lambda *changes: None,
                              timeout_s=TIMEOUT_S, ban_s=30, owner=owner)
    times = []
    session = new_session()
    try:
        for version in range(1, updates + 1):
            weights["w"].add_(1e-3 * torch.randn(params, generator=generator))
            publisher.publish(version, weights)
            publisher.wait(timeout=60)
            lineage = LineageRecord(stage=0, publisher=owner,
                                    hashes={version: publisher.state.hash}, session=session)
            publisher_node.run(publisher_node.announce(lineage_key(RUN, 0),
                                                       encode_struct(lineage), TTL_S), timeout=30)
            began = time.perf_counter()
            replica_node.run(follower.sync_once(), timeout=600)
            times.append(time.perf_counter() - began)
            if follower.state.hash != publisher.state.hash:
                raise RuntimeError("the replica holds another state than the publisher")
        replica_node.run(follower.probed(), timeout=60)  # the probes after the last update
        print(f"  update v1..v{updates} with {len(strangers)} fake owner(s): "
              f"{', '.join(f'{t:.2f}s' for t in times)}; {follower.sources.fallbacks} chunks "
              f"from the publisher in their owner's stead, {follower.sources.unanswered} "
              "requests unanswered", flush=True)
    finally:
        follower.close()
        publisher.close()
    return times


def with_nodes(count: int, measure: Any) -> Any:
    nodes: list[SwarmNode] = []
    try:
        for index in range(count):
            nodes.append(start(f"n{index}", nodes[0] if nodes else None))
            # Every node is of the run the first one owns, so it keeps the run's records.
            nodes[-1].dht_storage.join(RunNamespace(RUN, nodes[0].peer_id, num_stages=2,
                                                    announce_every_s=TTL_S / 6))
        return measure(nodes)
    finally:
        for node in nodes:
            node.shutdown()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    eval_wait_s = with_nodes(3, evaluation_wait)
    per_stage = with_nodes(1 + args.joiners, joiners_per_stage)
    print(f"  joiners per stage with a boasting record at stage 0: {per_stage}", flush=True)
    clean = with_nodes(2, lambda nodes: update_times(nodes, args.updates, args.params))
    faked = with_nodes(3, lambda nodes: update_times(nodes, args.updates, args.params))
    common.print_table("unchecked claims of one stranger", ["figure", "value"], [
        ["evaluation wait, fake record (s)", eval_wait_s],
        ["joiners at stage 0 (boasted) / stage 1", f"{per_stage[0]} / {per_stage[1]}"],
        ["update, no fake owner (s, median)", statistics.median(clean)],
        ["update, fake owner (s, median)", statistics.median(faked)],
        ["update, fake owner (s, first / worst)", f"{faked[0]:.2f} / {max(faked):.2f}"],
    ])
    common.print_figures("unchecked-claims", {
        "eval_wait_s": eval_wait_s, "joiners_stage0": per_stage[0],
        "joiners_stage1": per_stage[1], "update_clean_s": statistics.median(clean),
        "update_s": statistics.median(faked), "update_first_s": faked[0],
        "update_worst_s": max(faked)})


if __name__ == "__main__":
    main()

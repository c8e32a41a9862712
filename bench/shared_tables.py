"""What a stranger's floods make a node hold: the DHT's storage and the coordinator's inbox.

Four attacks from a node that is not the coordinator, on a loopback swarm (a coordinator, two
replicas announced under a stage's key, no model), each printed as what it did:

- `any-key`: for `--seconds`, signed 64 KiB records under keys of its own choosing, kept ten
  years, sent straight to a replica: the bytes the replica's DHT storage keeps.
- `stage-crowd`: `--identities` throwaway identities (keys made here, no daemon each) write a
  64 KiB record each under the stage's key on every honest node; then a node joins and reads the
  stage: the replicas it finds, and the coordinator's own count.
- `tiny-records`: `--tiny` identities write a one-byte record each under the stage's key; then a
  third replica announces itself: whether the coordinator's directory (net/directory.py) has it.
- `inbox`: two identities open 32 `submit_rollouts` streams each at the coordinator, 8 MiB
  apiece: the most bytes of requests the coordinator held at once (counted from its stream
  readers) and how many submissions were refused.

It runs against whichever decentrl is imported: the figures of `main` come from the same script
with PYTHONPATH pointing at main's src/. Nothing here is asserted (tests/unit/net/test_bounded_state.py
and friends check the refusals).

Run: decentrl bench shared-tables [--seconds 5] [--identities 80] [--tiny 300] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from decentrl.config import RunConfig
from decentrl.net import serving as serving_module
from decentrl.net.directory import Directory
from decentrl.net.identity import Identity
from decentrl.net.link import LinkProfile, MessageLost
from decentrl.net.node import RemoteError, SwarmNode
from decentrl.net.protocol import SUBMIT_ROLLOUTS, Empty, PeerRecord, stage_key
from decentrl.net.records import SignedRecordValidator
from decentrl.net.serving import Server
from decentrl.net.streams import FrameReader
from decentrl.net.swarm_transport import HivemindTransport
from decentrl.net.wire import TensorLimits, WireError, encode_struct

RUN = "shared-tables"
BIG = 64 * 2**10
TEN_YEARS_S = 10 * 365 * 86400.0
SUBMISSION_FLOATS = 2 * 2**20  # 8 MiB of float32, under MAX_SUBMISSION_BYTES


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="decentrl bench shared-tables",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--identities", type=int, default=80)
    parser.add_argument("--tiny", type=int, default=300)
    parser.add_argument("--json", type=Path)
    return parser.parse_args(argv)


def stored_bytes(node: SwarmNode) -> int:
    """What `node`'s DHT storage holds: every value's bytes (read the same way on any branch)."""
    assert node.dht is not None
    total = 0
    for _, item in list(node.dht.protocol.storage.items()):
        if isinstance(item.value, DictionaryDHTValue):
            total += sum(len(entry.value) for _, entry in item.value.items())
        else:
            total += len(item.value)
    return total


def signed_value(identity: Identity, key: str, body: bytes, expiration: float) -> bytes:
    """`identity`'s record under `key` as a node stores it (written out here, not taken from the
    tests, so that the bench runs against main too)."""
    record = DHTRecord(DHTID.generate(source=key).to_bytes(),
                       MSGPackSerializer.dumps(identity.peer_id), MSGPackSerializer.dumps(body),
                       expiration)
    return SignedRecordValidator(identity).sign_value(record)


def store_at(sender: SwarmNode, target: str, writer: Identity, items: list[tuple[str, bytes]],
             expiration: float) -> int:
    """Ask `target` to keep `writer`'s records (key, body); how many it kept."""
    assert sender.dht is not None
    values = [signed_value(writer, key, body, expiration) for key, body in items]
    kept = sender.run(sender.dht.protocol.call_store(
        PeerID.from_base58(target), [DHTID.generate(source=key) for key, _ in items], values,
        expiration, subkeys=[writer.peer_id] * len(items)), timeout=60)
    return sum(bool(ok) for ok in kept or [])


def join_run(nodes: list[SwarmNode], owner: str) -> None:
    """Where the node keeps only its run's records (this branch), it joins the bench's run."""
    for node in nodes:
        storage = getattr(node, "dht_storage", None)
        if storage is not None:
            from decentrl.net.dht_storage import RunNamespace
            storage.join(RunNamespace(RUN, owner, 1, 2.0))


def announce(node: SwarmNode, name: str) -> None:
    record = PeerRecord(name=name, stage=0, layers=(0, 2), role="inference", version=0,
                        tokens_per_s=0.0, free_sessions=4, training_ready=False)
    node.run(node.announce(stage_key(RUN, 0), encode_struct(record), 10.0), timeout=30)


@contextmanager
def started(names: list[str], peers: list[str]) -> Iterator[list[SwarmNode]]:
    nodes: list[SwarmNode] = []
    try:
        for name in names:
            nodes.append(SwarmNode.start(name, peers, LinkProfile(), TensorLimits()))
        yield nodes
    finally:
        for node in nodes:
            node.shutdown()


@contextmanager
def swarm() -> Iterator[tuple[SwarmNode, list[SwarmNode], SwarmNode]]:
    """A coordinator, two replicas announced under the stage's key, and a stranger."""
    with started(["coordinator"], []) as (coordinator,):
        with started(["replica-1", "replica-2", "stranger"], coordinator.addresses()) as nodes:
            replicas, stranger = nodes[:2], nodes[2]
            join_run([coordinator, *replicas], coordinator.peer_id)
            for index, replica in enumerate(replicas):
                announce(replica, f"replica-{index}")
            yield coordinator, replicas, stranger


def any_key(replica: SwarmNode, stranger: SwarmNode, seconds: float) -> dict[str, Any]:
    before = stored_bytes(replica)
    expiration = get_dht_time() + TEN_YEARS_S
    sent = kept = 0
    began = time.monotonic()
    while time.monotonic() - began < seconds:
        items = [(f"junk/{sent + i}", bytes(BIG)) for i in range(48)]  # ~3 MiB per request
        kept += store_at(stranger, replica.peer_id, stranger.identity, items, expiration)
        sent += len(items)
    added = stored_bytes(replica) - before
    return {"records_sent": sent, "records_kept": kept, "bytes_added": added,
            "seconds": round(time.monotonic() - began, 1)}


def stage_crowd(coordinator: SwarmNode, replicas: list[SwarmNode], stranger: SwarmNode,
                identities: int) -> dict[str, Any]:
    expiration = get_dht_time() + 60
    kept = 0
    for _ in range(identities):
        writer = Identity.generate()
        for node in [coordinator, *replicas]:
            kept += store_at(stranger, node.peer_id, writer, [(stage_key(RUN, 0), bytes(BIG))],
                             expiration)
        # The stranger answers lookups with its crowd too (it keeps anything, bounds or not).
        assert stranger.dht is not None
        DHTLocalStorage.store_subkey(
            stranger.dht.protocol.storage, DHTID.generate(source=stage_key(RUN, 0)),
            writer.peer_id, signed_value(writer, stage_key(RUN, 0), bytes(BIG), expiration),
            expiration)
    honest = {r.peer_id for r in replicas}
    with started(["joiner"], coordinator.addresses()) as (joiner,):
        join_run([joiner], coordinator.peer_id)
        seen_by_joiner = honest & set(joiner.run(joiner.lookup(stage_key(RUN, 0)), timeout=60))
    seen_by_coordinator = honest & set(coordinator.run(coordinator.lookup(stage_key(RUN, 0)),
                                                       timeout=60))
    return {"records_kept": kept, "replicas": len(honest),
            "joiner_sees": len(seen_by_joiner), "coordinator_sees": len(seen_by_coordinator)}


def tiny_records(coordinator: SwarmNode, replicas: list[SwarmNode], stranger: SwarmNode,
                 count: int) -> dict[str, Any]:
    directory = Directory(coordinator, RUN, 1, RunConfig().swarm)
    directory.refresh()  # the replicas announced so far are known
    expiration = get_dht_time() + 60
    for _ in range(count):
        writer = Identity.generate()
        for node in [coordinator, *replicas]:
            store_at(stranger, node.peer_id, writer, [(stage_key(RUN, 0), b"\x00")], expiration)
    with started(["late-replica"], coordinator.addresses()) as (late,):
        join_run([late], coordinator.peer_id)
        announce(late, "late")
        directory.refresh()
        return {"records": count, "late_replica_in_directory": late.peer_id in directory.peers,
                "peers_in_directory": len(directory.peers)}


class HeldBytes:
    """The bytes of requests a node's open request streams have read, at most at once."""

    def __init__(self) -> None:
        self.open: set[FrameReader] = set()
        self.peak = 0

    @contextmanager
    def counting(self) -> Iterator[None]:
        """Count while inside (the node's stream reading, wrapped, and restored after)."""
        serve_stream, read_next = Server._serve_stream, FrameReader.next
        held = self

        async def counted_serve(server: Server, guarded: Any, sender: str, address: str,
                                stream: FrameReader, writer: Any) -> None:
            held.open.add(stream)
            try:
                await serve_stream(server, guarded, sender, address, stream, writer)
            finally:
                held.open.discard(stream)

        async def counted_next(reader: FrameReader) -> Any:
            frame = await read_next(reader)
            held.peak = max(held.peak, sum(r.received for r in held.open))
            return frame

        Server._serve_stream = counted_serve  # type: ignore[method-assign]
        FrameReader.next = counted_next  # type: ignore[method-assign]
        try:
            yield
        finally:
            Server._serve_stream = serve_stream  # type: ignore[method-assign]
            FrameReader.next = read_next  # type: ignore[method-assign]


def inbox(coordinator: SwarmNode, held: HeldBytes) -> dict[str, Any]:
    try:  # main's transport admits through the trust gate: here, everything is refused
        transport = HivemindTransport(coordinator, coordinator.peer_id, inbox_size=4,
                                      admit=refuse)  # type: ignore[call-arg]
    except TypeError:
        transport = HivemindTransport(coordinator, coordinator.peer_id, inbox_size=4)
    flood = replace(SUBMIT_ROLLOUTS, request=Empty)
    tensors = {"inputs": torch.zeros(SUBMISSION_FLOATS)}
    refused = 0
    began = time.monotonic()
    with started(["flooder-1", "flooder-2"], coordinator.addresses()) as flooders:
        async def one(node: SwarmNode) -> bool:
            try:
                await node.call(coordinator.peer_id, flood, Empty(), tensors=tensors, timeout=60)
            except (RemoteError, WireError, MessageLost, TimeoutError, ConnectionError):
                return True
            return False

        async def streams(node: SwarmNode) -> list[bool]:
            return list(await asyncio.gather(*(one(node) for _ in range(32))))

        futures = [asyncio.run_coroutine_threadsafe(streams(node), node.loop)
                   for node in flooders]
        for future in futures:
            refused += sum(future.result(timeout=300))
    transport.close()
    return {"submissions": 64, "refused": refused, "peak_bytes_held": held.peak,
            "seconds": round(time.monotonic() - began, 1)}


def refuse(group: Any, sender: str) -> None:
    raise ValueError("nothing is leased to remote submitters")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    held = HeldBytes()
    figures: dict[str, Any] = {"branch": "bounded" if hasattr(serving_module, "InflightBudget")
                               else "main"}
    for attack in ("any-key", "stage-crowd", "tiny-records", "inbox"):
        with swarm() as (coordinator, replicas, stranger):
            if attack == "any-key":
                figures[attack] = any_key(replicas[0], stranger, args.seconds)
            elif attack == "stage-crowd":
                figures[attack] = stage_crowd(coordinator, replicas, stranger, args.identities)
            elif attack == "tiny-records":
                figures[attack] = tiny_records(coordinator, replicas, stranger, args.tiny)
            else:
                with held.counting():
                    figures[attack] = inbox(coordinator, held)
    flat = {f"{attack.replace('-', '_')}_{name}": int(value)
            for attack, values in figures.items() if isinstance(values, dict)
            for name, value in values.items()}
    width = max(map(len, flat))
    print(f"shared tables, {figures['branch']}:")
    for name, value in flat.items():
        print(f"  {name:<{width}}  {value:>12,}")
    print("shared-tables " + " ".join(f"{k}={v}" for k, v in flat.items()), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2))
    return figures


if __name__ == "__main__":
    main()

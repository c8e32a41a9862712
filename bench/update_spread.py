"""Time for an update to reach every replica of a stage.

Time for a weight update to reach every inference replica of a stage over emulated consumer
uplinks (20 Mbit/s by default), with 2, 4 and 8 replicas: the swarm (replicas fetch chunks from
each other) against a star (every replica downloads from the publisher). Target: the swarm's time
stays nearly flat as replicas are added.

What runs, per replica count N and variant, in this one process: a publisher SwarmNode and N
replica SwarmNodes on loopback, every node behind the same emulated link (`LinkProfile`: RTT drawn
per pair from `--rtt-ms` 60-120 ms, 10 ms jitter, `--uplink-mbps` 20 shared by everything a node
uploads; net/link.py), all bootstrapped from the publisher. The publisher runs a `WeightPublisher`
(sync/distribute.py) over synthetic float32 weights shaped like one stage of SmolLM2-135M split in
two: 15 decoder layers (hidden 576, kv dim 192, MLP 1536, two norms) plus the 49152 x 576
embedding, 81.4 M parameters (`--scale` < 1 keeps fewer layers and embedding rows, for a quick
run). Every replica runs a `WeightFollower` from the same initial state and announces a
`PeerRecord` (role inference) under the stage's DHT key, so replicas find each other. Variants:

- `swarm`: `SyncConfig()` defaults (peer exchange on, `--chunks` 32 an update,
  `--parallel-fetches` 8 in flight): each replica takes its own share of the chunks from the
  publisher and the rest from their owners.
- `star`: the same with `peer_exchange=False`: every replica takes every chunk from the
  publisher.

One update: the publisher's weights move like an optimizer step (+ 1e-5 x randn on every entry),
it publishes the new version (a 1 %-density int8 delta with error feedback, sync/delta.py: ~1.9 MB
at full size) and the bench waits until it is encoded and announced (encoding is not timed). Then
the clock starts and every replica runs `sync_once()` at the same time (one thread per replica,
each running the coroutine on its own node's loop): DHT lookups, the plan request, the chunks,
then decode + apply + state hash, then the commit callback. Figures per update (the median of
`--updates` timed updates after `--warmup` untimed ones; a replica waits on another only once
that one has served it a good chunk, sync/sources.py, so the first update comes from the
publisher alone and the warm-up is where the replicas get to know each other):

- update bytes: the delta's payload (varint index gaps, int8 values, float32 scales).
- delivered s: until the LAST replica holds every chunk (a wrapper around the follower's fetch
  records when it returns): the network part.
- applied s: until the LAST replica has committed the update (the commit callback's time).
  On this machine every replica's apply (decode, apply, sha256 of the whole 325 MB float32 state)
  runs on the same cores, so the applies queue behind each other; on separate machines they
  would run side by side. Hence also:
- est. separate s: max over replicas of (its delivered time + its apply's thread CPU time), what
  the applied time would be if every replica had its own CPU.
- pub. sent x: bytes the publisher's `traffic()` rows count as sent for that version, over the
  update's size (the swarm's claim: about 1, whatever N; the star: N).
- sent x: the most any replica sent of that version, over the update's size (what each
  replica received is in the caption: the update's size exactly, from anyone).
- plan s: mean time from the clock's start to a replica's first chunk request (two DHT
  lookups and the plan request to the publisher).
- dense bf16 s (computed, not measured): what the swarm sent before compressed deltas, a whole
  bf16 stage (2 bytes a parameter) from the publisher to each of N replicas over the same uplink,
  N x bytes x 8 / uplink.

The emulated uplink is the only bandwidth limit (loopback itself is not limiting); the RTT adds
to every request. The DHT's own traffic is not emulated. Every replica's apply runs with one
torch thread (`WeightFollower` sets it in the apply's worker thread): on 2 shared cores a
2-thread apply of a 1 % delta to 81 M parameters spends most of its time with one OpenMP thread
waiting for the other (1.3 s instead of 0.1 s measured while another job ran).

With `--netns` (as root; net/netns.py), the same runs across hosts of their own: the publisher
in one home behind NAT, each replica in a home of its own behind NAT, a relay on the public
segment; every home's uplink capped at `--uplink-mbps` by a kernel token bucket instead of the
link emulator (which keeps the RTT). Nobody can dial anyone but the relay: every byte between
two peers crosses it, on relayed connections that carry 128 KiB each way at most
(net/circuits.py: chunks come in 40 KiB pieces, on a fresh circuit every 100 KiB). The table
then also has each update's fresh circuits (`circuits`), and calls a relay cut (`cut`).

Run: decentrl bench update-spread [--replicas 2,4,8] [--updates 3] [--warmup 1] [--scale 1.0]
     [--variants swarm,star] [--uplink-mbps 20] [--rtt-ms 60,120] [--chunks 32]
     [--parallel-fetches 8] [--threads 1] [--netns] [--json PATH] [--out PNG|none]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from bench import common
from decentrl.config import SyncConfig
from decentrl.net.authority import RunAuthority
from decentrl.net.dht_storage import MAX_RECORD_TTL_S, RunNamespace
from decentrl.net.dialback import keep_routes_announced
from decentrl.net.link import LinkProfile
from decentrl.net.netns import HomeSpec, Internet
from decentrl.net.node import SwarmNode
from decentrl.net.protocol import (
    LineageRecord,
    PeerRecord,
    UpdateManifest,
    lineage_key,
    stage_key,
)
from decentrl.net.reach import RouteRecord, relay_circuit
from decentrl.net.session import new_session
from decentrl.net.wire import TensorLimits, encode_struct
from decentrl.sync.delta import PublishedState, TensorChange
from decentrl.sync.distribute import StoredUpdate, WeightFollower, WeightPublisher

VARIANTS = ("swarm", "star")
RUN = "update-spread"
DEFAULT_OUT = "runs/update-spread/update_spread.png"
# One stage of SmolLM2-135M split in two stages.
LAYERS, HIDDEN, KV_DIM, MLP, VOCAB = 15, 576, 192, 1536, 49152
STEP_SCALE = 1e-5  # how far an "optimizer step" moves every weight
SYNC_TIMEOUT_S = 120.0
# The longest the DHT keeps a record: the replicas announce again before each update.
ANNOUNCE_TTL_S = MAX_RECORD_TTL_S


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    description = " ".join((__doc__ or "").split("\n\n")[0].split())
    parser = argparse.ArgumentParser(prog="decentrl bench update-spread", description=description)
    parser.add_argument("--replicas", default="2,4,8", help="comma-separated replica counts")
    parser.add_argument("--updates", type=int, default=3, help="timed updates per count/variant")
    parser.add_argument("--warmup", type=int, default=1, help="untimed updates first")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="fraction of the stage's layers and embedding rows (1: 81.4 M "
                             "parameters)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated: swarm,star")
    defaults = SyncConfig()
    parser.add_argument("--chunks", type=int, default=defaults.chunks_per_update,
                        help="SyncConfig.chunks_per_update")
    parser.add_argument("--parallel-fetches", type=int, default=defaults.parallel_fetches,
                        help="SyncConfig.parallel_fetches")
    parser.add_argument("--uplink-mbps", type=float, default=20.0,
                        help="every node's emulated upload, Mbit/s")
    parser.add_argument("--rtt-ms", default="60,120", help="round-trip range LOW,HIGH (ms)")
    parser.add_argument("--jitter-ms", type=float, default=10.0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of this process (the publisher's encoding)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--netns", action="store_true",
                        help="every node behind NAT in a home of its own, a relay between them "
                             "(Linux network namespaces; needs root)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--out", default=DEFAULT_OUT, help="plot file (PNG), or 'none'")
    args = parser.parse_args(argv)
    try:
        args.replicas = [int(n) for n in args.replicas.split(",") if n.strip()]
        args.rtt_ms = tuple(float(x) for x in args.rtt_ms.split(","))
    except ValueError:
        parser.error("--replicas and --rtt-ms take comma-separated numbers")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not args.variants or any(v not in VARIANTS for v in args.variants):
        parser.error(f"--variants must name some of {', '.join(VARIANTS)}")
    if not args.replicas or min(args.replicas) < 1 or len(args.rtt_ms) != 2:
        parser.error("--replicas needs counts >= 1, --rtt-ms two numbers")
    if min(args.threads, args.chunks, args.parallel_fetches) < 1:
        parser.error("--threads, --chunks and --parallel-fetches must be >= 1")
    if args.updates < 1 or args.warmup < 0 or not 0 < args.scale <= 1 or args.uplink_mbps <= 0:
        parser.error("--updates >= 1, --warmup >= 0, 0 < --scale <= 1, --uplink-mbps > 0")
    return args


# ---- the stage's weights ------------------------------------------------------------------------

def stage_shapes(scale: float) -> dict[str, tuple[int, ...]]:
    """The tensors of layers [0, 15) of SmolLM2-135M plus the embedding, scaled down by `scale`."""
    layers = max(1, round(LAYERS * scale))
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (max(1, round(VOCAB * scale)), HIDDEN)}
    for i in range(layers):
        prefix = f"layers.{i}."
        shapes.update({
            prefix + "input_layernorm.weight": (HIDDEN,),
            prefix + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
            prefix + "self_attn.k_proj.weight": (KV_DIM, HIDDEN),
            prefix + "self_attn.v_proj.weight": (KV_DIM, HIDDEN),
            prefix + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            prefix + "post_attention_layernorm.weight": (HIDDEN,),
            prefix + "mlp.gate_proj.weight": (MLP, HIDDEN),
            prefix + "mlp.up_proj.weight": (MLP, HIDDEN),
            prefix + "mlp.down_proj.weight": (HIDDEN, MLP),
        })
    return shapes


def initial_weights(scale: float, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: 0.02 * torch.randn(shape, generator=generator)
            for name, shape in stage_shapes(scale).items()}


# ---- a follower that records when its fetch and apply finished --------------------------------

class TimedFollower(WeightFollower):
    """A WeightFollower whose fetch and apply record their end (perf_counter) and the apply's
    thread CPU time, per version. Nothing else changes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fetch_began: dict[int, float] = {}
        self.fetched: dict[int, float] = {}
        self.applied: dict[int, float] = {}
        self.apply_cpu: dict[int, float] = {}
        self.committed: dict[int, float] = {}

    async def _fetch(self, update: StoredUpdate, publisher: str) -> None:
        self.fetch_began[update.manifest.version] = time.perf_counter()
        await super()._fetch(update, publisher)
        self.fetched[update.manifest.version] = time.perf_counter()

    def _apply(self, manifest: UpdateManifest, data: bytes | bytearray
               ) -> dict[str, TensorChange]:
        began = time.thread_time()
        changes = super()._apply(manifest, data)
        self.apply_cpu[manifest.version] = time.thread_time() - began
        self.applied[manifest.version] = time.perf_counter()
        return changes

    def record_commit(self, version: int, changes: dict[str, TensorChange]) -> None:
        """The commit callback: a replica would copy `changes` into its model here."""
        self.committed[version] = time.perf_counter()


# ---- one swarm ----------------------------------------------------------------------------------

def start_nodes(count: int, args: argparse.Namespace, internet: Internet | None
                ) -> tuple[list[SwarmNode], list[SwarmNode]]:
    """The publisher's node first, then `count` replica nodes bootstrapped from it; and the
    relay's node on an internet (bootstrapping everyone there)."""
    def profile(index: int) -> LinkProfile:
        return LinkProfile(rtt_ms=args.rtt_ms, jitter_ms=args.jitter_ms,
                           uplink_mbps=None if internet else args.uplink_mbps,
                           seed=args.seed * 1000 + index)
    names = ["publisher", *(f"replica{i}" for i in range(count))]
    nodes: list[SwarmNode] = []
    relays: list[SwarmNode] = []
    try:
        if internet is None:
            nodes.append(SwarmNode.start(names[0], [], profile(0), TensorLimits()))
            peers = nodes[0].addresses()
            for index, name in enumerate(names[1:], start=1):
                nodes.append(SwarmNode.start(name, peers, profile(index), TensorLimits()))
            return nodes, relays
        relays.append(SwarmNode.start("relay", [], LinkProfile(), TensorLimits(),
                                      network=internet.node_options("relay")))
        relay = relays[0].addresses()[0]
        route = RouteRecord([relay_circuit(relay)], relayed=True)
        for index, name in enumerate(names):
            nodes.append(SwarmNode.start(name, [relay], profile(index), TensorLimits(),
                                         network=internet.node_options(name, [relay])))
            keep_routes_announced(nodes[-1], route)
    except BaseException:
        for node in nodes + relays:
            node.shutdown()
        raise
    return nodes, relays


def announce_replicas(replicas: list[SwarmNode], layers: int) -> None:
    for i, node in enumerate(replicas):
        record = PeerRecord(name=f"replica{i}", stage=0, layers=(0, layers), role="inference",
                            version=0, tokens_per_s=0.0, free_sessions=1, training_ready=False)
        # Relays keep no run's records: whether some node kept it shows below.
        node.run(node.announce(stage_key(RUN, 0), encode_struct(record), ANNOUNCE_TTL_S),
                 timeout=30)
    deadline = time.monotonic() + 60
    for node in replicas:  # every replica must see all of them, or chunk owners differ
        while len(node.run(node.lookup(stage_key(RUN, 0)), timeout=30)) < len(replicas):
            if time.monotonic() > deadline:
                raise TimeoutError("replicas do not all see each other in the DHT")
            time.sleep(0.2)


def sync_all(followers: list[TimedFollower], version: int, pool: ThreadPoolExecutor
             ) -> tuple[float, list[int]]:
    """Every follower syncs at once; returns the clock start and each one's extra sync calls
    (a follower whose DHT lookup still saw the old version, or whose sync failed, tries again)."""
    start = threading.Barrier(len(followers) + 1)

    def follow(follower: TimedFollower) -> int:
        start.wait(timeout=60)
        deadline = time.monotonic() + SYNC_TIMEOUT_S
        retries = 0
        while True:
            try:
                follower.node.run(follower.sync_once(), timeout=SYNC_TIMEOUT_S)
                # Its probes of the other replicas (sync/sources.py), off the timed path, decide
                # whom it waits on in the next update.
                follower.node.run(follower.probed(), timeout=SYNC_TIMEOUT_S)
            except Exception as error:  # noqa: BLE001 - counted, tried again
                print(f"    {follower.node.name}: sync failed: {error}", flush=True)
            if follower.state.version == version:
                return retries
            if time.monotonic() > deadline:
                raise TimeoutError(f"{follower.node.name} did not reach v{version}")
            retries += 1
            time.sleep(0.05)

    futures = [pool.submit(follow, f) for f in followers]
    began = time.perf_counter()
    start.wait(timeout=60)
    return began, [future.result() for future in futures]


def measure_update(publisher: WeightPublisher, followers: list[TimedFollower],
                   current: dict[str, torch.Tensor], version: int, generator: torch.Generator,
                   pool: ThreadPoolExecutor) -> dict[str, Any]:
    with torch.no_grad():
        for tensor in current.values():
            tensor.add_(STEP_SCALE * torch.randn(tensor.shape, generator=generator))
    began = time.perf_counter()
    publisher.publish(version, current)
    publisher.wait(timeout=600)
    encode_s = time.perf_counter() - began
    # The publisher's node plays the run's owner too: it signs the new version's lineage.
    lineage = LineageRecord(stage=0, publisher=publisher.node.peer_id,
                            hashes={version: publisher.state.hash}, session=new_session())
    publisher.node.run(publisher.node.announce(lineage_key(RUN, 0), encode_struct(lineage),
                                               ANNOUNCE_TTL_S), timeout=30)
    size = publisher.updates[("delta", version)].manifest.size
    chunks = len(publisher.updates[("delta", version)].manifest.chunk_hashes)
    circuits_before = [(f.node.circuits.renewals, f.node.circuits.failures) for f in followers]
    start, retries = sync_all(followers, version, pool)
    for follower in followers:
        if follower.state.hash != publisher.state.hash:
            raise RuntimeError(f"{follower.node.name} holds another state than the publisher")
    publisher_id = publisher.node.peer_id
    planned = [f.fetch_began[version] - start for f in followers]
    delivered = [f.fetched[version] - start for f in followers]
    applied = [f.committed[version] - start for f in followers]
    apply_cpu = [f.apply_cpu[version] for f in followers]
    received, sent, from_publisher = [], [], 0
    for follower in followers:
        rows = [r for r in follower.traffic() if r.kind == "delta" and r.version == version]
        received.append(sum(r.received for r in rows))
        sent.append(sum(r.sent for r in rows))
        from_publisher += sum(r.received for r in rows if r.peer == publisher_id)
    publisher_sent = sum(r.sent for r in publisher.traffic()
                         if r.kind == "delta" and r.version == version)
    return {"version": version, "bytes": size, "chunks": chunks, "encode_s": encode_s,
            "delivered_s": max(delivered), "applied_s": max(applied),
            "separate_s": max(d + c for d, c in zip(delivered, apply_cpu)),
            "planned_s": statistics.fmean(planned), "delivered_each_s": delivered,
            "applied_each_s": applied, "apply_cpu_s": apply_cpu, "publisher_sent": publisher_sent,
            "received": received, "sent": sent,
            "from_publisher": from_publisher / max(1, sum(received)), "retries": retries,
            "circuits": sum(f.node.circuits.renewals - b for f, (b, _) in
                            zip(followers, circuits_before)),
            "cut": sum(f.node.circuits.failures - c for f, (_, c) in
                       zip(followers, circuits_before))}


def run_config(count: int, variant: str, args: argparse.Namespace,
               weights: dict[str, torch.Tensor], base: PublishedState,
               internet: Internet | None) -> dict[str, Any]:
    sync = SyncConfig(peer_exchange=(variant == "swarm"), chunks_per_update=args.chunks,
                      parallel_fetches=args.parallel_fetches)
    layers = max(1, round(LAYERS * args.scale))
    began = time.perf_counter()
    nodes, relays = start_nodes(count, args, internet)
    servers: list[Any] = []
    try:
        owner = nodes[0].peer_id  # the publisher's node plays the run's owner
        for node in nodes:
            node.dht_storage.join(RunNamespace(RUN, owner, 1, ANNOUNCE_TTL_S / 5))
        announce_replicas(nodes[1:], layers)
        for node in nodes:
            authority = RunAuthority(node, RUN, owner, 0)
            node.run(authority.refresh(), timeout=30)
            node.authorize = authority.check
        current = {name: t.clone() for name, t in weights.items()}
        publisher = WeightPublisher(nodes[0], RUN, 0, sync, 0, current,
                                    timeout_s=SYNC_TIMEOUT_S)
        servers.append(publisher)
        followers = []
        for node in nodes[1:]:
            # Every replica starts from the same weights, each with its own copy (the hash is
            # the same for all: computed once).
            state = PublishedState(0, {n: t.clone() for n, t in base.tensors.items()}, base.hash)
            follower = TimedFollower(node, RUN, 0, sync, state, lambda *a: None,
                                     timeout_s=60, ban_s=30, owner=owner)
            follower.commit = follower.record_commit
            followers.append(follower)
            servers.append(follower)
        print(f"  {variant} x{count}: {count + 1} nodes up in {time.perf_counter() - began:.0f}s",
              flush=True)
        generator = torch.Generator().manual_seed(args.seed + 1)
        updates = []
        with ThreadPoolExecutor(max_workers=count, thread_name_prefix="follow") as pool:
            for version in range(1, args.warmup + args.updates + 1):
                announce_replicas(nodes[1:], layers)
                row = measure_update(publisher, followers, current, version, generator, pool)
                timed = version > args.warmup
                print(f"  {variant} x{count} v{version}{'' if timed else ' (warm-up)'}: "
                      f"{row['bytes']:,} bytes, delivered {row['delivered_s']:.2f}s, applied "
                      f"{row['applied_s']:.2f}s (separate machines ~{row['separate_s']:.2f}s), "
                      f"publisher sent {row['publisher_sent'] / row['bytes']:.2f}x, "
                      f"{row['from_publisher']:.0%} of replica bytes from the publisher, "
                      f"encode {row['encode_s']:.2f}s"
                      + (f", {row['circuits']} fresh circuits, {row['cut']} calls cut"
                         if internet else "")
                      + (f", extra syncs {sum(row['retries'])}" if any(row['retries']) else ""),
                      flush=True)
                if timed:
                    updates.append(row)
        bad_chunks = sum(f.sources.bad_chunks for f in followers)
    finally:
        for server in servers:
            try:
                server.close()
            except Exception as error:  # noqa: BLE001 - shutting down anyway
                print(f"  close: {error}", flush=True)
        for node in nodes + relays:
            node.shutdown()
    size = statistics.median(u["bytes"] for u in updates)
    return {
        "replicas": count, "variant": variant, "updates": updates, "bad_chunks": bad_chunks,
        "bytes": size,
        "delivered_s": statistics.median(u["delivered_s"] for u in updates),
        "applied_s": statistics.median(u["applied_s"] for u in updates),
        "separate_s": statistics.median(u["separate_s"] for u in updates),
        "planned_s": statistics.median(u["planned_s"] for u in updates),
        "publisher_ratio": statistics.median(u["publisher_sent"] / u["bytes"] for u in updates),
        "received_ratio": statistics.median(statistics.fmean(u["received"]) / u["bytes"]
                                            for u in updates),
        "sent_ratio": statistics.median(max(u["sent"]) / u["bytes"] for u in updates),
        "apply_cpu_s": statistics.median(statistics.fmean(u["apply_cpu_s"]) for u in updates),
        "encode_s": statistics.median(u["encode_s"] for u in updates),
        "circuits": statistics.median(u["circuits"] for u in updates),
        "cut": sum(u["cut"] for u in updates),
    }


# ---- main ---------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    weights = initial_weights(args.scale, args.seed)
    base = PublishedState.of(0, weights)
    params = base.numel()
    print(f"stage: {len(weights)} tensors, {params:,} parameters "
          f"({4 * params / 2**20:,.0f} MiB float32 per replica)", flush=True)
    results = []
    with contextlib.ExitStack() as stack:
        internet = stack.enter_context(Internet.start(["relay"], [
            HomeSpec([name], args.uplink_mbps) for name in
            ["publisher", *(f"replica{i}" for i in range(max(args.replicas)))]])) \
            if args.netns else None
        for count in args.replicas:
            for variant in args.variants:
                results.append(run_config(count, variant, args, weights, base, internet))
                gc.collect()
    report(results, args, params)


def report(results: list[dict[str, Any]], args: argparse.Namespace, params: int) -> None:
    uplink = args.uplink_mbps * 1e6
    rows, figures = [], {}
    for r in results:
        rows.append([f"{r['variant']} x{r['replicas']}", float(r["bytes"]), r["publisher_ratio"],
                     r["sent_ratio"], r["planned_s"], r["delivered_s"], r["applied_s"],
                     r["separate_s"], r["apply_cpu_s"]]
                    + ([float(r["circuits"]), float(r["cut"])] if args.netns else []))
        key = f"{r['variant']}_n{r['replicas']}"
        figures[f"{key}_delivered_s"] = r["delivered_s"]
        figures[f"{key}_applied_s"] = r["applied_s"]
        figures[f"{key}_publisher_ratio"] = r["publisher_ratio"]
    received = [r["received_ratio"] for r in results]
    one_copy = statistics.median(r["bytes"] for r in results) * 8 / uplink
    dense_s = {n: n * 2 * params * 8 / uplink for n in args.replicas}
    machine = common.machine(torch.device("cpu"))
    caption = (f"median of {args.updates} updates after {args.warmup} warm-up; {params:,} "
               f"float32 parameters; density {SyncConfig().density:g}, {args.chunks} chunks an "
               f"update, {args.parallel_fetches} fetches in flight, one torch "
               f"thread per apply; "
               f"{'netns: every peer in a home behind NAT, through one relay; ' if args.netns else ''}"
               f"every node: {args.uplink_mbps:g} Mbit/s uplink, RTT "
               f"{args.rtt_ms[0]:g}-{args.rtt_ms[1]:g} ms + {args.jitter_ms:g} ms jitter. "
               f"pub. sent x: bytes the publisher sent over the update's bytes; sent x: the most "
               f"a replica sent, over the same (every replica received {min(received):.2f}-"
               f"{max(received):.2f} x); plan s: mean time to the start of the chunk fetches "
               f"(DHT lookups + plan request); est. sep. s: max over replicas of delivered + "
               f"apply CPU s. One copy of the update through one uplink: {one_copy:.2f} s\n"
               f"dense bf16 (computed, not measured: N x {2 * params:,} bytes x 8 / uplink from "
               f"the publisher): " + ", ".join(f"{n} replicas {s:,.0f} s"
                                               for n, s in dense_s.items()) + f"\n{machine}")
    common.print_table("update spread: time for one update to reach every replica", [
        "variant x N", "update bytes", "pub. sent x", "sent x", "plan s", "delivered s",
        "applied s", "est. sep. s", "apply CPU s"]
        + (["circuits", "cut"] if args.netns else []), rows, caption)
    for variant in args.variants:
        mine = {r["replicas"]: r for r in results if r["variant"] == variant}
        if len(mine) > 1:
            low, high = min(mine), max(mine)
            growth = mine[high]["delivered_s"] / mine[low]["delivered_s"]
            figures[f"{variant}_delivered_growth"] = growth
            print(f"{variant}: delivered time x{growth:.2f} from {low} to {high} replicas")
    for n, s in dense_s.items():
        figures[f"dense_bf16_n{n}_s"] = s
    common.print_figures("update_spread", figures)
    if args.out and args.out != "none":
        plot(results, args, Path(args.out))
    common.write_json(args.json, {"bench": "update-spread", "args": vars(args), "params": params,
                                  "machine": machine, "dense_bf16_s": dense_s,
                                  "results": results, "figures": figures})


def plot(results: list[dict[str, Any]], args: argparse.Namespace, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for variant, color in (("swarm", "tab:blue"), ("star", "tab:orange")):
        mine = sorted((r for r in results if r["variant"] == variant), key=lambda r: r["replicas"])
        if not mine:
            continue
        counts = [r["replicas"] for r in mine]
        axes.plot(counts, [r["delivered_s"] for r in mine], marker="o", color=color,
                  label=f"{variant}: delivered")
        axes.plot(counts, [r["applied_s"] for r in mine], marker=".", color=color,
                  linestyle="--", label=f"{variant}: applied (applies share 2 cores)")
    axes.set_xscale("log", base=2)
    axes.set_xticks(args.replicas, [str(n) for n in args.replicas])
    axes.set_xlabel("replicas of the stage")
    axes.set_ylabel("seconds until the last replica has the update")
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend()
    axes.set_title(f"one update to every replica, {args.uplink_mbps:g} Mbit/s uplinks")
    common.save_figure(figure, path)


if __name__ == "__main__":
    main()

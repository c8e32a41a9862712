"""Stage plans from what the training peers offer.

A run whose config leaves `stage_layers` to its owner may have the owner plan them from its
peers: each admitted training peer, while it waits for the run's manifest, announces a signed
`HostOffer` (its memory and measured speed, launch/offer.py) under a key only it may write. The
owner reads the offers of the peers it admitted and nobody else's (a stranger with a thousand
keys plans nothing), waits until there is one for every stage, and hands out the layers with
model/planner.py `plan_stages`: each stage as many layers as its peer's memory holds for the
role (full training, or the frozen base of a LoRA run) and its speed's share of the pipeline.
The two peers with the most memory take the first and the last stage, which also hold the
embeddings and the head. The manifest then names the planned layers and, per stage, the peer
planned for it (`RunManifest.planned`), which takes that stage. The plan is kept in the run's
folder (`RUN/stage_plan.json`): a resumed run keeps it, since its checkpoints are per stage."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from decentrl.config import RunConfig
from decentrl.coordinator.manifest import admitted_peers
from decentrl.model.loading import model_spec, resolve_model
from decentrl.model.planner import PlanChoice, StageHost, plan_stages
from decentrl.model.spec import ModelSpec
from decentrl.net.node import SwarmNode
from decentrl.net.protocol import HostOffer, offer_key
from decentrl.net.records import decode_records

log = logging.getLogger(__name__)

MIB = 2**20
# What a peer's process takes beside its weights: measured on the 8B shape's --role both peers,
# 0.5-0.55 GiB (bench/README.md, big_shape), with room for a training step's activations.
PEER_RESERVE_BYTES = 768 * MIB
LOOKUP_TIMEOUT_S = 30.0
PLAN_FILE = "stage_plan.json"


@dataclass(frozen=True)
class OfferPlan:
    """The plan made from `offers`: `choice` (layers per stage and why), `peers` (the training
    peer planned for each stage) and what each offered."""

    choice: PlanChoice
    peers: tuple[str, ...]
    offers: tuple[HostOffer, ...]

    def describe(self) -> str:
        return "\n".join(f"{reason} (peer {peer[-8:]}: {offer.memory_mb} MiB, "
                         f"{offer.speed:.1f} GFLOP/s)"
                         for reason, peer, offer in zip(self.choice.reasons, self.peers,
                                                        self.offers, strict=True))


def planning_role(config: RunConfig) -> str:
    """What a training peer of this run holds per parameter (model/planner.py
    BYTES_PER_PARAMETER): a LoRA run's frozen base, or full training's master and moments."""
    if config.train.lora_rank > 0:
        return "lora-int8" if config.train.lora_base == "int8" else "lora"
    return "training"


def read_offers(node: SwarmNode, run: str, peers: Iterable[str]) -> dict[str, HostOffer]:
    """The offers that `peers` announced for `run`, by peer: each read from its own key and
    signed by it (a record anyone else wrote there is not read, net/dht_storage.py refuses to
    keep it); one of another run, malformed, or offering no memory or a speed that is not a
    positive number, is left out."""
    peers = list(peers)

    async def lookups() -> list[dict[str, bytes]]:
        async def one(peer: str) -> dict[str, bytes]:
            try:
                return await asyncio.wait_for(node.lookup(offer_key(peer)), LOOKUP_TIMEOUT_S)
            except TimeoutError:
                return {}  # not found this round
        return list(await asyncio.gather(*(one(peer) for peer in peers)))

    found: dict[str, HostOffer] = {}
    for peer, entries in zip(peers, node.run(lookups(), timeout=2 * LOOKUP_TIMEOUT_S),
                             strict=True):
        offers, _ = decode_records({w: b for w, b in entries.items() if w == peer}, HostOffer)
        offer = offers.get(peer)
        if offer is not None and offer.run == run and offer.memory_mb > 0 \
                and math.isfinite(offer.speed) and offer.speed > 0:
            found[peer] = offer
    return found


def plan_from_offers(spec: ModelSpec, config: RunConfig, offers: dict[str, HostOffer]
                     ) -> OfferPlan:
    """The plan for `config.num_stages` stages from `offers` (at least that many): the peers
    with the most memory are used (ties by peer id, so that every reading plans alike), the two
    largest at the ends. PlanError (a ValueError) where the model does not fit them."""
    stages = config.num_stages
    if len(offers) < stages:
        raise ValueError(f"{len(offers)} training peers offered, the run has {stages} stages")
    chosen = sorted(offers, key=lambda peer: (-offers[peer].memory_mb, peer))[:stages]
    # The largest two at the ends (embeddings, head), the others between them, largest first.
    order = [chosen[0], *chosen[2:], chosen[1]] if stages > 1 else chosen
    hosts = [StageHost(offers[peer].memory_mb * MIB, offers[peer].speed, PEER_RESERVE_BYTES)
             for peer in order]
    choice = plan_stages(spec, hosts, planning_role(config))
    return OfferPlan(choice, tuple(order), tuple(offers[peer] for peer in order))


def wait_for_offers(node: SwarmNode, config: RunConfig, admitted: Callable[[], frozenset[str]],
                    timeout_s: float, stop: threading.Event | None = None,
                    clock: Callable[[], float] = time.monotonic) -> dict[str, HostOffer]:
    """The admitted training peers' offers once there is one for every stage (`admitted` is
    read again each round: the operator may admit peers meanwhile). TimeoutError naming how
    many offered after `timeout_s`."""
    deadline = clock() + timeout_s
    seen = 0
    while True:
        offers = read_offers(node, config.name, sorted(admitted()))
        if len(offers) >= config.num_stages:
            return offers
        if len(offers) != seen:
            seen = len(offers)
            log.info("%d of %d stages' offers so far", seen, config.num_stages)
        if clock() >= deadline or (stop is not None and stop.is_set()):
            raise TimeoutError(
                f"{len(offers)} of the run's admitted training peers offered within "
                f"{timeout_s:.0f}s; planning {config.num_stages} stages needs one a stage (start "
                "them with --role training or both, and admit them)")
        (stop or threading.Event()).wait(min(1.0, config.swarm.announce_every_s))


@dataclass(frozen=True)
class PlannedRun:
    """A run's config with its stage plan, the peer planned for each stage, and the plan made
    from the offers (None where the plan was kept from the run's first start)."""

    config: RunConfig
    peers: list[str]
    made: OfferPlan | None


def kept_plan(path: Path, num_stages: int) -> tuple[tuple[int, ...], list[str]]:
    """The layers per stage and the peer per stage that `path` (RUN/stage_plan.json) keeps;
    ValueError naming the file where it is not a plan of `num_stages` stages."""
    try:
        kept = json.loads(path.read_text())
        layers, peers = kept["stage_layers"], kept["peers"]
        valid = isinstance(layers, list) and isinstance(peers, list) \
            and len(layers) == num_stages and len(peers) <= num_stages \
            and all(isinstance(n, int) and n > 0 for n in layers) \
            and all(isinstance(peer, str) for peer in peers)
    except (ValueError, TypeError, KeyError) as error:
        raise ValueError(f"{path} is not a stage plan: {error!r}; delete it to plan again") \
            from None
    if not valid:
        raise ValueError(f"{path} is not a plan of {num_stages} stages (stage_layers: positive "
                         "layer counts, one a stage; peers: peer ids); delete it to plan again")
    return tuple(layers), list(peers)


def planned_run(node: SwarmNode, config: RunConfig, console: Console, wait_s: float
                ) -> PlannedRun:
    """`config` with the stage plan of its run: the one kept in its folder (a resumed run), or
    one planned now from the admitted training peers' offers on `node` (the owner's), kept for
    the next start."""
    if config.stage_layers:
        raise ValueError("planning from offers needs a config without stage_layers (the "
                         "planner chooses them)")
    path = config.path / PLAN_FILE
    if path.is_file():
        layers, peers = kept_plan(path, config.num_stages)
        console.print(f"stage plan kept from the run's first start ({path}): {list(layers)}",
                      highlight=False)
        return PlannedRun(config.model_copy(update={"stage_layers": layers}), peers, None)
    console.print(f"waiting up to {wait_s:.0f}s for an offer from an admitted training peer "
                  f"for each of the {config.num_stages} stages", highlight=False)
    offers = wait_for_offers(node, config, lambda: admitted_peers(config.path), wait_s)
    plan = plan_from_offers(model_spec(resolve_model(config.model)), config, offers)
    console.print(f"stages planned from the peers' offers:\n{plan.describe()}", highlight=False)
    layers = plan.choice.plan.stage_layers
    config.path.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"stage_layers": list(layers), "peers": list(plan.peers),
                                "why": list(plan.choice.reasons)}, indent=1))
    return PlannedRun(config.model_copy(update={"stage_layers": layers}), list(plan.peers),
                      plan)

"""Stage plans from the training peers' offers (coordinator/planning.py, launch/offer.py): the
admitted peers' own offers only, the largest two at the ends, the layers by memory and speed,
a clear refusal when too few offered, and a peer that leaves the plan to the owner takes it."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from decentrl.config import HostConfig, RunConfig, parse_config
from decentrl.coordinator import planning
from decentrl.coordinator.manifest import accept_manifest, admit, run_manifest
from decentrl.coordinator.planning import (
    PLAN_FILE,
    plan_from_offers,
    planned_run,
    planning_role,
    read_offers,
    wait_for_offers,
)
from decentrl.launch.offer import host_memory_mb, host_offer, measured_gflops
from decentrl.model.families import spec_from_hf_config
from decentrl.model.planner import PlanError, parameter_counts
from decentrl.model.spec import ModelSpec
from decentrl.net.dht_storage import BoundedDHTStorage
from decentrl.net.identity import Identity
from decentrl.net.protocol import HostOffer, offer_key
from decentrl.net.session import new_session
from decentrl.net.wire import encode_struct

MIB = 2**20
PEERS = sorted(Identity.generate().peer_id for _ in range(4))


@pytest.fixture(scope="module")
def wide(tiny_model_dir: Path) -> ModelSpec:
    """The tiny Llama at hidden 1024: a layer is tens of MiB to train, so offers in MiB cap."""
    config = json.loads((tiny_model_dir / "config.json").read_text())
    return spec_from_hf_config({**config, "hidden_size": 1024, "intermediate_size": 4096,
                                "num_attention_heads": 8, "num_key_value_heads": 8})


def config_of(model: Path, stages: int = 2, **train: Any) -> RunConfig:
    return parse_config({"model": str(model), "num_stages": stages, "train": train})


def offer(memory_mb: int, speed: float = 100.0, run: str = "run") -> HostOffer:
    return HostOffer(run=run, role="training", memory_mb=memory_mb, speed=speed)


def test_the_largest_offers_take_the_ends_and_memory_caps_a_stage(
        wide: ModelSpec, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(planning, "PEER_RESERVE_BYTES", 0)
    config = config_of(tiny_model_dir, stages=3)
    embed, head, layers = parameter_counts(wide)
    # Training: 18 bytes a parameter. The middle peer is the fastest, but holds one layer and a
    # half.
    middle = int(18 * 1.5 * layers[0]) // MIB
    ends = int(18 * (max(embed, head) + 4 * layers[0])) // MIB
    offers = {PEERS[0]: offer(ends + 1), PEERS[1]: offer(middle, 300.0), PEERS[2]: offer(ends),
              PEERS[3]: offer(middle - 10)}  # the smallest is left out
    plan = plan_from_offers(wide, config, offers)
    assert plan.peers == (PEERS[0], PEERS[1], PEERS[2])
    assert plan.choice.plan.stage_layers == (2, 1, 1)
    assert "capped by memory" in plan.choice.reasons[1]
    assert PEERS[1][-8:] in plan.describe().splitlines()[1]
    # Too little memory in all: the planner says what is missing.
    with pytest.raises(PlanError, match="layers"):
        plan_from_offers(wide, config, {p: offer(middle // 2) for p in PEERS})
    with pytest.raises(ValueError, match="2 training peers offered, the run has 3 stages"):
        plan_from_offers(wide, config, {p: offers[p] for p in PEERS[:2]})


def test_a_faster_peer_gets_more_layers_and_the_role_follows_the_run(
        wide: ModelSpec, tiny_model_dir: Path) -> None:
    config = config_of(tiny_model_dir)
    plan = plan_from_offers(wide, config, {PEERS[0]: offer(64_000, 300.0),
                                           PEERS[1]: offer(64_000, 100.0)})
    assert plan.choice.plan.stage_layers == (3, 1)
    assert planning_role(config) == "training"
    assert planning_role(config_of(tiny_model_dir, lora_rank=8)) == "lora"
    assert planning_role(config_of(tiny_model_dir, lora_rank=8, lora_base="int8")) == "lora-int8"


class FakeNode:
    """Lookups answered from a table {key: {writer: body}}, as SwarmNode.lookup returns them."""

    def __init__(self, table: dict[str, dict[str, bytes]]) -> None:
        self.table = table
        self.peer_id = Identity.generate().peer_id
        self.dht_storage = BoundedDHTStorage()

    async def lookup(self, key: str) -> dict[str, bytes]:
        return self.table.get(key, {})

    def run(self, coroutine: Coroutine[Any, Any, Any], timeout: float) -> Any:
        return asyncio.run(coroutine)


def test_only_the_admitted_peers_own_offers_of_this_run_are_read() -> None:
    admitted, stranger = PEERS[:2], PEERS[2]
    table = {
        offer_key(admitted[0]): {admitted[0]: encode_struct(offer(4000))},
        # Someone else's record under an admitted peer's key, and an offer of another run.
        offer_key(admitted[1]): {stranger: encode_struct(offer(99_000))},
        offer_key(stranger): {stranger: encode_struct(offer(99_000))},
    }
    node: Any = FakeNode(table)
    assert read_offers(node, "run", admitted) == {admitted[0]: offer(4000)}
    table[offer_key(admitted[1])] = {admitted[1]: encode_struct(offer(4000, run="other"))}
    assert read_offers(node, "run", admitted) == {admitted[0]: offer(4000)}
    table[offer_key(admitted[1])] = {admitted[1]: b"\x00garbage"}
    assert read_offers(node, "run", admitted) == {admitted[0]: offer(4000)}
    for speed in (float("inf"), float("nan"), 0.0):
        table[offer_key(admitted[1])] = {admitted[1]: encode_struct(offer(4000, speed))}
        assert read_offers(node, "run", admitted) == {admitted[0]: offer(4000)}


def test_waiting_for_offers_ends_with_a_clear_error(tiny_model_dir: Path) -> None:
    config = config_of(tiny_model_dir)
    node: Any = FakeNode({offer_key(PEERS[0]): {PEERS[0]: encode_struct(
        offer(4000, run=config.name))}})
    now = [0.0]

    def clock() -> float:
        now[0] += 10.0
        return now[0]

    with pytest.raises(TimeoutError, match="1 of the run's admitted training peers offered "
                                           "within 30s; planning 2 stages"):
        wait_for_offers(node, config, lambda: frozenset(PEERS[:2]), timeout_s=30, clock=clock)
    node.table[offer_key(PEERS[1])] = {PEERS[1]: encode_struct(
        offer(4000, run=config.name))}
    assert set(wait_for_offers(node, config, lambda: frozenset(PEERS[:2]), timeout_s=30,
                               clock=clock)) == set(PEERS[:2])


def test_a_host_offers_its_limit_or_its_memory_and_a_measured_speed() -> None:
    cpu = torch.device("cpu")
    assert host_memory_mb(HostConfig(memory_limit_mb=3000), cpu) == 3000
    assert host_memory_mb(HostConfig(), cpu) > 0
    assert measured_gflops(cpu, torch.float32) > 0
    made = host_offer("run", "both", HostConfig(memory_limit_mb=2048, device="cpu"))
    assert (made.run, made.role, made.memory_mb) == ("run", "both", 2048) and made.speed > 0


def test_a_peer_that_leaves_the_plan_to_the_owner_takes_the_owners(tiny_model_dir: Path
                                                                   ) -> None:
    owner = parse_config({"model": str(tiny_model_dir), "num_stages": 2,
                          "stage_layers": [3, 1]})
    manifest = run_manifest(owner, [], new_session(), planned=PEERS[:2])
    assert manifest.planned == PEERS[:2]
    peer = config_of(tiny_model_dir)
    assert accept_manifest(manifest, peer).stage_layers == (3, 1)
    # A peer with a plan of its own is another run.
    with pytest.raises(ValueError, match="this peer's config differs"):
        accept_manifest(manifest, parse_config({"model": str(tiny_model_dir), "num_stages": 2,
                                                "stage_layers": [2, 2]}))


def test_a_run_keeps_the_plan_of_its_first_start(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = parse_config({"model": str(tiny_model_dir), "num_stages": 2,
                           "host": {"run_dir": str(tmp_path)}})
    admit(config.path, PEERS[:2])
    node: Any = FakeNode({offer_key(peer): {peer: encode_struct(
        offer(64_000, speed, run=config.name))} for peer, speed in zip(PEERS, (300.0, 100.0))})
    console = Console(file=io.StringIO())
    first = planned_run(node, config, console, wait_s=5)
    assert first.made is not None and first.config.stage_layers == (3, 1)
    assert first.peers == [PEERS[0], PEERS[1]]
    assert json.loads((config.path / PLAN_FILE).read_text())["stage_layers"] == [3, 1]
    # Resumed: the same plan, though nobody offers now (its checkpoints are per stage).
    node.table.clear()
    again = planned_run(node, config, console, wait_s=5)
    assert (again.config.stage_layers, again.peers, again.made) == ((3, 1), first.peers, None)
    with pytest.raises(ValueError, match="needs a config without stage_layers"):
        planned_run(node, first.config, console, wait_s=5)
    # A kept plan that is not one is refused by its file's name, not planned over.
    for broken in ("{", '{"stage_layers": [4], "peers": []}',
                   '{"stage_layers": [3, 0], "peers": []}', '{"peers": []}'):
        (config.path / PLAN_FILE).write_text(broken)
        with pytest.raises(ValueError, match=f"{PLAN_FILE} is not a"):
            planned_run(node, config, console, wait_s=5)

"""An inference replica's weights: it follows its stage's training peer, the publisher the run
owner's signed lineage names (`WeightFollower`, sync/distribute.py), fetching each update from the other replicas as much as from the publisher,
checking it, and writing it into the served model between two inference requests (the compute
thread runs one at a time), so generations in flight go on. It keeps the undo information of its
last updates, so it can rewind to a version a rollout recorded (spot-checks). A replica that
joins mid-run catches up before serving.

`ServedWeights` is that model with its undo history. A training peer keeps one too, beside its
learner, updated with each state it publishes (trust.training_peer_verifies): what its replicas
serve at version v is exactly its published state at v, so it can re-execute their work."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping

import torch

from decentrl.config import RunConfig
from decentrl.model.lora import has_lora, lora_tensors
from decentrl.model.stages import StageModule
from decentrl.net.node import SwarmNode
from decentrl.sync.delta import PublishedState, TensorChange
from decentrl.sync.distribute import WeightFollower
from decentrl.sync.history import UpdateHistory

log = logging.getLogger(__name__)


def published_tensors(stage: StageModule) -> dict[str, torch.Tensor]:
    """What a stage's replicas receive: the adapters in LoRA mode (the rest never changes),
    else every tensor."""
    return lora_tensors(stage) if has_lora(stage) else stage.state_dict()


class ServedWeights:
    """A stage's weights as its replicas serve them (each entry the serving dtype's cast of the
    published float32 value) at `model.version`, with the undo information of the last `keep`
    updates, so a spot-check can re-execute at a version a rollout recorded."""

    def __init__(self, model: StageModule, keep: int) -> None:
        self.model = model
        self.history = UpdateHistory(keep)
        # A replica writes updates and re-executes on its compute thread, one at a time; a
        # training peer's publisher writes its updates from the encoding thread instead.
        self.lock = threading.Lock()

    def commit(self, version: int, changes: Mapping[str, TensorChange]) -> None:
        """Write a checked update (a replica: on the compute thread, between requests)."""
        params = self.model.state_dict()
        with self.lock, torch.no_grad():
            for name, change in changes.items():
                change.write(params[name], change.values)
            self.model.version = version
            self.history.record(version, changes)

    def take(self, state: PublishedState, changes: Mapping[str, TensorChange] | None) -> None:
        """A publisher's new state (`WeightPublisher.on_published`): its update's changes, or,
        with None, the whole state (a rollback or a dense update; nothing before it can be
        rewound)."""
        if changes is not None:
            self.commit(state.version, changes)
            return
        params = self.model.state_dict()
        with self.lock, torch.no_grad():
            for name, tensor in state.tensors.items():
                params[name].copy_(tensor)
            self.model.version = state.version
            self.history.clear()

    @contextlib.contextmanager
    def rewound(self, version: int) -> Iterator[StageModule]:
        """The model with the weights of `version` for the duration of the context, restored
        exactly on exit; VersionUnavailable (sync/history.py) before anything is written if that
        version is out of reach."""
        with self.lock, self.history.rewound(self.model.state_dict(), self.model.version,
                                             version):
            yield self.model


class ReplicaWeights:
    def __init__(self, config: RunConfig, stage: int, node: SwarmNode, model: StageModule,
                 published: PublishedState, announce: Callable[[], Awaitable[None]],
                 name: str, owner: str) -> None:
        """`published`: the exact float32 version-0 state every peer of the stage builds from
        the same file; `model` serves a copy of it in the compute dtype. `announce` tells the
        directory the new version at once. `owner`: the run owner's peer id, whose signed
        lineage says which updates to take."""
        self.config, self.stage, self.name = config, stage, name
        self.announce = announce
        self.served = ServedWeights(model, config.trust.history_versions)
        self.follower = WeightFollower(node, config.name, stage, config.sync, published,
                                       self.served.commit, config.swarm.request_timeout_s,
                                       config.swarm.avoid_failed_peer_s, owner)
        self.error: str | None = None  # the last failed round's, until one succeeds

    async def follow(self) -> bool:
        """Catch up with the stage's publisher (a rolled-back training peer publishes an older
        version, and replicas follow it); True if the served weights changed."""
        if not await self.follower.sync_once():
            return False
        await self.announce()  # the directory learns the new version now, not next round
        log.info("%s: stage %d weights v%d", self.name, self.stage, self.served.model.version)
        return True

    async def follow_forever(self) -> None:
        while True:
            # A peer asking for a chunk of a newer update (even during this round) wakes the
            # loop before the next round.
            self.follower.wake.clear()
            try:
                await self.follow()
                self.error = None
            except Exception as error:  # noqa: BLE001 - retried next round
                self.error = str(error)
                log.warning("%s: weight update failed: %s", self.name, error)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.follower.wake.wait(),
                                       self.config.swarm.announce_every_s / 2)

    def close(self) -> None:
        self.follower.close()

"""An inference replica's weights: it follows its stage's training peer, the publisher the run
owner's signed lineage names (`WeightFollower`, sync/distribute.py), fetching each update from the other replicas as much as from the publisher,
checking it, and writing it into the served model between two inference requests (the compute
thread runs one at a time), so generations in flight go on. It keeps the undo information of its
last updates, so it can rewind to a version a rollout recorded (spot-checks). A replica that
joins mid-run catches up before serving."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

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


class ReplicaWeights:
    def __init__(self, config: RunConfig, stage: int, node: SwarmNode, model: StageModule,
                 published: PublishedState, announce: Callable[[], Awaitable[None]],
                 name: str, owner: str) -> None:
        """`published`: the exact float32 version-0 state every peer of the stage builds from
        the same file; `model` serves a copy of it in the compute dtype. `announce` tells the
        directory the new version at once. `owner`: the run owner's peer id, whose signed
        lineage says which updates to take."""
        self.config, self.stage, self.model, self.name = config, stage, model, name
        self.announce = announce
        self.history = UpdateHistory(config.trust.history_versions)
        self.follower = WeightFollower(node, config.name, stage, config.sync, published,
                                       self._commit_update, config.swarm.request_timeout_s,
                                       config.swarm.ban_s, owner)
        self.error: str | None = None  # the last failed round's, until one succeeds

    async def follow(self) -> bool:
        """Catch up with the stage's publisher (a rolled-back training peer publishes an older
        version, and replicas follow it); True if the served weights changed."""
        if not await self.follower.sync_once():
            return False
        await self.announce()  # the directory learns the new version now, not next round
        log.info("%s: stage %d weights v%d", self.name, self.stage, self.model.version)
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

    def _commit_update(self, version: int, changes: dict[str, TensorChange]) -> None:
        """Write a checked update into the served model (compute thread, between requests)."""
        params = self.model.state_dict()
        with torch.no_grad():
            for name, change in changes.items():
                change.write(params[name], change.values)
        self.model.version = version
        self.history.record(version, changes)

    def close(self) -> None:
        self.follower.close()

"""Who may call what on a peer: the `callers` column of the RPC table (net/protocol.py), enforced
by the wrapper every handler is served through (net/guard.py, its policy `Guard.authorize`,
`SwarmNode.authorize`) before a request's body is read or its handler runs.

- "any peer": everyone (the rollout inbox; what it admits is the trust gate's business).
- "coordinator": the run's owner only, the peer whose key is the run's identity: training,
  checkpoints, the published-state query, inference sessions and spot-checks. A stranger that
  sends one gets a strike.
- "same stage": the owner and the peers announced in the stage this peer serves (their DHT
  announcements are signed by themselves, net/records.py): a stage's replicas fetch weight
  updates from each other and from the stage's publisher. Anyone may announce itself as an
  inference replica, so this rule keeps strangers off a stage's bandwidth, not out of the swarm.
  A caller the peer does not know yet waits for the peer to look its stage up again (one lookup
  at a time, at most one a second, shared by every caller that arrived before it started, so
  strangers calling in a loop cannot turn every request into a DHT search): a replica that just
  joined gets through; a stranger is refused, without a strike (it may be a replica whose
  announcement has not spread yet).
- "previous stage": the owner and the peers announced in the stage before this one (a pushed
  activation, stage/push.py; at stage 0 the owner only). Which of them may push into a session
  is the owner's signed route's business, checked once the request is read.

A node with no authority set serves "any peer" RPCs only (`only_any_peer`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from decentrl.errors import DecentrlError, SenderFault
from decentrl.net.identity import public_key_of
from decentrl.net.protocol import PeerRecord, Rpc, stage_key
from decentrl.net.records import decode_records

log = logging.getLogger(__name__)

# The quickest a peer looks its stage up again after an unknown caller: a stranger that calls in
# a loop must not turn every request into a DHT search.
MEMBER_REFRESH_S = 1.0

# Who may call what: awaited with (sender, rpc) before any of a request is read; raises
# CallerRefused (a strike) or CallerUnknown (none) to refuse it. Called on the node's loop.
CallerPolicy = Callable[[str, Rpc[Any, Any]], Awaitable[None]]


class CallerRefused(SenderFault):
    """A request its sender may not make (the RPC's callers rule): refused before it is read,
    and a strike."""


class CallerUnknown(DecentrlError, RuntimeError):
    """A request from a sender the callers rule does not know yet (a peer that just joined its
    stage): refused before it is read, not a strike."""


async def only_any_peer(sender: str, rpc: Rpc[Any, Any]) -> None:
    """A node's callers policy until it serves a run: RPCs for "any peer" only."""
    if rpc.callers != "any peer":
        raise CallerRefused(f"{rpc.method} is refused: this node serves no run")


class RecordLookup(Protocol):
    """Where the stage's announced peers are looked up (a SwarmNode)."""

    async def lookup(self, key: str) -> dict[str, bytes]: ...


class RunAuthority:
    """The callers rule of every RPC on a peer of run `run` serving `stage`, whose owner is the
    peer id `owner`."""

    def __init__(self, node: RecordLookup, run: str, owner: str, stage: int) -> None:
        public_key_of(owner)  # a SignatureError (ValueError) names a malformed owner id
        self.node, self.run, self.owner, self.stage = node, run, owner, stage
        self.members: frozenset[str] = frozenset()
        self.previous_members: frozenset[str] = frozenset()  # of stage - 1
        self._looked_up = float("-inf")
        self._lookup_lock = asyncio.Lock()

    async def check(self, sender: str, rpc: Rpc[Any, Any]) -> None:
        """Raise CallerRefused (a strike) or CallerUnknown (none) unless `sender` may call `rpc`
        here. Runs on the node's loop."""
        rule = rpc.callers
        if rule == "any peer" or sender == self.owner:
            return
        if rule == "coordinator" or (rule == "previous stage" and self.stage == 0):
            raise CallerRefused(f"{rpc.method} is for the run's coordinator "
                                f"({self.owner[-8:]}) only, not for {sender[-8:]}")
        stage = self.stage if rule == "same stage" else self.stage - 1
        if sender not in self.members_of(stage):
            arrived = time.monotonic()
            async with self._lookup_lock:  # unknown callers wait for one lookup together
                if sender not in self.members_of(stage) and self._looked_up < arrived:
                    await asyncio.sleep(self._looked_up + MEMBER_REFRESH_S - time.monotonic())
                    await self.refresh()
        if sender not in self.members_of(stage):
            raise CallerUnknown(f"{rpc.method} is for the coordinator and the peers announced "
                                f"in stage {stage}; {sender[-8:]} is not announced there")

    def members_of(self, stage: int) -> frozenset[str]:
        """The peers announced in `stage` (this one's or the one before) at the last lookup."""
        return self.members if stage == self.stage else self.previous_members

    async def refresh(self) -> None:
        """Look the announced peers of this stage and of the one before up again (from the
        node's loop)."""
        self._looked_up = time.monotonic()
        self.members = await self._announced(self.stage)
        if self.stage > 0:
            self.previous_members = await self._announced(self.stage - 1)

    async def _announced(self, stage: int) -> frozenset[str]:
        found, _ = decode_records(await self.node.lookup(stage_key(self.run, stage)),
                                  PeerRecord, stage)
        return frozenset(found)

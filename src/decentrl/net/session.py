"""A run's session: a nonce the coordinator draws at each start (a resumed run draws a new one).

A signature proves who wrote a record, not when. The owner's records live in the DHT for their
lifetime (minutes, renewed while the owner runs), and anyone who kept a signed copy can store it
again until it expires: read by a resumed run's peers, the record of an earlier start would act on a
run it was never about (stop its peers, name a publisher and weights of the old chain). So the
owner's manifest carries the session (`RunManifest.session`), every other record the owner signs for
the run names it (`RunEnded`, `LineageRecord`), and a reader takes such a record only while its
session is the one of the owner's newest manifest (`session_mismatch`). The DHT keeps one record per
writer under a key, the one that expires last, and an expiry is signed too: a replayed manifest of
an earlier start cannot replace the one the owner renews.

A stage peer reads the manifest's session every announce round (`OwnerSession`), and again, at
once, when the owner signs a route of another session: a resumed run's first route may reach a
peer before its next round does."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable

from decentrl.net.node import SwarmNode
from decentrl.net.protocol import RunManifest, coordinator_key
from decentrl.net.wire import WireError, decode_struct

log = logging.getLogger(__name__)

# 128 random bits: no two starts of a run draw the same session.
SESSION_BYTES = 16


def new_session() -> str:
    return secrets.token_hex(SESSION_BYTES)


async def owner_session(node: SwarmNode, run: str, owner: str) -> str | None:
    """The session of the manifest `owner` signs for `run` now; None while there is none that
    decodes and names `run` (whatever anyone else wrote under the run's key is not read)."""
    raw = (await node.lookup(coordinator_key(run))).get(owner)
    if raw is None:
        return None
    try:
        manifest = decode_struct(raw, RunManifest)
    except WireError:
        return None
    return manifest.session if manifest.run == run else None


def session_mismatch(kind: str, session: str, current: str) -> str | None:
    """Why an owner's record of `session` is ignored by a reader in session `current`, or None
    when it is this session's."""
    if session == current:
        return None
    return (f"the owner's {kind} of session {session[:8]} is ignored: the run's manifest is of "
            f"session {current[:8]} (a record signed at an earlier start of the run)")


class OwnerSession:
    """The session of the owner's newest manifest for a run, as this peer last read it (None
    until a read found one). Only owner-signed records make it read again out of turn, at most
    once per `min_gap_s`: a replayed route of an earlier start costs one DHT lookup a round."""

    def __init__(self, node: SwarmNode, run: str, owner: str, min_gap_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.node, self.run, self.owner = node, run, owner
        self.min_gap_s, self.clock = min_gap_s, clock
        self.current: str | None = None
        self._read_at: float | None = None
        self._reading = asyncio.Lock()  # one read at a time; the others take its answer

    async def refresh(self) -> str | None:
        """Read the owner's manifest now (a failed or empty read keeps what was known)."""
        async with self._reading:
            await self._read()
        return self.current

    async def against(self, session: str) -> str | None:
        """The session an owner-signed record of `session` is checked against: the one known,
        read again first where it differs from `session` and the last read is `min_gap_s` old."""
        if self.current is None or self.current == session:
            return self.current
        async with self._reading:
            if self._read_at is None or self.clock() - self._read_at >= self.min_gap_s:
                await self._read()
        return self.current

    async def _read(self) -> None:
        self._read_at = self.clock()
        try:
            found = await owner_session(self.node, self.run, self.owner)
        except Exception as error:  # noqa: BLE001 - a lookup that failed keeps what was known
            log.info("the manifest of run %r could not be read: %s", self.run, error)
            return
        if found is not None:
            self.current = found

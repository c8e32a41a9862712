"""A run's session: a nonce the coordinator draws at each start (a resumed run draws a new one).

A signature proves who wrote a record, not when. The owner's records live in the DHT for their
lifetime (minutes, renewed while the owner runs), and anyone who kept a signed copy can store it
again until it expires: read by a resumed run's peers, the record of an earlier start would act on a
run it was never about (stop its peers, name a publisher and weights of the old chain). So the
owner's manifest carries the session (`RunManifest.session`), every other record the owner signs for
the run names it (`RunEnded`, `LineageRecord`), and a reader takes such a record only while its
session is the one of the owner's newest manifest (`session_mismatch`). The DHT keeps one record per
writer under a key, the one that expires last, and an expiry is signed too: a replayed manifest of
an earlier start cannot replace the one the owner renews."""

from __future__ import annotations

import secrets

from decentrl.net.node import SwarmNode
from decentrl.net.protocol import RunManifest, coordinator_key
from decentrl.net.wire import WireError, decode_struct

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

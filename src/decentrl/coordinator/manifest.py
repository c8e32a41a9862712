"""A run's owner and what it declares.

The run's identity is its owner's key: the coordinator runs under `RUN/keys/owner.key` (made on
the first start, kept across restarts, so a resumed run is the same run to its peers). The owner
publishes a `RunManifest` (net/protocol.py) in the DHT under its own peer id: the run's config
(without the owner's host section: each peer brings its own) and its hash, the hash of each
model file (a peer hashes only the files its stage reads: an 8B model is 15 GiB), the stage plan,
the roster of admitted training peers and the session drawn at this start of the coordinator
(net/session.py). The record is signed
(net/records.py), and a peer reads it from the owner's subkey only, so nobody else can hand a peer
a config. The owner's `RunEnded` names the session it ends: a peer stops only for the session of
the owner's newest manifest, so the record of an earlier start (live for minutes, and anyone may
store a signed copy again) does not stop a resumed run.

Training peers are admitted by the run's operator, not by the swarm: `RUN/admitted.txt` lists
the peer ids allowed to train, one per line (`decentrl coordinate --admit ID` appends one; a
training peer prints its id when it starts, and keeps it across restarts with `--identity
FILE`). The coordinator reads the file each time it looks for a training peer, then checks the
candidate before it drives it: listed, announced for that stage, ready (client/training.py).
Anyone may join as an inference replica, and what a replica serves is checked (trust/); with
`trust.admit_replicas` only the replicas listed in `RUN/admitted_replicas.txt` (same format, read
at each announce round) get sessions, and they start with a record (no probation)."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from rich.console import Console
from rich.markup import escape

from decentrl.config import RunConfig, parse_config
from decentrl.errors import DecentrlError
from decentrl.model.loading import (
    file_hashes,
    model_files,
    model_layout_files,
    model_spec,
    resolve_model,
)
from decentrl.model.run_stage import StageSource
from decentrl.model.spec import ModelSpec
from decentrl.model.stages import StagePlan
from decentrl.net.dht_storage import MAX_RECORD_TTL_S, RunNamespace
from decentrl.net.identity import Identity, SignatureError, public_key_of
from decentrl.net.node import SwarmNode
from decentrl.net.protocol import RosterEntry, RunEnded, RunManifest, coordinator_key, ended_key
from decentrl.net.session import owner_session, session_mismatch
from decentrl.net.wire import WireError, decode_struct, encode_struct
from decentrl.progress import progress_bar

LOOKUP_TIMEOUT_S = 30.0
ADMITTED_FILE = "admitted.txt"
ADMITTED_REPLICAS_FILE = "admitted_replicas.txt"
# The manifest is one signed DHT record (64 KiB at most, net/records.py), about 110 bytes a
# model file: a model in more shards than this is re-saved in larger ones.
MAX_MODEL_FILES = 256


class ManifestMismatch(DecentrlError, ValueError):
    """The run's owner declares another config or model than this peer holds."""


def owner_identity(run_path: Path) -> Identity:
    """The run owner's key, made on the first start of the run."""
    return Identity.from_file(run_path / "keys" / "owner.key")


def check_peer_id(peer_id: str, where: str) -> str:
    """`peer_id` if it is an Ed25519 peer id (the only kind whose signatures we can check)."""
    try:
        public_key_of(peer_id)
    except SignatureError as error:
        raise ValueError(f"{where}: {peer_id!r} is not a peer id: {error}") from None
    return peer_id


def admitted_peers(run_path: Path, file: str = ADMITTED_FILE) -> frozenset[str]:
    """The peer ids `RUN/admitted.txt` admits as training peers (none if there is no file), or
    another list of the same format in the run's folder (`file`). Blank lines and `#` comments
    are skipped; anything else that is not a peer id is an error naming its line."""
    path = run_path / file
    if not path.is_file():
        return frozenset()
    admitted = set()
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        entry = line.split("#", 1)[0].strip()
        if entry:
            admitted.add(check_peer_id(entry, f"{path} line {number}"))
    return frozenset(admitted)


def admit(run_path: Path, peer_ids: list[str]) -> None:
    """Add peer ids to the run's admitted training peers."""
    for peer_id in peer_ids:
        check_peer_id(peer_id, "--admit")
    known = admitted_peers(run_path)
    new = [peer for peer in dict.fromkeys(peer_ids) if peer not in known]
    if new:
        run_path.mkdir(parents=True, exist_ok=True)
        with (run_path / ADMITTED_FILE).open("a") as file:
            file.writelines(f"{peer}\n" for peer in new)


def config_hash(config: RunConfig) -> str:
    """The run's identity: its settings without this host's (RunConfig.run_json)."""
    return hashlib.sha256(config.run_json().encode()).hexdigest()


def stage_layers(config: RunConfig, spec: ModelSpec) -> list[tuple[int, int]]:
    plan = StagePlan.of(spec.num_layers, config.num_stages, config.stage_layers)
    return [(plan.layers(stage).start, plan.layers(stage).stop)
            for stage in range(config.num_stages)]


def run_manifest(config: RunConfig, roster: list[RosterEntry], session: str,
                 planned: list[str] | None = None) -> RunManifest:
    """`session`: this start's (net/session.py `new_session`); `planned`: the training peer of
    each stage, where the stages were planned from the peers' offers."""
    folder = resolve_model(config.model)
    files = model_files(folder)
    if len(files) > MAX_MODEL_FILES:
        raise ValueError(f"model {config.model!r} is {len(files)} files, more than a run's "
                         f"manifest declares ({MAX_MODEL_FILES}): save it in larger shards "
                         "(save_pretrained(max_shard_size=...))")
    return RunManifest(run=config.name, config_json=config.run_json(),
                       config_hash=config_hash(config), model_files=file_hashes(files),
                       stages=stage_layers(config, model_spec(folder)), roster=roster,
                       session=session, planned=list(planned or []))


def publish_manifest(node: SwarmNode, manifest: RunManifest, ttl_s: float) -> None:
    """Announce `manifest` as its run's owner; the owner's node keeps its run's DHT records from
    now on (net/dht_storage.py)."""
    node.dht_storage.join(RunNamespace.of(parse_config(json.loads(manifest.config_json)),
                                          node.peer_id))
    node.run(node.announce(coordinator_key(manifest.run), encode_struct(manifest), ttl_s),
             timeout=LOOKUP_TIMEOUT_S)


def read_manifest(node: SwarmNode, run: str, owner: str) -> RunManifest | None:
    """The manifest the owner of `run` signed, or None while there is none. Whatever anyone
    else wrote under the run's key is not read at all."""
    return _owners_record(node, coordinator_key(run), owner, RunManifest, run)


def announce_run_end(node: SwarmNode, run: str, steps: int, session: str,
                     ttl_s: float = MAX_RECORD_TTL_S) -> None:
    """Tell the run's peers that its session `session` is over (they stop, unless they keep
    serving)."""
    record = RunEnded(run=run, steps=steps, session=session)
    node.run(node.announce(ended_key(run), encode_struct(record), ttl_s), timeout=LOOKUP_TIMEOUT_S)


@dataclass
class RunEndWatch:
    """A joined peer's watch for its owner's word that the run ended. `session`: the one the
    peer serves, the session of the owner's newest manifest (first the one it joined by, then
    each one the owner announced since: a coordinator restarted while the peer served);
    `ignored`: why each `RunEnded` of another session was ignored, once each (only the owner
    writes one, once per start of the run)."""

    run: str
    owner: str
    session: str
    ignored: list[str] = field(default_factory=list)

    def ended(self, node: SwarmNode) -> RunEnded | None:
        """The owner's `RunEnded` of the session the peer serves, or None. One of another session
        is added to `ignored` (the first time); one the owner signed for another run is refused
        (WireError); what anyone else wrote is not read."""
        self.session = node.run(owner_session(node, self.run, self.owner),
                                timeout=LOOKUP_TIMEOUT_S) or self.session
        ended = _owners_record(node, ended_key(self.run), self.owner, RunEnded, self.run)
        if ended is None:
            return None
        ignored = session_mismatch("RunEnded", ended.session, self.session)
        if ignored is None:
            return ended
        if ignored not in self.ignored:
            self.ignored.append(ignored)
        return None


OwnersRecord = TypeVar("OwnersRecord", RunManifest, RunEnded)


def _owners_record(node: SwarmNode, key: str, owner: str, kind: type[OwnersRecord],
                   run: str) -> OwnersRecord | None:
    """The record `owner` signed under `key`, or None; WireError if it names another run."""
    raw = node.run(node.lookup(key), timeout=LOOKUP_TIMEOUT_S).get(owner)
    if raw is None:
        return None
    record = decode_struct(raw, kind)
    if record.run != run:
        raise WireError(f"the owner's {kind.__name__} for run {run!r} names run {record.run!r}")
    return record


def wait_for_manifest(node: SwarmNode, run: str, owner: str, timeout_s: float,
                      stop: threading.Event, console: Console) -> RunManifest | None:
    """The owner's manifest of `run`, waited for at most `timeout_s`; None once `stop` is set."""
    waiting = f"waiting for the owner {owner[-8:]} of run {run!r} to announce it"
    console.print(f"{waiting} (up to {timeout_s:.0f}s)", markup=False, highlight=False)
    with progress_bar(console, escape(waiting), timeout_s, counted=False) as update:
        started = time.monotonic()
        while not stop.is_set() and (waited := time.monotonic() - started) < timeout_s:
            update(waited)
            manifest = read_manifest(node, run, owner)
            if manifest is not None:
                return manifest
            stop.wait(1.0)
    if stop.is_set():
        console.print("stopped before the run's owner announced it")
        return None
    raise TimeoutError(f"the owner {owner[-8:]} of run {run!r} announced nothing within "
                       f"{timeout_s:.0f}s: check the run name and the owner's peer id in the join "
                       "command the coordinator printed (it is also in the run folder's "
                       "join.txt), and that the coordinator is running")


def accept_manifest(manifest: RunManifest, config: RunConfig | None) -> RunConfig:
    """The config to join with: the manifest's, or `config` (the peer's own file) if it is the
    same run (its host section may differ: the manifest carries none). Raises ManifestMismatch
    if the peer's config or its copy of the model's config and index differ from what the owner
    declared (check_stage_files checks the shards, once the peer knows its stage)."""
    declared = parse_config(json.loads(manifest.config_json))
    if config_hash(declared) != manifest.config_hash:
        raise ManifestMismatch(f"the manifest of run {manifest.run!r} is inconsistent: its "
                               "config does not hash to the hash it declares")
    if config is not None and not config.stage_layers and declared.stage_layers:
        # A peer that leaves the stage plan to the owner takes the owner's (which it may have
        # planned from its peers' offers, coordinator/planning.py).
        config = config.model_copy(update={"stage_layers": declared.stage_layers})
    if config is not None and config_hash(config) != manifest.config_hash:
        raise ManifestMismatch(
            f"this peer's config differs from the one the owner of run {manifest.run!r} "
            f"declares (hash {config_hash(config)[:12]} here, {manifest.config_hash[:12]} "
            "there); join without --config to take the owner's")
    check_model_files(manifest, model_layout_files(resolve_model(declared.model)))
    return config if config is not None else declared


def check_stage_files(manifest: RunManifest, config: RunConfig, stage: int) -> None:
    """Raise ManifestMismatch unless the model files stage `stage` reads are the ones the owner
    declared: the shards of that stage's tensors only, each hashed once per process."""
    check_model_files(manifest, StageSource.of(config, stage).files())


def check_model_files(manifest: RunManifest, files: list[Path]) -> None:
    """Raise ManifestMismatch naming the first of this peer's `files` (read by name from its own
    folder, never from a name in the manifest) whose hash is not the one the owner declared."""
    declared = manifest.model_files
    for name, local in file_hashes(files).items():
        if name not in declared:
            raise ManifestMismatch(
                f"this peer's copy of the model has {name}, which the owner's does not (a "
                "model saved differently)")
        if declared[name] != local:
            raise ManifestMismatch(
                f"this peer's copy of the model differs from the owner's in {name} (hash "
                f"{local[:12]} here, {declared[name][:12]} there)")

"""The coordinator's durable run state. Every accepted rollout group, every training step and
every complete checkpoint is committed to SQLite before the coordinator acknowledges it, so a
coordinator that crashes and restarts resumes with no accepted group lost, no problem handed out
twice and no version skipped."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import msgspec

from decentrl.errors import DecentrlError
from decentrl.rollout.types import ScoredGroup

# 2: accepted groups carry the version spans of their tokens (rollout/types.py).
# 3: rollouts carry no decoded text, and every rollout struct refuses unknown fields.
SCHEMA_VERSION = 3
STATES = ("pending", "trained", "dropped")

# Separate statements: executescript would commit the transaction that creates them.
_SCHEMA = (
    """
    CREATE TABLE meta (
        key TEXT PRIMARY KEY,
        value TEXT NOT NULL
    )""",
    # One row: the problem stream's position, advanced in the transaction that hands positions out.
    """
    CREATE TABLE progress (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        problem_position INTEGER NOT NULL CHECK (problem_position >= 0)
    )""",
    """
    INSERT INTO progress (id, problem_position) VALUES (1, 0)""",
    """
    CREATE TABLE groups (
        seq INTEGER PRIMARY KEY,  -- acceptance order
        group_id TEXT NOT NULL UNIQUE,
        problem_index INTEGER NOT NULL,
        stage_versions TEXT NOT NULL,  -- JSON list, for queries (the payload is the truth)
        staleness INTEGER NOT NULL,
        learner_version INTEGER NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('pending', 'trained', 'dropped')),
        step INTEGER,  -- the step that trained it
        drop_reason TEXT,
        accepted_at REAL NOT NULL,
        payload BLOB NOT NULL  -- msgpack-encoded ScoredGroup
    )""",
    """
    CREATE INDEX groups_state ON groups (state, seq)""",
    """
    CREATE TABLE steps (
        step INTEGER PRIMARY KEY CHECK (step >= 1),
        version INTEGER NOT NULL,
        metrics TEXT NOT NULL,  -- JSON object
        recorded_at REAL NOT NULL
    )""",
    """
    CREATE TABLE checkpoints (
        version INTEGER PRIMARY KEY,
        step INTEGER NOT NULL CHECK (step >= 0),
        stages INTEGER NOT NULL CHECK (stages >= 1),
        saved_at REAL NOT NULL
    )""",
)

_decoder = msgspec.msgpack.Decoder(ScoredGroup)  # strict: a payload must be exactly the type


class StoreError(DecentrlError, RuntimeError):
    """The file is not a usable run store (not SQLite, a newer schema, a corrupt row)."""


class DuplicateGroup(DecentrlError, ValueError):
    """A group_id that is already stored; adding it again changes nothing."""


@dataclass(frozen=True)
class StoredGroup:
    """An accepted group as the learner needs it back."""

    group_id: str
    scored: ScoredGroup
    staleness: int  # at acceptance
    learner_version: int  # at acceptance


class RunStore:
    """One run's state in one SQLite file. Safe to share between threads: a single connection,
    and a lock around every transaction (SQLite itself serialises writers across processes)."""

    def __init__(self, path: Path, timeout_s: float = 30.0) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise StoreError(f"run store {self.path} is a directory, expected a SQLite file")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, so nothing commits implicitly.
        db = sqlite3.connect(self.path, timeout=timeout_s, isolation_level=None,
                             check_same_thread=False)
        self._db: sqlite3.Connection | None = db
        try:
            self._open()
        except BaseException as error:
            db.close()
            self._db = None
            if isinstance(error, sqlite3.DatabaseError):
                raise StoreError(f"run store {self.path} is not a usable SQLite database: "
                                 f"{error}") from error
            raise

    def _open(self) -> None:
        db = self._conn
        mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode != "wal":
            raise StoreError(f"run store {self.path}: could not enable WAL journaling "
                             f"(got {mode!r}); is it on a network filesystem?")
        # FULL: a commit is on disk when it returns, even if the machine loses power.
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA foreign_keys=ON")
        with self._transaction() as db:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(f"run store {self.path} has schema version {version}, this "
                                 f"decentrl reads up to {SCHEMA_VERSION}; upgrade decentrl")
            if 0 < version < SCHEMA_VERSION:
                raise StoreError(f"run store {self.path} has schema version {version}, from an "
                                 f"older decentrl (its groups are encoded otherwise); this one "
                                 f"reads version {SCHEMA_VERSION}: start a new run")
            if version == 0:
                tables = db.execute("SELECT name FROM sqlite_master WHERE type = 'table'"
                                    ).fetchall()
                if tables:
                    raise StoreError(f"{self.path} is a SQLite database but not a run store "
                                     f"(it has tables {sorted(t[0] for t in tables)})")
                for statement in _SCHEMA:
                    db.execute(statement)
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    @property
    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise StoreError(f"run store {self.path} is closed")
        return self._db

    @contextmanager
    def _transaction(self, write: bool = True) -> Iterator[sqlite3.Connection]:
        """All or nothing. A write takes SQLite's write lock up front (IMMEDIATE), so a
        read-then-write (reserve, state changes) cannot interleave with another process's writes;
        a read sees one consistent snapshot without blocking writers."""
        with self._lock:
            db = self._conn
            db.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                yield db
                db.execute("COMMIT")
            except BaseException:
                # Also after a failed COMMIT: else the next BEGIN fails inside an open transaction.
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def __enter__(self) -> RunStore:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # ------------------------------------------------------------------------------- problems

    def reserve_problems(self, count: int) -> list[int]:
        """The next `count` problem positions; the new position is committed before they are
        returned, so a restarted coordinator never hands out a position twice."""
        if count < 0:
            raise ValueError(f"cannot reserve {count} problems")
        with self._transaction() as db:
            start = db.execute("SELECT problem_position FROM progress").fetchone()[0]
            db.execute("UPDATE progress SET problem_position = ?", (start + count,))
        return list(range(start, start + count))

    def problem_position(self) -> int:
        with self._transaction(write=False) as db:
            return db.execute("SELECT problem_position FROM progress").fetchone()[0]

    # ---------------------------------------------------------------------------------- groups

    def add_group(self, scored: ScoredGroup, staleness: int, learner_version: int) -> None:
        """Store an accepted group as pending; committed when this returns."""
        group = scored.group
        payload = msgspec.msgpack.encode(scored)
        try:
            with self._transaction() as db:
                db.execute(
                    "INSERT INTO groups (group_id, problem_index, stage_versions, staleness, "
                    "learner_version, state, accepted_at, payload) "
                    "VALUES (?, ?, ?, ?, ?, 'pending', ?, ?)",
                    (group.group_id, group.problem_index, json.dumps(group.stage_versions),
                     staleness, learner_version, time.time(), payload))
        except sqlite3.IntegrityError as error:
            if "group_id" not in str(error):
                raise
            raise DuplicateGroup(f"group {group.group_id} is already stored") from error

    def pending_groups(self) -> list[StoredGroup]:
        """Pending groups in acceptance order."""
        with self._transaction(write=False) as db:
            rows = db.execute("SELECT group_id, payload, staleness, learner_version FROM groups "
                              "WHERE state = 'pending' ORDER BY seq").fetchall()
        return [StoredGroup(group_id=gid, scored=self._decode(gid, payload), staleness=staleness,
                            learner_version=version)
                for gid, payload, staleness, version in rows]

    def accepted_groups(self) -> list[ScoredGroup]:
        """Every accepted group, whatever became of it, in acceptance order."""
        with self._transaction(write=False) as db:
            rows = db.execute("SELECT group_id, payload FROM groups ORDER BY seq").fetchall()
        return [self._decode(gid, payload) for gid, payload in rows]

    def _decode(self, group_id: str, payload: bytes) -> ScoredGroup:
        try:
            scored = _decoder.decode(payload)
        except msgspec.DecodeError as error:
            raise StoreError(f"run store {self.path}: group {group_id} does not decode as a "
                             f"ScoredGroup: {error}") from error
        if scored.group.group_id != group_id:
            raise StoreError(f"run store {self.path}: group {group_id} holds the payload of "
                             f"group {scored.group.group_id}")
        return scored

    def mark_trained(self, group_ids: list[str], step: int) -> None:
        self._change_state(group_ids, "trained", step=step, reason=None)

    def mark_dropped(self, group_ids: list[str], reason: str) -> None:
        self._change_state(group_ids, "dropped", step=None, reason=reason)

    def _change_state(self, group_ids: list[str], state: str, step: int | None,
                      reason: str | None) -> None:
        """Only pending groups move; if one cannot, none does."""
        with self._transaction() as db:
            for gid in group_ids:
                row = db.execute("SELECT state FROM groups WHERE group_id = ?", (gid,)).fetchone()
                if row is None:
                    raise ValueError(f"group {gid} is not stored, cannot mark it {state}")
                if row[0] != "pending":
                    raise ValueError(f"group {gid} is {row[0]}, only a pending group can be "
                                     f"marked {state}")
                db.execute("UPDATE groups SET state = ?, step = ?, drop_reason = ? "
                           "WHERE group_id = ?", (state, step, reason, gid))

    def return_to_pending(self, after_step: int) -> int:
        """Roll the run back to `after_step` (training resumes from a checkpoint taken there):
        groups trained in later steps become pending again, and the later steps and
        checkpoints are forgotten, since their weights descend from the abandoned steps. Returns
        how many groups went back."""
        with self._transaction() as db:
            moved = db.execute("UPDATE groups SET state = 'pending', step = NULL "
                               "WHERE state = 'trained' AND step > ?", (after_step,)).rowcount
            db.execute("DELETE FROM steps WHERE step > ?", (after_step,))
            db.execute("DELETE FROM checkpoints WHERE step > ?", (after_step,))
        return moved

    def counts(self) -> dict[str, int]:
        """Groups per state (every state present, zero when empty)."""
        with self._transaction(write=False) as db:
            rows = db.execute("SELECT state, COUNT(*) FROM groups GROUP BY state").fetchall()
        counts = dict.fromkeys(STATES, 0)
        counts.update(rows)
        return counts

    def is_known(self, group_id: str) -> bool:
        with self._transaction(write=False) as db:
            return db.execute("SELECT 1 FROM groups WHERE group_id = ?",
                              (group_id,)).fetchone() is not None

    # -------------------------------------------------------------------- steps and versions

    def record_step(self, step: int, version: int, metrics: dict[str, float]) -> None:
        """Record a finished training step; steps are consecutive and recorded once."""
        with self._transaction() as db:
            last = db.execute("SELECT COALESCE(MAX(step), 0) FROM steps").fetchone()[0]
            if step != last + 1:
                raise ValueError(f"cannot record step {step}: the last recorded step is {last}, "
                                 f"the next must be {last + 1}")
            db.execute("INSERT INTO steps (step, version, metrics, recorded_at) "
                       "VALUES (?, ?, ?, ?)",
                       (step, version, json.dumps(metrics, sort_keys=True), time.time()))

    def last_step(self) -> int:
        """The last recorded step, 0 when none."""
        with self._transaction(write=False) as db:
            return db.execute("SELECT COALESCE(MAX(step), 0) FROM steps").fetchone()[0]

    def last_version(self) -> int:
        """The learner version after the last recorded step, 0 when none."""
        with self._transaction(write=False) as db:
            row = db.execute("SELECT version FROM steps ORDER BY step DESC LIMIT 1").fetchone()
        return 0 if row is None else row[0]

    def record_checkpoint(self, version: int, step: int, stages: int) -> None:
        """Record a checkpoint once all `stages` of it are saved; its step must be recorded."""
        if stages < 1:
            raise ValueError(f"a checkpoint needs at least one stage, got {stages}")
        with self._transaction() as db:
            last = db.execute("SELECT COALESCE(MAX(step), 0) FROM steps").fetchone()[0]
            if not 0 <= step <= last:
                raise ValueError(f"checkpoint at step {step}, but the last recorded step is "
                                 f"{last}: record the step before its checkpoint")
            db.execute("INSERT INTO checkpoints (version, step, stages, saved_at) "
                       "VALUES (?, ?, ?, ?) ON CONFLICT (version) DO UPDATE SET "
                       "step = excluded.step, stages = excluded.stages, "
                       "saved_at = excluded.saved_at",
                       (version, step, stages, time.time()))

    def last_checkpoint(self) -> tuple[int, int] | None:
        """(version, step) of the latest complete checkpoint, None when there is none."""
        with self._transaction(write=False) as db:
            row = db.execute("SELECT version, step FROM checkpoints "
                             "ORDER BY step DESC, version DESC LIMIT 1").fetchone()
        return None if row is None else (row[0], row[1])

    # ------------------------------------------------------------------------------------ meta

    def set_meta(self, key: str, value: str) -> None:
        with self._transaction() as db:
            db.execute("INSERT INTO meta (key, value) VALUES (?, ?) "
                       "ON CONFLICT (key) DO UPDATE SET value = excluded.value", (key, value))

    def get_meta(self, key: str) -> str | None:
        with self._transaction(write=False) as db:
            row = db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def check_or_set_config(self, config_json: str, may_change: tuple[str, ...] = ()) -> None:
        """Store the run config on first use; afterwards a restart must bring the same one
        (compared as JSON, so key order and whitespace do not matter), except at the dotted
        paths of `may_change` (a resumed run may run longer), where the new value is stored."""
        with self._transaction() as db:
            row = db.execute("SELECT value FROM meta WHERE key = 'config'").fetchone()
            if row is None:
                db.execute("INSERT INTO meta (key, value) VALUES ('config', ?)", (config_json,))
                return
        stored = row[0]
        if stored == config_json:
            return
        try:
            old, new = json.loads(stored), json.loads(config_json)
        except json.JSONDecodeError:
            raise ValueError(f"run config differs from the one stored in {self.path}") from None
        differences = [(path, text) for path, text in _json_differences(old, new, "")
                       if path not in may_change]
        if not differences:
            self.set_meta("config", config_json)
            return
        shown = "; ".join(text for _, text in differences[:5])
        more = f" (and {len(differences) - 5} more)" if len(differences) > 5 else ""
        raise ValueError(f"run config differs from the one stored in {self.path}: "
                         f"{shown}{more}")


def _json_differences(old: Any, new: Any, where: str) -> list[tuple[str, str]]:
    """Where two parsed JSON values differ: (dotted path, 'a.b: stored X, given Y')."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(old.keys() | new.keys()):
            path = f"{where}.{key}" if where else key
            if key not in new:
                out.append((path, f"{path}: stored {json.dumps(old[key])}, missing now"))
            elif key not in old:
                out.append((path, f"{path}: not stored, given {json.dumps(new[key])}"))
            else:
                out.extend(_json_differences(old[key], new[key], path))
        return out
    if old == new and type(old) is type(new):
        return []
    return [(where, f"{where or '<config>'}: stored {json.dumps(old)}, given {json.dumps(new)}")]

"""The coordinator's running account of its swarm, for operators: a snapshot of every peer (stage,
role, version, throughput, bytes uploaded, reputation) and every verification event go into
metrics.jsonl as they happen (the per-run report plots them afterwards), and `state()` is what the
live dashboard shows (observe/dashboard.py serves it). Peer names are peers' own choice: they are
made inert and bounded (net/text.py) before they are kept, written or shown, and what is kept per
peer is bounded too."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from decentrl.config import RunConfig
from decentrl.net.directory import Directory
from decentrl.net.text import peer_text
from decentrl.observe.metrics import (
    EvalRecord,
    MetricsLog,
    PeerSnapshot,
    StepRecord,
    SwarmRecord,
    TrustRecord,
)
from decentrl.trust.reputation import Reputation

log = logging.getLogger(__name__)

Phase = Literal["waiting", "evaluating", "training", "finished"]
# A peer's name as the snapshots, the events and the dashboard carry it.
NAME_CHARS = 64
# Names of peers that have left, kept to label their later verification events: a stream of
# throwaway identities must not grow the table, and a name forgotten shows as the id's tail.
NAMES_KEPT = 1024
# The keys of a step record the dashboard draws; the whole record is in metrics.jsonl.
STEP_KEYS = ("step", "elapsed_s", "version", "reward", "accuracy", "staleness_mean",
             "completion_tokens_mean", "train_s", "wait_s", "sequences", "tokens_per_s")


def dashboard_steps(steps: list[StepRecord]) -> list[dict[str, Any]]:
    """The dashboard's view of the step records: STEP_KEYS, and `tokens_per_s`, the tokens a
    step's batch generated over the time since the step before. The first step has none (its
    interval holds the evaluation before training), nor have records without `generated_tokens`
    (older runs). The report smooths the same quantity over a few steps (observe/report.py
    `throughput`)."""
    out = []
    for index, record in enumerate(steps):
        fields = msgspec.structs.asdict(record)
        row = {key: fields[key] for key in STEP_KEYS if fields.get(key) is not None}
        seconds = record.elapsed_s - steps[index - 1].elapsed_s if index > 0 else 0.0
        if record.generated_tokens is not None and seconds > 0:  # a resumed run restarts its clock
            row["tokens_per_s"] = round(record.generated_tokens / seconds, 1)
        out.append(row)
    return out


@dataclass
class SwarmObserver:
    config: RunConfig
    directory: Directory
    reputation: Reputation
    metrics: MetricsLog
    learner_version: Callable[[], int]
    step: Callable[[], int]
    trust_counters: Callable[[], dict[str, int]]
    phase: Phase = "waiting"
    training_began: float | None = None  # wall clock; the time budget counts from here
    training_ended: float | None = None
    # Kept after a peer leaves (the NAMES_KEPT most recently seen), already made inert.
    names: OrderedDict[str, str] = field(default_factory=OrderedDict)
    events_logged: int = 0  # of the reputation's events_recorded
    # Reentrant: record() holds it (the announce thread and the run's end both record) and
    # calls peers(), which takes it too.
    lock: threading.RLock = field(default_factory=threading.RLock)

    def peers(self) -> list[PeerSnapshot]:
        records = self.directory.records()
        sessions = self.directory.sessions_opened()
        names = {peer: peer_text(record.name, NAME_CHARS) for peer, record in records.items()}
        with self.lock:
            for peer, name in names.items():
                self.names[peer] = name
                self.names.move_to_end(peer)
            while len(self.names) > NAMES_KEPT:
                self.names.popitem(last=False)
        return [PeerSnapshot(peer_id=peer, name=names[peer], stage=r.stage, layers=list(r.layers),
                             role=r.role, version=r.version, tokens_per_s=r.tokens_per_s,
                             bytes_sent=r.bytes_sent, bytes_relayed=r.bytes_relayed,
                             sessions=sessions.get(peer, 0), compute=r.compute,
                             rows_per_tick=r.rows_per_tick,
                             reputation=round(self.reputation.score(peer), 3),
                             banned=self.reputation.banned(peer))
                for peer, r in sorted(records.items(), key=lambda item: (item[1].stage,
                                                                          names[item[0]]))]

    def record(self) -> None:
        """One swarm snapshot, and the verification events since the last call, into
        metrics.jsonl (as many as the reputation still holds: it drops the oldest of a flood)."""
        with self.lock:
            self.metrics.write(SwarmRecord(step=self.step(), version=self.learner_version(),
                                           peers=self.peers()))
            new, recorded = self.reputation.events_after(self.events_logged)
            lost = recorded - self.events_logged - len(new)
            self.events_logged = recorded
            for event in new:  # the detail is already inert and bounded (trust/reputation.py)
                self.metrics.write(TrustRecord(
                    time=round(event.time, 3), peer=event.peer,
                    name=self.names.get(event.peer, event.peer[-8:]), stage=event.stage,
                    outcome=event.outcome, detail=event.detail))
        if lost:
            log.warning("%d verification events since the last snapshot were dropped unwritten: "
                        "more arrived than the reputation keeps", lost)

    def updates(self, peers: list[PeerSnapshot]) -> list[dict[str, Any]]:
        """Per stage, how far the learner's newest weights have spread among its replicas."""
        learner = self.learner_version()
        out = []
        for stage in range(self.config.num_stages):
            versions = [p.version for p in peers if p.stage == stage and p.role != "training"]
            out.append({"stage": stage, "learner_version": learner, "replicas": len(versions),
                        "replicas_current": sum(v >= learner for v in versions),
                        "oldest_replica_version": min(versions) if versions else None})
        return out

    def state(self) -> dict[str, Any]:
        """What the dashboard shows now (a JSON object; observe/dashboard.py documents it)."""
        peers = self.peers()
        stages = []
        for stage in range(self.config.num_stages):
            members = [p for p in peers if p.stage == stage]
            first, stop = members[0].layers if members else (None, None)
            stages.append({"stage": stage,  # the first and the last layer, as people count them
                           "layers": [first, stop - 1] if stop is not None else None,
                           "peers": msgspec.to_builtins(members)})
        events = self.metrics.of(TrustRecord)  # the newest (metrics.EVENTS_SHOWN)
        return {
            "run": self.config.name, "phase": self.phase,
            "elapsed_s": round(time.time() - self.metrics.started, 1),
            "training_s": None if self.training_began is None
            else round((self.training_ended or time.time()) - self.training_began, 1),
            "step": self.step(),
            "version": self.learner_version(), "max_steps": self.config.train.steps,
            "time_budget_s": self.config.train.time_budget_s,
            "steps": dashboard_steps(self.metrics.of(StepRecord)),
            "evals": msgspec.to_builtins(self.metrics.of(EvalRecord)),
            "stages": stages, "updates": self.updates(peers),
            "trust": self.trust_counters(),
            "trust_events": [{"time": e.time, "elapsed_s": e.elapsed_s, "peer": e.peer,
                              "name": e.name, "stage": e.stage, "outcome": e.outcome,
                              "detail": e.detail} for e in events],
        }

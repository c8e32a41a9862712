"""The schema of metrics.jsonl, its writer and its reader: one JSON object a line, tagged by
`event` ("step", "supervised", "eval", "swarm", "trust", "chaos"), with `elapsed_s` since the
run's start. The training loop, the swarm observer, the dashboard, the report and the benchmarks
all go through these types, so a field is added, renamed or read in one place.

Fields a record gained over time have defaults, so runs written before them still read; a field
that is None is left out of the line."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

import msgspec

from decentrl.net.protocol import ComputeTime


class Record(msgspec.Struct, kw_only=True, omit_defaults=True, tag_field="event"):
    elapsed_s: float = 0.0  # seconds since the run started; the writer stamps it


class StepRecord(Record, tag="step"):
    """One training step: its batch, the time it took, the trainer's metrics (learn/losses.py,
    learn/trainer.py; absent when no group of the batch carried signal) and, in a swarm run, the
    coordinator's cumulative counters."""

    step: int
    version: int  # the learner's version after the step
    reward: float
    accuracy: float
    staleness_mean: float
    wait_s: float | None = None  # waiting for rollouts
    train_s: float | None = None
    sequences: int = 0  # rows trained (groups without reward variance are left out)
    stale_dropped: int = 0  # cumulative: groups dropped over the staleness bound
    rejected: int = 0  # cumulative: groups refused by ingestion
    groups: float = 0.0
    zero_variance_groups: float = 0.0
    staleness_max: float = 0.0
    completion_tokens_mean: float = 0.0
    finished_fraction: float | None = None
    generated_tokens: float | None = None
    staleness_counts: dict[int, int] | None = None  # groups of the batch per staleness
    # The curriculum (coordinator/curriculum.py): the share of every group accepted so far that had
    # no reward spread, the problems handed out again so far, and per difficulty bucket the
    # estimated pass rate and chance of spread.
    zero_spread_share_total: float | None = None
    replays_handed_out: int | None = None
    bucket_pass_rates: dict[str, float] | None = None
    bucket_spread_chances: dict[str, float] | None = None
    # The trainer's metrics.
    policy_loss: float | None = None
    grad_norm: float | None = None
    clip_fraction: float | None = None
    ratio_mean: float | None = None
    behaviour_kl: float | None = None  # KL(behaviour || proximal): how off-policy the batch was
    kl: float | None = None  # to the reference model: only when the loss has a KL penalty
    entropy: float | None = None
    flagged_fraction: float | None = None
    tis_weight_mean: float | None = None
    tis_truncated_fraction: float | None = None
    mis_masked_fraction: float | None = None
    m2_masked_fraction: float | None = None  # tokens M2PO's second-moment mask left out
    behaviour_m2: float | None = None  # mean (log learner / behaviour probability)^2 per token
    # Entropy control (learn/entropy.py): the share of tokens Clip-Cov or KL-Cov acted on, and
    # the adaptive entropy bonus's weight in the step.
    cov_selected_fraction: float | None = None
    entropy_coef: float | None = None
    # A swarm run's cumulative counters (trust/gate.py `Trust.counters`, the chain's failovers,
    # the coordinator's link bytes in both directions).
    verified: int | None = None
    verify_failed: int | None = None
    verify_skipped: int | None = None
    verify_unconfirmed: int | None = None
    verify_opinions: int | None = None
    verifiers_overruled: int | None = None
    verify_no_established: int | None = None
    probation_sessions_withheld: int | None = None
    probation_address_limited: int | None = None
    replicas_not_admitted: int | None = None
    held_for_verdict: int | None = None
    flagged: int | None = None
    banned: int | None = None
    failovers: int | None = None
    wire_bytes: float | None = None
    # A swarm run's rows in flight at the step (coordinator/inflight.py), and what sized them: the
    # floor of a decoding step's round trip and the most rows stepped per second lately (None
    # until measured).
    rows_in_flight: int | None = None
    step_round_trip_s: float | None = None
    rows_stepped_per_s: float | None = None
    # A swarm run's replica fidelity, as the training peers measured it at the newest version
    # the coordinator signed of each stage (sync/delta.py `served_fidelity`): the share of the
    # learner's movement (L2) the replicas do not serve yet, and the fraction of entries whose
    # served bf16 value differs from the learner's; over every stage, and per stage.
    served_gap: float | None = None
    served_bf16_differing: float | None = None
    served_gap_by_stage: dict[int, float] | None = None
    served_bf16_differing_by_stage: dict[int, float] | None = None
    # Demonstrations trained beside the rollouts (supervised.interleave_rows), and their mean
    # negative log-likelihood and next-token accuracy per assistant token.
    supervised_rows: int = 0
    sft_nll: float | None = None
    sft_token_accuracy: float | None = None


class SupervisedRecord(Record, tag="supervised"):
    """One supervised warm-up step (supervised.steps): demonstrations only, through the
    same training chain as an RL step."""

    step: int
    version: int  # the learner's version after the step
    rows: int
    tokens: int  # the assistant tokens in the loss
    sft_nll: float  # their mean negative log-likelihood
    sft_token_accuracy: float  # the share the model already predicts (argmax)
    grad_norm: float
    train_s: float


class EvalRecord(Record, tag="eval"):
    label: str  # "before", "during", "after"
    step: int
    pass1: float
    pass1_low: float
    pass1_high: float
    version: int = 0
    task: str = ""
    problems: int = 0
    pass_k: float | None = None
    k: int | None = None
    # Greedy pass@1 beside the sampled pass1 (eval.greedy), with its Wilson interval.
    greedy_pass1: float | None = None
    greedy_pass1_low: float | None = None
    greedy_pass1_high: float | None = None


class PeerSnapshot(msgspec.Struct, kw_only=True):
    peer_id: str
    stage: int
    role: str
    version: int
    tokens_per_s: float
    bytes_sent: int
    reputation: float
    banned: bool
    name: str = ""
    layers: list[int] = []  # [start, stop)
    bytes_relayed: int = 0  # of bytes_sent, through relays
    sessions: int = 0  # generation sessions the coordinator gave it so far (routing)
    compute: ComputeTime | None = None  # what its compute thread did since it started
    rows_per_tick: float = 0.0  # rows its batched inference forwards took on average


class SwarmRecord(Record, tag="swarm"):
    step: int
    version: int
    peers: list[PeerSnapshot]


class TrustRecord(Record, tag="trust"):
    """A verification event (trust/reputation.py); `detail` comes from an untrusted peer's output
    and is cut short by the writer."""

    peer: str
    stage: int | None
    outcome: str
    name: str = ""
    detail: str = ""
    time: float = 0.0  # wall clock of the event


ChaosAction = Literal["killed", "back", "not back"]


class ChaosRecord(Record, tag="chaos"):
    """`decentrl demo --chaos` killed a peer, or the peer it killed is serving again (or not:
    `detail` says why); launch/local_swarm.py `chaos`."""

    peer: str
    action: ChaosAction
    detail: str = ""


AnyRecord = StepRecord | SupervisedRecord | EvalRecord | SwarmRecord | TrustRecord | ChaosRecord
KINDS: dict[str, type[Record]] = {"step": StepRecord, "supervised": SupervisedRecord,
                                  "eval": EvalRecord, "swarm": SwarmRecord, "trust": TrustRecord,
                                  "chaos": ChaosRecord}
R = TypeVar("R", bound=Record)


class Event(msgspec.Struct):
    """What every line has; the kind decides the rest."""

    event: str


@dataclass
class RunRecords:
    """metrics.jsonl by kind of event, in file order."""

    steps: list[StepRecord]
    evals: list[EvalRecord]
    snapshots: list[SwarmRecord]
    trust: list[TrustRecord]
    supervised: list[SupervisedRecord]
    chaos: list[ChaosRecord]

    @property
    def wall_s(self) -> float:
        times = [r.elapsed_s for kind in (self.steps, self.supervised, self.evals,
                                          self.snapshots, self.trust, self.chaos)
                 for r in kind]
        return max(times, default=0.0)


def read_metrics(path: Path) -> RunRecords:
    """A run's records; a line that is not a valid record raises ValueError naming the file and
    the line. Events of other kinds are skipped."""
    found: dict[str, list[Any]] = {kind: [] for kind in KINDS}
    lines = path.read_text().splitlines() if path.is_file() else []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            kind = msgspec.json.decode(line, type=Event).event
            if kind in KINDS:
                # Not strict: JSON object keys are strings, staleness_counts' keys are versions.
                raw = msgspec.json.decode(line)
                found[kind].append(msgspec.convert(raw, KINDS[kind], strict=False))
        except msgspec.DecodeError as error:  # a ValidationError too
            raise ValueError(f"{path}, line {number}: malformed metrics record: {error}") from None
    return RunRecords(found["step"], found["eval"], found["swarm"], found["trust"],
                      found["supervised"], found["chaos"])


# The verification events the dashboard lists, newest last.
EVENTS_SHOWN = 200
# The records of each kind MetricsLog holds in memory, for the dashboard; None: all of them. Steps
# and evaluations grow with the run's own progress; swarm snapshots and verification events grow
# with time and with what peers do, and the dashboard shows the live directory and only the
# newest events, so only those are held. Every record is in the file.
RECORDS_HELD: dict[type[Record], int | None] = {StepRecord: None, SupervisedRecord: None,
                                                EvalRecord: None, SwarmRecord: 1,
                                                TrustRecord: EVENTS_SHOWN,
                                                ChaosRecord: EVENTS_SHOWN}


class RecordSink(Protocol):
    """Where MetricsLog also sends every record it writes (observe/trackers.py `Trackers`)."""

    def log(self, record: Record) -> None: ...

    def close(self) -> None: ...


class MetricsLog:
    """metrics.jsonl, appended as records happen, and the newest of this run's records in memory
    (RECORDS_HELD, for the dashboard); each record goes to `sink` too, in the file's order.
    Written from the training loop and from the swarm observer's thread."""

    def __init__(self, path: Path, started: float, sink: RecordSink | None = None) -> None:
        self.path, self.started, self.sink = path, started, sink
        self.held: dict[type[Record], deque[Any]] = {
            kind: deque(maxlen=limit) for kind, limit in RECORDS_HELD.items()}
        self.lock = threading.Lock()

    def write(self, record: R) -> R:
        """Stamp `record` with the time since the run started and append it."""
        record.elapsed_s = round(time.time() - self.started, 3)
        line = msgspec.json.encode(record) + b"\n"
        with self.lock:
            with self.path.open("ab") as f:
                f.write(line)
            self.held[type(record)].append(record)
            if self.sink is not None:
                self.sink.log(record)
        return record

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()

    def of(self, kind: type[R]) -> list[R]:
        """The records of `kind` held in memory (RECORDS_HELD), oldest first."""
        with self.lock:
            return list(self.held[kind])


def supervised_line(record: SupervisedRecord) -> str:
    """The console line of a supervised warm-up step."""
    return (f"step {record.step:4d}  v{record.version}  supervised: {record.rows} rows  "
            f"nll {record.sft_nll:.3f}  token acc {record.sft_token_accuracy:.3f}  "
            f"train {record.train_s:.1f}s  t={record.elapsed_s:.0f}s")


def step_line(record: StepRecord) -> str:
    """The console line of a training step."""
    return (f"step {record.step:4d}  v{record.version}  reward {record.reward:.3f}  "
            f"acc {record.accuracy:.3f}  len {record.completion_tokens_mean:.1f}  "
            f"stale {record.staleness_mean:.2f}  wait {record.wait_s or 0:.1f}s  "
            f"train {record.train_s or 0:.1f}s  t={record.elapsed_s:.0f}s")


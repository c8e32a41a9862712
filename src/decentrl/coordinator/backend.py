"""What a training loop (coordinator/loop.py) needs from where its work happens: a `Backend`
(coordinator/local_backend.py in one process, coordinator/swarm_backend.py over a swarm), with
the `Generation` it was built with and the `Gate` that judges groups; what the backend may read of
the loop while it runs (`RunView`); and what a run returns (`RunSummary`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from decentrl.coordinator.inflight import SessionSlots
from decentrl.errors import DecentrlError
from decentrl.evaluate.runner import EvalResult
from decentrl.learn.trainer import PipelineTrainer
from decentrl.net.transport import RolloutTransport
from decentrl.observe.metrics import MetricsLog
from decentrl.rollout.chain import InferenceChain, InferenceSession
from decentrl.rollout.types import RolloutGroup


class TrainingUnavailable(DecentrlError, RuntimeError):
    """The stages cannot be brought to one version now (a backend raises it while it waits for a
    replacement); the loop retries until RECOVERY_WAIT_S."""


@dataclass
class RunSummary:
    path: Path  # the run folder
    steps: int
    wall_s: float
    before: EvalResult | None  # None for a resumed run: its first evaluation was before
    after: EvalResult
    recoveries: int = 0
    failovers: int = 0
    trust: dict[str, int] = field(default_factory=dict)  # spot-checks, flags, bans, refusals
    banned: dict[str, str] = field(default_factory=dict)  # peer id -> the event that tipped it
    dashboard_url: str | None = None
    # After the supervised warm-up, when this process finished it (supervised.steps).
    warmup: EvalResult | None = None


class Gate(Protocol):
    """What the loop tells the trust gate about groups, and what it asks (trust/gate.py `Trust`
    in a swarm; `TrustEveryone` where every rollout is generated in this process)."""

    def distrusted_producer(self, group_id: str) -> str | None: ...
    def accepted(self, group: RolloutGroup) -> None: ...
    def forget(self, group_id: str) -> None: ...
    def trained(self, group_id: str) -> None: ...
    def flagged(self, groups: list[RolloutGroup]) -> None: ...
    def awaiting_verdict(self, group_id: str) -> bool: ...


class TrustEveryone:
    """The gate of a run whose rollouts this process generated itself."""

    def distrusted_producer(self, group_id: str) -> str | None:
        return None

    def accepted(self, group: RolloutGroup) -> None:
        pass

    def forget(self, group_id: str) -> None:
        pass

    def trained(self, group_id: str) -> None:
        pass

    def flagged(self, groups: list[RolloutGroup]) -> None:
        pass

    def awaiting_verdict(self, group_id: str) -> bool:
        return False


@dataclass(frozen=True)
class Generation:
    """How a backend generates, fixed when it is built: what the loop's generation loops take."""

    chain: InferenceChain  # generation goes through it
    transport: RolloutTransport  # groups from the generation loops to the learner
    loops: int  # generation loops started: the most sessions the run may hold
    slots: SessionSlots  # how many of them may run a session now
    problems_per_session: int  # problems (one group each) per session, fixed for the run
    cpu_threads: int | None  # intra-op threads of a generation loop; None: the default
    transient_errors: tuple[type[BaseException], ...]  # errors that lose groups, not bugs


@dataclass(frozen=True)
class RunView:
    """What a backend may read of the loop that runs it (a swarm's live observer shows it)."""

    stop: threading.Event  # set when training ends
    wait_s: float  # how long the backend may wait for its stages to be ready
    metrics: MetricsLog  # the run's metrics.jsonl, which the loop writes
    step: Callable[[], int]  # the loop's step now
    version: Callable[[], int]  # the learner's version now


class Backend(Protocol):
    """Where a run's work happens. The loop calls these from its own thread, except `generated`
    (from generation threads) and `evaluated` (from evaluation threads)."""

    tokenizer: Any
    trainer: PipelineTrainer  # drives the stage trainers, local or remote
    gate: Gate
    generation: Generation
    recoverable_step_errors: tuple[type[BaseException], ...]  # a stage lost mid-step
    checkpoint_at_start: bool  # a version-0 checkpoint: what a replacement trainer starts from

    def start(self, run: RunView) -> list[threading.Thread]:
        """Say what runs where (the run's first console line), get the stages ready (a swarm
        waits for its peers, up to `run.wait_s`) and start the backend's own threads; returns
        them, for the loop to join at the end."""
        ...

    def versions(self) -> list[int]:
        """Every stage trainer's version (a swarm reconnects to its training peers)."""
        ...

    def load_checkpoint(self, version: int) -> None:
        """Bring every stage trainer whose version differs to checkpoint `version`."""
        ...

    def save_checkpoint(self, version: int, step: int, problem_position: int) -> None:
        """Write checkpoint `version` of every stage and put it in charge."""
        ...

    def discard_step(self) -> None:
        """Forget a failed step's gradients on every stage that is still reachable."""
        ...

    def publish(self) -> None:
        """Hand the learner's new weights to the inference replicas."""
        ...

    def generated(self, groups: list[RolloutGroup], sessions: list[InferenceSession]) -> None:
        """Groups a generation loop produced, with the sessions that produced them."""
        ...

    def evaluation(self, version: int) -> tuple[InferenceChain, int]:
        """A chain that serves the learner's `version`, and how many sessions to run on it."""
        ...

    def evaluated(self, groups: list[RolloutGroup], session: InferenceSession) -> None:
        """The groups an evaluation session produced (shaped as training groups; a greedy
        session's, one row per problem), with the session."""
        ...

    def await_servers(self, stop: threading.Event | None) -> None:
        """Return once every stage has an inference server to generate with, or `stop` is set;
        a swarm waits for a replica that joins or whose ban ends, saying so, and raises
        SwarmUnavailable after `swarm.stage_wait_s`."""
        ...

    def step_counters(self) -> dict[str, Any]:
        """StepRecord fields only this backend knows (a swarm's trust counters, failovers...)."""
        ...

    def finish(self, summary: RunSummary) -> RunSummary:
        """After the final evaluation: add what the backend knows, export what it exports."""
        ...

    def close(self) -> None: ...

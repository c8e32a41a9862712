"""The training loop of every run, in one process or over a swarm (the loop of DESIGN.md).

The loop owns what does not depend on where the work happens: it schedules problems (durably, so
a restart never hands one out twice), runs the generation threads, ingests what comes back
(checked, scored by the loop itself, stored in SQLite before it counts), keeps the batch within
the staleness bound, runs one training step, evaluates, checkpoints and writes the metrics. A
`Backend` supplies the rest: the inference chain, the stage trainers (local modules or training
peers), how new weights reach the replicas, and how checkpoints are written (swarm/local.py,
swarm/coordinate.py).

Faults: a step that fails on a backend's recoverable error (a training peer died) is forgotten
everywhere, and the loop brings every stage back to the store's last version or the last complete
checkpoint, returning the groups trained after it to the pending pool. A restarted run does the
same from its store. Benchmarks and tools follow or steer the loop through `RunHooks`."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import msgspec
import torch
from rich.console import Console

from decentrl.config import RunConfig
from decentrl.envs import Environment, make_task_or_environment
from decentrl.envs.base import Demonstrating
from decentrl.evaluate.runner import EvalResult, TrainingShape, evaluate
from decentrl.learn.batch import TrainBatch, build_batch
from decentrl.learn.losses import StaleRolloutError, check_staleness
from decentrl.learn.trainer import PipelineTrainer
from decentrl.net.text import REMOTE_ERROR_CHARS
from decentrl.net.transport import RolloutTransport
from decentrl.observe.metrics import (
    EvalRecord,
    MetricsLog,
    StepRecord,
    SupervisedRecord,
    step_line,
    supervised_line,
)
from decentrl.observe.terminal import terminal_text
from decentrl.progress import progress_bar
from decentrl.rollout.chain import InferenceChain, InferenceSession
from decentrl.rollout.demonstrations import demonstrations
from decentrl.rollout.sampling import sampling_config
from decentrl.rollout.types import Rollout, RolloutGroup, ScoredGroup
from decentrl.swarm.curriculum import Curriculum, has_spread
from decentrl.swarm.inflight import SessionSlots
from decentrl.swarm.ingest import Ingestion
from decentrl.swarm.scheduler import PromptScheduler
from decentrl.swarm.store import RunStore
from decentrl.swarm.worker import RolloutWorker
from decentrl.tasks import Task

log = logging.getLogger(__name__)

POLL_S = 0.5
# Training steps that may fail in a row (peers dying) before the run gives up: a step that fails
# every time is a bug, not a fault to wait out.
MAX_FAILED_STEPS = 5
# What a resumed run may change in its config: how long it runs.
RESUMABLE_CHANGES = ("train.steps", "train.time_budget_s")
# How long a recovery waits for every stage to have a training peer again.
RECOVERY_WAIT_S = 600.0
# Times one evaluation session may fail (after waiting for its stages' servers each time) before
# the evaluation gives up: a session that fails with every stage served is a bug, not a fault.
EVALUATION_ATTEMPTS = 5
# Dynamic sampling reads at most this many groups per group a batch asks for: when the policy
# solves (or fails) nearly every problem, a step still comes, with the few groups that vary.
DYNAMIC_SAMPLING_LIMIT = 4


class TrainingUnavailable(RuntimeError):
    """The stages cannot be brought to one version now (a backend raises it while it waits for a
    replacement); the loop retries until RECOVERY_WAIT_S."""


class StopTraining(Exception):
    """Raised by a hook to end training early; the run then checkpoints and evaluates as at the
    end of its budget."""


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
    # After the supervised warm-up, when this process finished it (supervised.warmup_steps).
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


class Backend(Protocol):
    """Where a run's work happens. The loop calls these from its own thread, except `generated`
    (from generation threads)."""

    config: RunConfig
    trainer: PipelineTrainer  # drives the stage trainers, local or remote
    chain: InferenceChain  # generation goes through it
    transport: RolloutTransport  # groups from the generation threads (and any submitter)
    tokenizer: Any
    gate: Gate
    generation_threads: int  # generation loops started: the most sessions the run may hold
    session_slots: SessionSlots  # how many of them may run a session now
    problems_per_generation: int  # problems (one group each) per session, fixed for the run
    generation_cpu_threads: int | None  # intra-op threads of a generation loop; None: default
    transient_generation_errors: tuple[type[BaseException], ...]  # lost groups, not bugs
    recoverable_step_errors: tuple[type[BaseException], ...]  # a stage lost mid-step
    checkpoint_at_start: bool  # a version-0 checkpoint: what a replacement trainer starts from

    def describe(self) -> str:
        """The run's first console line."""
        ...

    def start(self, stop: threading.Event, wait_s: float) -> list[threading.Thread]:
        """Get the stages ready (a swarm waits for its peers) and start the backend's own
        threads; returns them, for the loop to join at the end."""
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
        session's, one row per problem), with the session (from evaluation threads)."""
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


class RunHooks:
    """Extension points for benchmarks and tools; each is a no-op here. Hooks run on the loop's
    thread, except `before_generation` (on generation threads)."""

    def training_started(self, loop: TrainingLoop) -> None:
        pass

    def before_step(self, loop: TrainingLoop) -> None:
        """Raise StopTraining to end training before this step."""

    def after_step(self, loop: TrainingLoop, record: StepRecord) -> None:
        """Raise StopTraining to end training after this step."""

    def before_evaluation(self, loop: TrainingLoop, label: str) -> None:
        pass

    def after_evaluation(self, loop: TrainingLoop, label: str, result: EvalResult) -> None:
        """Raise StopTraining to end training after a "during" evaluation."""

    def before_generation(self, loop: TrainingLoop, stop: threading.Event) -> bool:
        """Called before a generation loop schedules problems; may block (a benchmark holds
        generation while it evaluates). False skips this round."""
        return True

    def after_generation(self, loop: TrainingLoop, succeeded: bool) -> None:
        """A generation loop's round ended: its groups are on their way to the transport, or
        (not `succeeded`) they were lost to a transient error."""

    def training_ended(self, loop: TrainingLoop) -> None:
        pass


AnyBackend = TypeVar("AnyBackend", bound=Backend)


class TrainingLoop(Generic[AnyBackend]):
    def __init__(self, config: RunConfig, backend: AnyBackend, console: Console | None = None,
                 hooks: list[RunHooks] | None = None) -> None:
        self.config, self.backend = config, backend
        self.console = console or Console()
        self.hooks = list(hooks or [])
        self.task: Task | Environment = make_task_or_environment(config.task.name,
                                                                 config.task.options)
        self.eval_task = make_task_or_environment(config.eval.task.name, config.eval.task.options)
        supervised = config.supervised
        if (supervised.warmup_steps or supervised.interleave_rows) \
                and not isinstance(self.task, Demonstrating):
            raise ValueError(f"supervised.warmup_steps and supervised.interleave_rows need "
                             f"demonstrations, which task {config.task.name!r} cannot write "
                             "(an environment with a scripted solver can: envs/base.py "
                             "Demonstrating)")
        self.path = config.path
        self.path.mkdir(parents=True, exist_ok=True)
        self.store = RunStore(self.path / "run.sqlite")
        self.store.check_or_set_config(config.model_dump_json(), may_change=RESUMABLE_CHANGES)
        self.curriculum = Curriculum(config.curriculum, self.task, config.rollout.group_size,
                                     config.seed)
        self.curriculum.replay(self.store.accepted_groups())  # a restart's estimates
        self.scheduler = PromptScheduler(config.seed, start=self.store.problem_position(),
                                         admits=self.curriculum.admits,
                                         replay=self.curriculum.next_replay)
        self.ingestion = Ingestion(config, self.task, backend.tokenizer, self.scheduler)
        self.worker = RolloutWorker(backend.chain, backend.transport, self.task,
                                    backend.tokenizer, config.rollout, self.scheduler, config.seed)
        self.metrics = MetricsLog(self.path / "metrics.jsonl", time.time())
        self.pending: list[tuple[ScoredGroup, int]] = []  # accepted, not yet trained
        self.held: list[tuple[ScoredGroup, int]] = []  # accepted, waiting for a check's ruling
        self.problems_lock = threading.Lock()
        self.stop = threading.Event()
        self.step = self.store.last_step()
        self.recoveries = 0
        self.rollbacks: list[int] = []  # the version each rollback of this run went back to
        self.failed_steps = 0
        self.generation_errors = 0
        self.generation_error: BaseException | None = None
        self.training_started = time.time()  # again when `run` starts training
        self.warmup_result: EvalResult | None = None

    @property
    def trainer(self) -> PipelineTrainer:
        return self.backend.trainer

    # ---- versions and checkpoints ---------------------------------------------------------

    def reconcile(self) -> None:
        """Make every stage trainer agree with the store: the last recorded version, or else the
        last complete checkpoint (groups trained after it go back to the pending pool)."""
        versions = self.backend.versions()
        expected = self.store.last_version()
        if all(v == expected for v in versions):
            return
        checkpoint = self.store.last_checkpoint()
        version, step = checkpoint if checkpoint is not None else (0, 0)
        if checkpoint is None and any(v != 0 for v in versions):
            raise TrainingUnavailable(f"the stage trainers are at versions {versions} but this "
                                      "run has no checkpoint to bring them to; start them fresh")
        self.backend.load_checkpoint(version)
        returned = self.store.return_to_pending(after_step=step)
        # Groups sampled by weights newer than the checkpoint came from the branch the rollback
        # discarded: the version numbers they carry will name other weights from now on.
        discarded = [g.scored.group.group_id for g in self.store.pending_groups()
                     if max(v for span in g.scored.group.version_spans for v in span.versions)
                     > version]
        if discarded:
            self.store.mark_dropped(discarded, f"sampled by weights newer than v{version}, "
                                               "which a rollback discarded")
        self.pending = [(g.scored, g.staleness) for g in self.store.pending_groups()]
        # Held groups are pending in the store: those still pending are in `pending` now (and go
        # back to `held` while they await a ruling); the discarded ones must not come back.
        self.held = []
        # The same holds for groups that finished before the rollback and wait in the inbox,
        # and for sessions still generating now (`_generate` checks `rollbacks` when they end).
        self.rollbacks.append(version)
        while (group := self.backend.transport.get_rollouts(timeout=0)) is not None:
            if not self._from_discarded_branch(group, version):
                accepted = self._accept(group)
                if accepted is not None:
                    self.pending.append(accepted)
        self.step = step
        self.recoveries += 1
        self.console.print(f"[yellow]training rolled back to checkpoint v{version} (step {step}); "
                           f"{returned} groups back to pending[/]")

    def checkpoint(self, required: bool = True) -> None:
        """Save every stage at this version. A periodic save (`required` False) that fails (a
        training peer gone or too slow to answer) costs the run nothing but this checkpoint:
        `latest` keeps pointing at the last complete one, and the next interval tries again. The
        first and the last are required: replacements start from one, the release is the other."""
        version = self.trainer.version
        try:
            self.backend.save_checkpoint(version, self.step, self.scheduler.position)
        except self.backend.recoverable_step_errors as error:
            if required:
                raise
            self.console.print(f"[yellow]checkpoint v{version} not saved (the last complete one "
                               f"stands): {terminal_text(error, REMOTE_ERROR_CHARS)}[/]")
            return
        self.store.record_checkpoint(version, self.step, self.config.num_stages)

    def _recover(self) -> None:
        """A stage failed mid-step: forget the step everywhere, then bring every stage to one
        version, waiting for replacements as long as RECOVERY_WAIT_S."""
        self.backend.discard_step()
        deadline = time.monotonic() + RECOVERY_WAIT_S
        while not self.stop.is_set():
            try:
                self.reconcile()
                return
            except (TrainingUnavailable, *self.backend.recoverable_step_errors) as error:
                if time.monotonic() > deadline:
                    raise
                log.warning("waiting for the stage trainers: %s", error)
                self.stop.wait(2.0)

    # ---- generation -----------------------------------------------------------------------

    def _schedule(self, count: int) -> list[int]:
        with self.problems_lock:  # durable first: a restart never hands a problem out twice
            return self.scheduler.next(count, reserve=self.store.reserve_problems)

    def _generate(self, count: int) -> list[RolloutGroup]:
        sessions: list[InferenceSession] = []
        rollbacks_before = len(self.rollbacks)
        self.worker.sync_weights()
        groups = self.worker.generate_groups(self._schedule(count), on_session=sessions.append)
        self.backend.generated(groups, sessions)
        # A rollback while these sessions ran may have discarded the versions they sampled with.
        floor = min(self.rollbacks[rollbacks_before:], default=None)
        return [g for g in groups if floor is None or not self._from_discarded_branch(g, floor)]

    def _from_discarded_branch(self, group: RolloutGroup, version: int) -> bool:
        """Whether `group` sampled with weights newer than `version`, the one a rollback went
        back to: those version numbers name other weights from then on (checked against them, an
        honest replica would fail). Logged and dropped."""
        newest = max(v for span in group.version_spans for v in span.versions)
        if newest <= version:
            return False
        self.ingestion.stats.count_rejection("rolled back")
        log.warning("dropped group %s: sampled at v%d, which the rollback to v%d discarded",
                    group.group_id, newest, version)
        return True

    def _generate_forever(self) -> None:
        """One generation loop: problems in, groups into the transport, until the run stops.
        Transient errors (a group lost with its peers) are logged and retried with backoff;
        anything else stops the run and is raised by the training loop."""
        backend = self.backend
        try:
            if backend.generation_cpu_threads is not None:
                torch.set_num_threads(backend.generation_cpu_threads)
            attempt = 0
            while not self.stop.is_set():
                if not all(hook.before_generation(self, self.stop) for hook in self.hooks):
                    continue
                backend.await_servers(self.stop)
                if not backend.session_slots.acquire(self.stop):
                    break
                groups: list[RolloutGroup] | None = None
                try:
                    groups = self._generate(backend.problems_per_generation)
                    attempt = 0
                except backend.transient_generation_errors as error:
                    self.generation_errors += 1
                    log.warning("generation failed: %s", error)
                    for hook in self.hooks:
                        hook.after_generation(self, succeeded=False)
                finally:  # the session is over: its slot is free before any wait below
                    backend.session_slots.release()
                if groups is None:
                    attempt += 1
                    self.stop.wait(min(10.0, 0.5 * 2 ** attempt))
                    continue
                for hook in self.hooks:
                    hook.after_generation(self, succeeded=True)
                for group in groups:
                    # A full inbox means the learner is behind; wait rather than generate more.
                    while not self.stop.is_set() and not backend.transport.put_rollouts(group,
                                                                                        POLL_S):
                        pass
        except BaseException as error:  # noqa: BLE001 - raised by the training loop
            log.exception("a generation loop failed")
            self.generation_error = error
            self.stop.set()

    # ---- ingestion ------------------------------------------------------------------------

    def _accept(self, group: RolloutGroup) -> tuple[ScoredGroup, int] | None:
        """Check, score and store one group; None when it is refused."""
        gate = self.backend.gate
        distrusted = gate.distrusted_producer(group.group_id)
        if distrusted is not None:
            self.ingestion.stats.count_rejection("distrusted")
            gate.forget(group.group_id)
            log.warning("rejected group %s: %s", group.group_id, distrusted)
            return None
        accepted = self.ingestion.ingest(group, self.trainer.version)
        if accepted is None:
            gate.forget(group.group_id)
            return None
        self.store.add_group(accepted[0], accepted[1], self.trainer.version)
        self.curriculum.observe(accepted[0])
        gate.accepted(group)
        return accepted

    def _still_trainable(self, scored: ScoredGroup) -> int | None:
        """A pending group's staleness now, or None (dropped, with the reason stored) when its
        producer was banned or it fell past the staleness bound while it waited."""
        group_id = scored.group.group_id
        distrusted = self.backend.gate.distrusted_producer(group_id)
        if distrusted is not None:
            self.store.mark_dropped([group_id], distrusted)
            return None
        try:
            return check_staleness(self.trainer.version, scored.group.stage_versions,
                                   self.config.train.max_staleness)
        # ValueError: versions the learner never had (a rollback's leftovers).
        except (StaleRolloutError, ValueError) as error:
            self.store.mark_dropped([group_id], str(error))
            self.ingestion.stats.stale += isinstance(error, StaleRolloutError)
            return None

    def _teaches(self, scored: ScoredGroup) -> bool:
        """Whether a group counts towards a batch: every group does, except under dynamic
        sampling, where only a group whose rewards vary does (the others carry no gradient)."""
        return not self.config.train.dynamic_sampling or has_spread(scored.rewards)

    def _batch_limit(self, needed: int) -> int:
        return needed * DYNAMIC_SAMPLING_LIMIT if self.config.train.dynamic_sampling else needed

    def _collect(self, needed: int) -> list[tuple[ScoredGroup, int]]:
        """Accepted groups within the staleness bound for one batch: first those accepted earlier
        and not yet trained (re-checked, they may have gone stale), then new arrivals. Under
        dynamic sampling `needed` counts groups whose rewards vary; the others come along (they
        are recorded as trained) until the batch holds `_batch_limit` groups."""
        batch: list[tuple[ScoredGroup, int]] = []
        teaching = 0
        while teaching < needed and len(batch) < self._batch_limit(needed):
            self._hold_unjudged()
            if self.pending:
                scored, _ = self.pending.pop(0)
                staleness = self._still_trainable(scored)
                if staleness is not None:
                    batch.append((scored, staleness))
                    teaching += self._teaches(scored)
                continue
            if self.generation_error is not None:
                raise RuntimeError("generation failed") from self.generation_error
            if self.stop.is_set():
                raise RuntimeError("the run was stopped while waiting for rollouts")
            group = self.backend.transport.get_rollouts(timeout=POLL_S)
            if group is not None:
                accepted = self._accept(group)
                if accepted is not None:
                    self.pending.append(accepted)
        return batch

    def _hold_unjudged(self) -> None:
        """Verdict before influence: groups picked for a check wait in `held` until their ruling,
        then join the pending ones (a failed one is dropped there, like any distrusted group)."""
        waiting = self.held + self.pending
        awaiting = [self.backend.gate.awaiting_verdict(item[0].group.group_id)
                    for item in waiting]
        self.held = [item for item, held in zip(waiting, awaiting) if held]
        self.pending = [item for item, held in zip(waiting, awaiting) if not held]

    def _generate_batch(self, needed: int) -> list[tuple[ScoredGroup, int]]:
        """Synchronous mode: generate one batch with the learner's current weights (under
        dynamic sampling, rounds until `needed` groups vary or `_batch_limit` were generated)."""
        batch: list[tuple[ScoredGroup, int]] = []
        teaching = 0
        while teaching < needed and len(batch) < self._batch_limit(needed):
            count = min(needed - teaching, self._batch_limit(needed) - len(batch))
            accepted = [a for a in map(self._accept, self._generate(count)) if a is not None]
            batch += accepted
            teaching += sum(self._teaches(scored) for scored, _ in accepted)
            # A round that brought nothing back (every group refused) ends the batch as it is.
            if not self.config.train.dynamic_sampling or not accepted:
                break
        return batch

    # ---- one step -------------------------------------------------------------------------

    def _demonstrations(self, count: int) -> list[Rollout]:
        """`count` demonstrations for the next step (a pure function of the run's seed and the
        step, so a resumed or retried step trains on the same ones)."""
        assert isinstance(self.task, Demonstrating)  # checked when the loop was made
        return demonstrations(self.task, self.backend.tokenizer, self.config.seed,
                              self.step + 1, count)

    def _train_batch(self, batch: TrainBatch,
                     scored: Sequence[tuple[ScoredGroup, int]] = ()) -> dict[str, float] | None:
        """One optimizer step on `batch` (of `scored`'s groups) and the new weights published;
        None when the step failed and the stages were recovered instead (`scored` go back to
        the pending pool first: still pending in the store, the recovery keeps them once)."""
        try:
            losses = self.trainer.train_step(batch)
        except self.backend.recoverable_step_errors as error:
            self.failed_steps += 1
            if self.failed_steps > MAX_FAILED_STEPS:
                raise RuntimeError(f"{self.failed_steps} training steps in a row failed; "
                                   f"the last: {error}") from error
            # The error may quote a training peer's refusal.
            self.console.print(f"[yellow]training step failed: "
                               f"{terminal_text(error, REMOTE_ERROR_CHARS)}[/]")
            self.pending[:0] = scored  # retried after recovery
            self._recover()
            return None
        self.backend.publish()
        self.failed_steps = 0
        return losses

    def _stepped(self, metrics: dict[str, Any]) -> None:
        """A step is done: the store records it, and every `checkpoint_every` steps a
        checkpoint."""
        self.store.record_step(self.step, self.trainer.version,
                               {k: float(v) for k, v in metrics.items()
                                if isinstance(v, (int, float)) and not isinstance(v, bool)})
        if self.step % self.config.train.checkpoint_every == 0:
            self.checkpoint(required=False)

    def supervised_step(self) -> SupervisedRecord | None:
        """One warm-up step on `supervised.rows_per_step` demonstrations; None when it failed
        and the stages were recovered instead."""
        rows = self._demonstrations(self.config.supervised.rows_per_step)
        batch = build_batch([], [], [], self.backend.tokenizer.pad_token_id, rows)
        train_started = time.time()
        losses = self._train_batch(batch)
        if losses is None:
            return None
        self.step += 1
        record = self.metrics.write(SupervisedRecord(
            step=self.step, version=self.trainer.version, rows=batch.num_sequences,
            tokens=batch.num_supervised_tokens, sft_nll=losses["sft_nll"],
            sft_token_accuracy=losses["sft_token_accuracy"], grad_norm=losses["grad_norm"],
            train_s=round(time.time() - train_started, 3)))
        self._stepped(msgspec.structs.asdict(record))
        self.console.print(supervised_line(record))
        return record

    def train_one_step(self) -> StepRecord | None:
        """Collect a batch, train on it (with `supervised.interleave_rows` demonstrations
        beside it), record the step; None when the step failed and the stages were recovered
        instead (its groups wait for the next step)."""
        config = self.config
        wait_started = time.time()
        needed = config.rollout.prompts_per_step
        scored = (self._generate_batch(needed) if config.train.mode == "sync"
                  else self._collect(needed))
        waited = time.time() - wait_started
        if not scored:
            return None
        demonstrated = (self._demonstrations(config.supervised.interleave_rows)
                        if config.supervised.interleave_rows else [])
        batch, stats, row_groups = self.ingestion.make_batch(scored, demonstrated)
        ids = [s.group.group_id for s, _ in scored]
        train_started = time.time()
        losses: dict[str, float] = {}
        if batch is not None:
            trained = self._train_batch(batch, scored)
            if trained is None:
                return None
            losses = trained
        self.step += 1
        self.store.mark_trained(ids, self.step)
        gate = self.backend.gate
        if batch is not None and self.trainer.flagged is not None:
            groups = {s.group.group_id: s.group for s, _ in scored}
            # Demonstrations come after the rollouts' rows and are never flagged.
            gate.flagged([groups[row_groups[i]]
                          for i in self.trainer.flagged.nonzero()[:, 0].tolist()])
        for group_id in ids:
            gate.trained(group_id)
        record = self.metrics.write(StepRecord(
            step=self.step, version=self.trainer.version, wait_s=round(waited, 3),
            train_s=round(time.time() - train_started, 3),
            sequences=0 if batch is None else batch.num_policy_sequences,
            supervised_rows=len(demonstrated) if batch is not None else 0,
            stale_dropped=self.ingestion.stats.stale, rejected=self.ingestion.stats.rejected,
            held_for_verdict=len(self.held),
            **stats, **losses, **self.curriculum.counters(), **self.backend.step_counters()))
        self._stepped(msgspec.structs.asdict(record))
        self.console.print(step_line(record))
        return record

    # ---- evaluation -----------------------------------------------------------------------

    def evaluate(self, label: str, pass_k: int) -> EvalResult:
        for hook in self.hooks:
            hook.before_evaluation(self, label)
        chain, concurrency = self.backend.evaluation(self.trainer.version)
        ev = self.config.eval
        # Sessions as the backend's generation makes them: a peer cannot tell which it serves
        # (but for the greedy ones, at temperature 0, which are spot-checked like the rest).
        shape = TrainingShape(self.config.rollout.group_size, sampling_config(self.config.rollout),
                              self.backend.problems_per_generation, ev.greedy)
        with progress_bar(self.console, f"evaluating ({label})", None) as update:
            result = evaluate(chain, self.eval_task, self.backend.tokenizer, ev.problems,
                              ev.max_new_tokens, ev.batch_size, pass_k=pass_k,
                              seed=self.config.seed, concurrency=concurrency,
                              progress=lambda done, total: update(done, total=total),
                              shape=shape, on_groups=self.backend.evaluated,
                              retry=self._retry_evaluation)
        greedy = result.greedy_pass1
        self.metrics.write(EvalRecord(
            label=label, step=self.step, version=self.trainer.version, task=result.task,
            problems=result.problems, pass1=result.pass1.mean, pass1_low=result.pass1.low,
            pass1_high=result.pass1.high,
            pass_k=result.pass_k.mean if result.pass_k else None, k=pass_k,
            greedy_pass1=greedy.mean if greedy else None,
            greedy_pass1_low=greedy.low if greedy else None,
            greedy_pass1_high=greedy.high if greedy else None))
        text = f"eval ({label}) step {self.step}: pass@1 {result.pass1.as_percent()}"
        if result.pass_k is not None:
            text += f"  pass@{pass_k} {result.pass_k.as_percent()}"
        if greedy is not None:
            text += f"  greedy pass@1 {greedy.as_percent()}"
        self.console.print(text)
        for hook in self.hooks:
            hook.after_evaluation(self, label, result)
        return result

    def _retry_evaluation(self, error: Exception, failures: int) -> None:
        """An evaluation session failed: wait until every stage has a server, then it runs again
        (the sessions already done count). Raises `error` when it is not one of the backend's
        transient errors or the session failed EVALUATION_ATTEMPTS times."""
        if not isinstance(error, self.backend.transient_generation_errors) \
                or failures >= EVALUATION_ATTEMPTS:
            raise error
        log.warning("an evaluation session failed (%d of %d attempts): %s", failures,
                    EVALUATION_ATTEMPTS, error)
        # Not the run's stop event: the evaluation after training runs once it is set.
        self.backend.await_servers(None)

    def _write_evaluation(self, name: str, result: EvalResult) -> None:
        (self.path / name).write_text(json.dumps(result.to_json(), indent=2))

    # ---- the run --------------------------------------------------------------------------

    def run(self, wait_s: float = 300) -> RunSummary:
        """The whole run: stages ready, the evaluation before (not when resuming), training until
        the steps or the time budget run out, a checkpoint, the evaluation after."""
        config = self.config
        started = time.time()
        (self.path / "config.json").write_text(config.model_dump_json(indent=2))
        self.console.print(self.backend.describe())
        threads = self.backend.start(self.stop, wait_s)
        self.reconcile()
        if self.backend.checkpoint_at_start and self.store.last_checkpoint() is None:
            self.checkpoint()
        self.pending = [(g.scored, g.staleness) for g in self.store.pending_groups()]
        self.backend.publish()
        before = None
        if self.step == 0:
            before = self.evaluate("before", config.eval.pass_k)
            self._write_evaluation("eval_before.json", before)
        else:
            self.console.print(f"resumed at step {self.step} (version {self.trainer.version}); "
                               f"{len(self.pending)} accepted groups pending")
        self.training_started = time.time()
        self._warm_up()
        cores = torch.get_num_threads()
        if config.train.mode == "async":
            threads += [threading.Thread(target=self._generate_forever, name=f"generate-{i}",
                                         daemon=True)
                        for i in range(self.backend.generation_threads)]
            for thread in threads[-self.backend.generation_threads:]:
                thread.start()
            cpu = self.backend.generation_cpu_threads
            if cpu is not None:  # the learner gets the cores the generation loops left
                torch.set_num_threads(max(1, cores - cpu * self.backend.generation_threads))
        try:
            self._train()
        finally:
            self.stop.set()
            for hook in self.hooks:
                hook.training_ended(self)
            join_s = config.swarm.request_timeout_s * (config.swarm.retries + 2)
            for thread in threads:
                thread.join(timeout=join_s)
                if thread.is_alive():
                    log.warning("thread %s did not stop within %.0f s", thread.name, join_s)
            torch.set_num_threads(cores)
        self.checkpoint()
        wall = time.time() - started
        after = self.evaluate("after", config.eval.pass_k)
        self._write_evaluation("eval_after.json", after)
        summary = RunSummary(self.path, self.step, wall, before, after, self.recoveries,
                             warmup=self.warmup_result)
        return self.backend.finish(summary)

    def _budget_spent(self) -> bool:
        budget = self.config.train.time_budget_s
        return budget is not None and time.time() - self.training_started > budget

    def _warm_up(self) -> None:
        """Supervised steps until `supervised.warmup_steps` (a resumed run goes on where it
        stopped; they count in the time budget), before any generation starts; then, once this
        process has finished them, the evaluation after the warm-up (eval_warmup.json), which
        like the evaluations before and after training does not count in the budget."""
        steps = self.config.supervised.warmup_steps
        if self.step >= steps:
            return
        with progress_bar(self.console, "supervised warm-up", steps) as update:
            while self.step < steps and not self.stop.is_set() and not self._budget_spent():
                self.supervised_step()
                update(self.step, description=f"supervised warm-up: step {self.step}")
        if self.step < steps:  # the budget ran out first: no RL step will run either
            return
        evaluation_started = time.time()
        self.warmup_result = self.evaluate("after warm-up", self.config.eval.pass_k)
        self._write_evaluation("eval_warmup.json", self.warmup_result)
        self.training_started += time.time() - evaluation_started

    def _train(self) -> None:
        config = self.config
        train_started = self.training_started
        for hook in self.hooks:
            hook.training_started(self)
        budget = config.train.time_budget_s
        # The bar runs over whichever ends training first: the steps or the time budget.
        by_time = budget is not None and budget < config.train.steps * 60
        with progress_bar(self.console, "training", budget if by_time else config.train.steps,
                          counted=not by_time) as update:
            try:
                while self.step < config.train.steps:
                    if self._budget_spent():
                        self.console.print(f"time budget of {budget:.0f}s reached after "
                                           f"{self.step} steps")
                        return
                    for hook in self.hooks:
                        hook.before_step(self)
                    record = self.train_one_step()
                    update(time.time() - train_started if by_time else self.step,
                           description=f"training: step {self.step}, "
                                       f"{self.ingestion.stats.accepted} groups accepted")
                    if record is None:
                        continue
                    for hook in self.hooks:
                        hook.after_step(self, record)
                    if config.eval.every and self.step % config.eval.every == 0 \
                            and self.step < config.train.steps:
                        self.evaluate("during", pass_k=1)
            except StopTraining as reason:
                self.console.print(f"training stopped after {self.step} steps: {reason}")

    def close(self) -> None:
        self.stop.set()
        self.backend.close()
        self.store.close()

"""The training loop of every run, in one process or over a swarm (the loop of DESIGN.md).

The loop owns what does not depend on where the work happens: it runs the generation loops
(coordinator/generation.py: problems scheduled durably, so a restart never hands one out twice),
takes in what comes back (coordinator/pool.py: checked, scored by the loop itself, stored in
SQLite before it counts, within the staleness bound), runs one training step, evaluates
(coordinator/evaluation.py), checkpoints and writes the metrics. A `Backend`
(coordinator/backend.py) supplies the rest: the inference chain, the stage trainers (local modules
or training peers), how new weights reach the replicas, and how checkpoints are written
(coordinator/local_backend.py, coordinator/swarm_backend.py).

Faults: a step that fails on a backend's recoverable error (a training peer died) is forgotten
everywhere, and the loop brings every stage back to the store's last version or the last complete
checkpoint, returning the groups trained after it to the pending pool. A restarted run does the
same from its store. Benchmarks and tools follow or steer the loop through `RunHooks`."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import msgspec
import torch
from rich.console import Console

from decentrl.config import RunConfig
from decentrl.coordinator.backend import Backend, RunSummary, RunView, TrainingUnavailable
from decentrl.coordinator.curriculum import Curriculum
from decentrl.coordinator.evaluation import Evaluations, write_evaluation
from decentrl.coordinator.generation import GenerationLoops, from_discarded_branch
from decentrl.coordinator.ingest import Ingestion
from decentrl.coordinator.pool import GroupPool, Pooled
from decentrl.coordinator.scheduler import PromptScheduler
from decentrl.coordinator.store import RunStore
from decentrl.coordinator.worker import RolloutWorker
from decentrl.envs import Environment, make_task_or_environment
from decentrl.envs.base import Demonstrating
from decentrl.errors import DecentrlError
from decentrl.evaluate.runner import EvalResult
from decentrl.learn.batch import TrainBatch, build_batch
from decentrl.learn.trainer import PipelineTrainer
from decentrl.net.text import REMOTE_ERROR_CHARS
from decentrl.observe.metrics import (
    MetricsLog,
    StepRecord,
    SupervisedRecord,
    step_line,
    supervised_line,
)
from decentrl.observe.terminal import terminal_text
from decentrl.observe.trackers import Trackers
from decentrl.progress import progress_bar
from decentrl.rollout.demonstrations import demonstrations
from decentrl.rollout.types import Rollout
from decentrl.tasks import Task

log = logging.getLogger(__name__)

# Training steps that may fail in a row (peers dying) before the run gives up: a step that fails
# every time is a bug, not a fault to wait out.
MAX_FAILED_STEPS = 5
# What a resumed run may change in its config: how long it runs.
RESUMABLE_CHANGES = ("train.steps", "train.time_budget_s")
# How long a recovery waits for every stage to have a training peer again.
RECOVERY_WAIT_S = 600.0


class StopTraining(DecentrlError):
    """Raised by a hook to end training early; the run then checkpoints and evaluates as at the
    end of its budget."""


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
        if (supervised.steps or supervised.interleave_rows) \
                and not isinstance(self.task, Demonstrating):
            raise ValueError(f"supervised.steps and supervised.interleave_rows need "
                             f"demonstrations, which task {config.task.name!r} cannot write "
                             "(an environment with a scripted solver can: envs/base.py "
                             "Demonstrating)")
        self.path = config.path
        self.path.mkdir(parents=True, exist_ok=True)
        self.store = RunStore(self.path / "run.sqlite")
        self.store.check_or_set_config(config.run_json(), may_change=RESUMABLE_CHANGES)
        self.curriculum = Curriculum(config.curriculum, self.task, config.rollout.group_size,
                                     config.seed)
        self.curriculum.replay(self.store.accepted_groups())  # a restart's estimates
        self.scheduler = PromptScheduler(config.seed, start=self.store.problem_position(),
                                         admits=self.curriculum.admits,
                                         replay=self.curriculum.next_replay)
        self.ingestion = Ingestion(config, self.task, backend.tokenizer, self.scheduler)
        generation = backend.generation
        self.worker = RolloutWorker(generation.chain, generation.transport, self.task,
                                    backend.tokenizer, config.rollout, self.scheduler, config.seed,
                                    record_routing=config.train.routing_replay)
        self.metrics = MetricsLog(self.path / "metrics.jsonl", time.time(), Trackers.open(
            config.host.report_to, self.path, config.name, config.model_dump(mode="json")))
        self.pool = GroupPool(config, self.store, self.ingestion, self.curriculum, backend.gate,
                              generation.transport)
        self.stop = threading.Event()
        self.generation = GenerationLoops(
            backend, self.worker, self.scheduler, self.store, self.ingestion.stats, self.stop,
            before_round=lambda stop: all(hook.before_generation(self, stop)
                                          for hook in self.hooks),
            after_round=self._after_generation)
        self.evaluations = Evaluations(config, backend, self.eval_task, backend.tokenizer,
                                       self.metrics, self.console)
        self.step = self.store.last_step()
        self.recoveries = 0
        self.failed_steps = 0
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
        self.pool.reload()
        # The same holds for groups that finished before the rollback and wait in the inbox,
        # and for sessions still generating now (`generate` checks `rollbacks` when they end).
        self.generation.rollbacks.append(version)
        self.pool.drain(lambda group: not from_discarded_branch(group, version,
                                                                self.ingestion.stats),
                        self.trainer.version)
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

    # ---- generation ----------------------------------------------------------------------

    def _after_generation(self, succeeded: bool) -> None:
        for hook in self.hooks:
            hook.after_generation(self, succeeded=succeeded)

    def collect(self, needed: int) -> list[Pooled]:
        """Asynchronous mode: accepted groups for one batch at the learner's version, from the
        pool and the generation loops (coordinator/pool.py `GroupPool.collect`)."""
        return self.pool.collect(needed, self.trainer.version, self.stop,
                                 lambda: self.generation.error)

    def _generate_batch(self, needed: int) -> list[Pooled]:
        """Synchronous mode: generate one batch with the learner's current weights (under
        dynamic sampling, rounds until `needed` groups vary or `batch_limit` were generated)."""
        batch: list[Pooled] = []
        teaching = 0
        limit = self.pool.batch_limit(needed)
        while teaching < needed and len(batch) < limit:
            count = min(needed - teaching, limit - len(batch))
            accepted = [a for a in (self.pool.accept(group, self.trainer.version)
                                    for group in self.generation.generate(count))
                        if a is not None]
            batch += accepted
            teaching += sum(self.pool.teaches(scored) for scored, _ in accepted)
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
                              self.step + 1, count, self.config.rollout.max_new_tokens)

    def _train_batch(self, batch: TrainBatch,
                     scored: Sequence[Pooled] = ()) -> dict[str, float] | None:
        """The optimizer steps of `batch` (of `scored`'s groups: train.minibatches_per_batch x
        epochs_per_batch, each a version) and the new weights published; None when the step
        failed and the stages were recovered instead (`scored` go back to the pending pool
        first: still pending in the store, the recovery keeps them once). A step that fails
        after some of its updates leaves the stages past the store's version: the recovery
        brings them back to the last checkpoint, as for a step that failed between two stages'
        updates."""
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
            self.pool.requeue(scored)  # retried after recovery
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
                  else self.collect(needed))
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
            held_for_verdict=len(self.pool.held),
            **stats, **losses, **self.curriculum.counters(), **self.backend.step_counters()))
        self._stepped(msgspec.structs.asdict(record))
        self.console.print(step_line(record))
        return record

    # ---- evaluation -----------------------------------------------------------------------

    def evaluate(self, label: str, pass_k: int) -> EvalResult:
        for hook in self.hooks:
            hook.before_evaluation(self, label)
        result = self.evaluations.run(label, pass_k, self.step, self.trainer.version)
        for hook in self.hooks:
            hook.after_evaluation(self, label, result)
        return result

    # ---- the run --------------------------------------------------------------------------

    def run(self, wait_s: float = 300) -> RunSummary:
        """The whole run: stages ready, the evaluation before (not when resuming), training until
        the steps or the time budget run out, a checkpoint, the evaluation after."""
        config = self.config
        started = time.time()
        (self.path / "config.json").write_text(config.model_dump_json(indent=2))
        threads = self.backend.start(RunView(self.stop, wait_s, self.metrics,
                                             lambda: self.step, lambda: self.trainer.version))
        self.reconcile()
        if self.backend.checkpoint_at_start and self.store.last_checkpoint() is None:
            self.checkpoint()
        self.pool.reload()
        self.backend.publish()
        before = None
        if self.step == 0:
            before = self.evaluate("before", config.eval.pass_k)
            write_evaluation(self.path / "eval_before.json", before)
        else:
            self.console.print(f"resumed at step {self.step} (version {self.trainer.version}); "
                               f"{len(self.pool.pending)} accepted groups pending")
        self.training_started = time.time()
        self._warm_up()
        cores = torch.get_num_threads()
        if config.train.mode == "async":
            generating = self.generation.threads()
            for thread in generating:
                thread.start()
            threads += generating
            generation = self.backend.generation
            if generation.cpu_threads is not None:  # the learner gets the cores they left
                torch.set_num_threads(max(1, cores - generation.cpu_threads * generation.loops))
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
        write_evaluation(self.path / "eval_after.json", after)
        summary = RunSummary(self.path, self.step, wall, before, after, self.recoveries,
                             warmup=self.warmup_result)
        return self.backend.finish(summary)

    def _budget_spent(self) -> bool:
        budget = self.config.train.time_budget_s
        return budget is not None and time.time() - self.training_started > budget

    def _warm_up(self) -> None:
        """Supervised steps until `supervised.steps` (a resumed run goes on where it
        stopped; they count in the time budget), before any generation starts; then, once this
        process has finished them, the evaluation after the warm-up (eval_warmup.json), which
        like the evaluations before and after training does not count in the budget."""
        steps = self.config.supervised.steps
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
        write_evaluation(self.path / "eval_warmup.json", self.warmup_result)
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
        self.metrics.close()  # after the backend: its observer writes records until it stops
        self.store.close()

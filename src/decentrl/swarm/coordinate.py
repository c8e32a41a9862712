"""The swarm's coordinator (`decentrl coordinate`): the loop of DESIGN.md over peers.

Generation threads (`swarm.sessions_in_flight` of them, one group per session) route prompts
through chains of inference peers, so many sessions are in flight and the hop latency is hidden.
Each finished group is checked, scored by the coordinator itself, and stored in SQLite before it is
accepted. The training loop takes accepted groups within the staleness bound, trains the pipeline
of training peers micro-batch by micro-batch, records the step, and checkpoints. The coordinator
holds no weights: peers hold their stages, checkpoints are written by the training peers.

Faults: a generation that loses a peer moves to another replica (swarm/client.py); a training peer
that dies ends the step, the coordinator waits for a replacement (it loads the last checkpoint),
rolls every stage back to that checkpoint, returns the groups trained since to the pending pool,
and goes on; a restarted coordinator does the same from its SQLite store."""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from decentrl.config import ConfigError, RunConfig
from decentrl.envs import make_task_or_environment
from decentrl.evaluate.runner import EvalResult, evaluate
from decentrl.learn.checkpoints import CheckpointLayout
from decentrl.learn.losses import StaleRolloutError, check_staleness
from decentrl.learn.trainer import PipelineTrainer, loss_config_from
from decentrl.model.blocks import ModelSpec
from decentrl.model.loading import load_tokenizer, resolve_model
from decentrl.model.stages import StagePlan
from decentrl.net.directory import Directory, SwarmUnavailable
from decentrl.net.node import SwarmNode
from decentrl.net.protocol import PeerRecord, layer_span
from decentrl.net.swarm_transport import HivemindTransport
from decentrl.observe.dashboard import DashboardServer
from decentrl.observe.live import SwarmObserver
from decentrl.observe.terminal import terminal_text
from decentrl.progress import progress_bar
from decentrl.rollout.chain import InferenceSession
from decentrl.rollout.types import ScoredGroup
from decentrl.swarm.client import RemoteChain, RemoteSession, RemoteStageWorker
from decentrl.swarm.ingest import Ingestion
from decentrl.swarm.run import MetricsLog, step_line
from decentrl.swarm.scheduler import PromptScheduler
from decentrl.swarm.store import RunStore
from decentrl.swarm.worker import RolloutWorker, sampling_config
from decentrl.trust.gate import Trust

log = logging.getLogger(__name__)

POLL_S = 0.5
# Training steps that may fail in a row (peers dying) before the run gives up: a step that fails
# every time is a bug, not a fault to wait out.
MAX_FAILED_STEPS = 5


@dataclass
class SwarmSummary:
    path: Path
    steps: int
    wall_s: float
    before: EvalResult | None
    after: EvalResult
    recoveries: int
    failovers: int
    trust: dict[str, int]  # spot-checks, flags, bans, refused submissions (Trust.counters)
    banned: dict[str, str]  # peer id -> the event that tipped it over
    dashboard_url: str | None


def check_swarm_config(config: RunConfig, spec: ModelSpec) -> None:
    """Raise ConfigError for a config the swarm cannot run on a model of `spec`."""
    try:
        StagePlan.even(spec.num_layers, config.num_stages)
    except ValueError as error:
        raise ConfigError(f"invalid configuration: {error}") from None
    if config.train.kl_coef > 0:
        raise ConfigError("train.kl_coef > 0 is not supported in the swarm yet (the reference "
                          "model would have to live on the training peers)")
    if config.train.updates_per_batch > 1:
        raise ConfigError("train.updates_per_batch > 1 is not supported in the swarm yet (fixed "
                          "proximal log-probs need a forward-only pass through the peers)")
    if config.train.mode != "async":
        raise ConfigError("the swarm coordinator runs train.mode = 'async' only")


def stages_lacking(stages: list[list[PeerRecord]]) -> list[str]:
    """What each stage still needs before a run can start, in words ("stage 1 has no training
    peer (1 is loading its weights)"); empty when every stage has what it needs."""
    lacking = []
    for index, records in enumerate(stages):
        needs = []
        if not any(r.role in ("inference", "both") for r in records):
            needs.append("no inference replica")
        trainers = [r for r in records if r.role in ("training", "both")]
        if not any(r.training_ready for r in trainers):
            loading = f" ({len(trainers)} loading)" if trainers else ""
            needs.append(f"no training peer ready{loading}")
        if needs:
            lacking.append(f"stage {index} has {' and '.join(needs)}")
    return lacking


class SwarmCoordinator:
    def __init__(self, config: RunConfig, node: SwarmNode, console: Console | None = None) -> None:
        """Checks everything about `config` that can be checked here (the model, the stages, the
        tasks, an earlier run's store) before anything is announced."""
        folder = resolve_model(config.model)
        self.spec = ModelSpec.from_hf_config(json.loads((folder / "config.json").read_text()))
        check_swarm_config(config, self.spec)
        self.task = make_task_or_environment(config.task.name, config.task.options)
        self.eval_task = make_task_or_environment(config.eval.task.name,
                                                  config.eval.task.options)
        if config.threads is not None:
            torch.set_num_threads(config.threads)  # the coordinator relays; the peers compute
        self.config, self.node = config, node
        self.console = console or Console()
        self.path = config.path
        self.path.mkdir(parents=True, exist_ok=True)
        self.checkpoints = self.path / "checkpoints"
        self.store = RunStore(self.path / "run.sqlite")
        self.store.check_or_set_config(config.model_dump_json())
        self.tokenizer = load_tokenizer(folder)
        self.directory = Directory(node, config.name, config.num_stages, config.swarm,
                                   on_change=self._peer_changed)
        self.trust = Trust(config, node, self.directory, self.spec.hidden_size,
                           self.tokenizer.pad_token_id, self.console)
        self.chain = RemoteChain(node, self.directory, config.swarm, config.trust, self.spec,
                                 self.trust.reputation)
        self.workers = [RemoteStageWorker(node, self.directory, stage, config.num_stages,
                                          config.swarm) for stage in range(config.num_stages)]
        loss = loss_config_from(config.train, config.rollout.max_new_tokens, config.trust)
        self.trainer = PipelineTrainer(self.workers, config.train, loss,
                                       sampling_config(config.rollout), torch.device("cpu"))
        self.scheduler = PromptScheduler(config.seed, start=self.store.problem_position())
        self.ingestion = Ingestion(config, self.task, self.tokenizer, self.scheduler)
        # Rollouts arrive through the transport, from this process's generation threads or from
        # any peer that submits them. The inbox holds one batch: more would wait there until the
        # staleness bound drops it.
        backlog = config.rollout.prompts_per_step
        self.transport = HivemindTransport(node, config.name, inbox_size=backlog,
                                           timeout_s=config.swarm.request_timeout_s,
                                           announce_ttl_s=5 * config.swarm.announce_every_s,
                                           admit=self.trust.admit_submission)
        self.generator = RolloutWorker(self.chain, self.transport, self.task, self.tokenizer,
                                       config.rollout, self.scheduler, config.seed)
        self.pending: list[tuple[ScoredGroup, int]] = []  # accepted, not yet trained
        self.problems_lock = threading.Lock()
        self.stop = threading.Event()
        self.step = self.store.last_step()
        self.recoveries = 0
        self.failed_steps = 0
        self.generation_errors = 0
        self.metrics = MetricsLog(self.path / "metrics.jsonl", time.time())
        self.observer = SwarmObserver(config, self.directory, self.trust.reputation, self.metrics,
                                      lambda: self.trainer.version, lambda: self.step,
                                      self.trust.counters)
        self.dashboard: DashboardServer | None = None

    # ---- the swarm ------------------------------------------------------------------------

    def wait_for_swarm(self, timeout_s: float) -> None:
        """Until every stage has an inference replica and a training peer that is ready."""
        started = time.monotonic()
        with progress_bar(self.console, "waiting for peers", timeout_s, counted=False) as update:
            while True:
                self.directory.publish_config(self.config.model_dump_json())
                self.directory.refresh()
                lacking = stages_lacking(self.directory.stage_summary())
                if not lacking:
                    return
                waited = time.monotonic() - started
                if waited > timeout_s:
                    raise SwarmUnavailable(f"after {timeout_s:.0f}s of waiting, "
                                           f"{'; '.join(lacking)}")
                update(waited, description=f"waiting for peers: {'; '.join(lacking)}")
                time.sleep(1.0)

    def _peer_changed(self, peer: str, record: PeerRecord, joined: bool) -> None:
        what = (f"stage {record.stage} layers {layer_span(record.layers)}, {record.role}"
                if joined else f"stage {record.stage}: its announcement expired")
        self.console.print(f"{terminal_text(record.name)} ({peer[-8:]}) "
                           f"{'joined' if joined else 'left'}: {what}", highlight=False)
        log.info("peer %s", "joined" if joined else "left",
                 extra={"peer_id": peer, "peer_name": record.name, "stage": record.stage,
                        "role": record.role})

    def peer_table(self) -> Table:
        table = Table(title="who holds which layers")
        for column in ("stage", "peer", "layers", "role", "version", "tok/s"):
            table.add_column(column)
        for stage, records in enumerate(self.directory.stage_summary()):
            for record in sorted(records, key=lambda r: r.name):
                table.add_row(str(stage), terminal_text(record.name), layer_span(record.layers),
                              record.role, str(record.version), f"{record.tokens_per_s:.0f}")
        return table

    def reconcile(self) -> None:
        """Make every training peer agree with the store: the last recorded version, or else the
        last complete checkpoint (groups trained after it go back to the pending pool)."""
        versions = [worker.connect() for worker in self.workers]
        expected = self.store.last_version()
        if all(v == expected for v in versions):
            return
        checkpoint = self.store.last_checkpoint()
        version, step = checkpoint if checkpoint is not None else (0, 0)
        if checkpoint is None and any(v != 0 for v in versions):
            raise SwarmUnavailable(f"training peers are at versions {versions} but this run has "
                                   "no checkpoint to bring them to; start them fresh")
        for worker in self.workers:
            if worker.version != version:
                worker.checkpoint("load", version)
        returned = self.store.return_to_pending(after_step=step)
        self.pending = [(g.scored, g.staleness) for g in self.store.pending_groups()]
        self.step = step
        self.recoveries += 1
        self.console.print(f"[yellow]training rolled back to checkpoint v{version} (step {step}); "
                           f"{returned} groups back to pending[/]")

    def wait_for_replicas(self, version: int, timeout_s: float) -> None:
        """Until every replica serves `version` (they follow the training peers), so that an
        evaluation measures the learner's weights and nothing older."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.directory.refresh()
            if all(r.version == version for records in self.directory.stage_summary()
                   for r in records if r.role != "training"):
                return
            time.sleep(0.5)
        log.warning("replicas did not reach version %d within %.0fs", version, timeout_s)

    # ---- generation -----------------------------------------------------------------------

    def _generate_forever(self) -> None:
        attempt = 0
        while not self.stop.is_set():
            with self.problems_lock:  # durable first: a restart never hands a problem out twice
                self.store.reserve_problems(1)
                indices = self.scheduler.next(1)
            sessions: list[InferenceSession] = []
            try:
                groups = self.generator.generate_groups(indices, on_session=sessions.append)
                attempt = 0
            except Exception as error:  # noqa: BLE001 - one lost group; the thread goes on
                self.generation_errors += 1
                log.warning("generation failed: %s", error)
                attempt += 1
                time.sleep(min(10.0, 0.5 * 2 ** attempt))
                continue
            session = sessions[0]
            assert isinstance(session, RemoteSession)
            for group in groups:
                self.trust.produced(group.group_id, session.provenance)
                # A full inbox means the learner is behind; wait rather than generate more.
                while not self.stop.is_set() and not self.transport.put_rollouts(group, POLL_S):
                    pass

    def _collect(self, needed: int) -> list[tuple[ScoredGroup, int]]:
        """Accepted groups within the staleness bound: first those accepted earlier and not yet
        trained (re-checked, they may have gone stale), then new arrivals, each checked, scored
        and stored in SQLite before it counts."""
        batch: list[tuple[ScoredGroup, int]] = []
        while len(batch) < needed:
            if self.pending:
                scored, _ = self.pending.pop(0)
                distrusted = self.trust.distrusted_producer(scored.group.group_id)
                if distrusted is not None:
                    self.store.mark_dropped([scored.group.group_id], distrusted)
                    continue
                try:
                    staleness = check_staleness(self.trainer.version, scored.group.stage_versions,
                                                self.config.train.max_staleness)
                except StaleRolloutError as error:
                    self.store.mark_dropped([scored.group.group_id], str(error))
                    self.ingestion.stats.stale += 1
                    continue
                batch.append((scored, staleness))
                continue
            if self.stop.is_set():
                raise RuntimeError("stopped while waiting for rollouts")
            group = self.transport.get_rollouts(timeout=POLL_S)
            if group is None:
                continue
            distrusted = self.trust.distrusted_producer(group.group_id)
            if distrusted is not None:
                self.ingestion.stats.count_rejection("distrusted")
                self.trust.forget(group.group_id)
                log.warning("rejected group %s: %s", group.group_id, distrusted)
                continue
            accepted = self.ingestion.ingest(group, self.trainer.version)
            if accepted is None:
                self.trust.forget(group.group_id)
                continue
            self.store.add_group(accepted[0], accepted[1], self.trainer.version)
            self.trust.accepted(group)
            batch.append(accepted)
        return batch

    # ---- training -------------------------------------------------------------------------

    def _train_one_step(self, metrics: MetricsLog) -> None:
        wait_started = time.time()
        scored = self._collect(self.config.rollout.prompts_per_step)
        waited = time.time() - wait_started
        batch, stats, row_groups = self.ingestion.make_batch(scored)
        ids = [s.group.group_id for s, _ in scored]
        train_started = time.time()
        losses: dict[str, float] = {}
        if batch is not None:
            try:
                losses = self.trainer.train_step(batch)
            except SwarmUnavailable as error:
                self.failed_steps += 1
                if self.failed_steps > MAX_FAILED_STEPS:
                    raise RuntimeError(f"{self.failed_steps} training steps in a row failed; "
                                       f"the last: {error}") from error
                self.console.print(f"[yellow]training step failed: {escape(str(error))}[/]")
                self.pending[:0] = scored  # still pending in the store; retried after recovery
                self._recover_training()
                return
        self.failed_steps = 0
        self.step += 1
        self.store.mark_trained(ids, self.step)
        if batch is not None and self.trainer.flagged is not None:
            groups = {s.group.group_id: s.group for s, _ in scored}
            self.trust.flagged([groups[row_groups[i]]
                                for i in self.trainer.flagged.nonzero()[:, 0].tolist()])
        for group_id in ids:
            self.trust.trained(group_id)
        record = metrics.write(
            "step", step=self.step, version=self.trainer.version, wait_s=round(waited, 3),
            train_s=round(time.time() - train_started, 3),
            sequences=0 if batch is None else batch.num_sequences,
            stale_dropped=self.ingestion.stats.stale, rejected=self.ingestion.stats.rejected,
            **self.trust.counters(),
            failovers=self.chain.failovers, wire_bytes=self.node.links.total_bytes()
            if self.node.links is not None else 0, **stats, **losses)
        self.store.record_step(self.step, self.trainer.version,
                               {k: float(v) for k, v in record.items()
                                if isinstance(v, (int, float))})
        if self.step % self.config.train.checkpoint_every == 0:
            self.checkpoint()
        self.console.print(step_line(record))

    def _recover_training(self) -> None:
        """A training peer failed mid-step: forget the step everywhere, wait for every stage to
        have a training peer again, and bring them all to one version."""
        for worker in self.workers:
            try:
                worker.discard()
            except SwarmUnavailable:
                pass
        deadline = time.monotonic() + 600
        while not self.stop.is_set():
            try:
                self.reconcile()
                return
            except SwarmUnavailable as error:
                if time.monotonic() > deadline:
                    raise
                log.warning("waiting for training peers: %s", error)
                time.sleep(2.0)

    def checkpoint(self) -> None:
        version = self.trainer.version
        for worker in self.workers:
            worker.checkpoint("save", version)
        CheckpointLayout(self.checkpoints).commit(version)
        self.store.record_checkpoint(version, self.step, len(self.workers))

    # ---- evaluation -----------------------------------------------------------------------

    def evaluate(self, label: str, pass_k: int, metrics: MetricsLog) -> EvalResult:
        phase = self.observer.phase
        self.observer.phase = "evaluating"
        self.wait_for_replicas(self.trainer.version, timeout_s=120)
        ev = self.config.eval
        with progress_bar(self.console, f"evaluating ({label})", None) as update:
            result = evaluate(self.chain, self.eval_task, self.tokenizer, ev.problems,
                              ev.max_new_tokens, ev.batch_size, pass_k=pass_k,
                              seed=self.config.seed,
                              concurrency=self.config.swarm.sessions_in_flight,
                              progress=lambda done, total: update(done, total=total))
        self.console.print(metrics.evaluation(label, self.step, self.trainer.version, result,
                                              pass_k))
        self.observer.phase = phase
        return result

    # ---- the run --------------------------------------------------------------------------

    def run(self, wait_s: float = 300) -> SwarmSummary:
        config = self.config
        started = time.time()
        metrics = self.metrics
        (self.path / "config.json").write_text(config.model_dump_json(indent=2))
        if config.swarm.dashboard_port is not None:
            self.dashboard = DashboardServer(self.observer.state, port=config.swarm.dashboard_port)
            self.dashboard.start()
            self.console.print(f"dashboard: {self.dashboard.url}")
        self.console.print(f"[bold]{config.name}[/]: coordinator {self.node.peer_id[-8:]} waiting "
                           f"for {config.num_stages} stages")
        self.wait_for_swarm(wait_s)
        self.reconcile()
        if self.store.last_checkpoint() is None:
            self.checkpoint()  # version 0: what a replacement training peer starts from
        self.console.print(self.peer_table())
        self.pending = [(g.scored, g.staleness) for g in self.store.pending_groups()]
        # Announcing (and with it the directory and the swarm snapshots) starts now, so the
        # dashboard follows the peers through the first evaluation too.
        threads = [threading.Thread(target=self._announce_forever, name="announce", daemon=True)]
        threads[0].start()
        resumed = self.step > 0
        before = None
        if not resumed:
            before = self.evaluate("before", config.eval.pass_k, metrics)
            (self.path / "eval_before.json").write_text(json.dumps(before.to_json(), indent=2))
        else:
            self.console.print(f"resumed at step {self.step} (version {self.trainer.version}); "
                               f"{len(self.pending)} accepted groups pending")
        workers = [threading.Thread(target=self._generation_thread, name=f"generate-{i}",
                                    daemon=True) for i in range(config.swarm.sessions_in_flight)]
        workers.append(threading.Thread(target=self.trust.verify_forever, args=(self.stop,),
                                        name="verify", daemon=True))
        for thread in workers:
            thread.start()
        threads += workers
        train_started = time.time()
        budget = config.train.time_budget_s
        self.observer.phase, self.observer.training_began = "training", train_started
        # The bar runs over whichever ends training first: the steps or the time budget.
        by_time = budget is not None and budget < config.train.steps * 60
        try:
            with progress_bar(self.console, "training", budget if by_time else config.train.steps,
                              counted=not by_time) as update:
                while self.step < config.train.steps:
                    if budget is not None and time.time() - train_started > budget:
                        self.console.print(f"time budget of {budget:.0f}s reached after "
                                           f"{self.step} steps")
                        break
                    self._train_one_step(metrics)
                    update(time.time() - train_started if by_time else self.step,
                           description=f"training: step {self.step}, "
                                       f"{self.ingestion.stats.accepted} groups accepted")
                    if config.eval.every and self.step % config.eval.every == 0:
                        self.evaluate("during", 1, metrics)
        finally:
            self.observer.training_ended = time.time()
            self.stop.set()
            for thread in threads:
                thread.join(timeout=config.swarm.request_timeout_s * (config.swarm.retries + 2))
        self.checkpoint()
        wall = time.time() - started
        after = self.evaluate("after", config.eval.pass_k, metrics)
        (self.path / "eval_after.json").write_text(json.dumps(after.to_json(), indent=2))
        self.console.print(self.peer_table())
        self.observer.record()
        self.observer.phase = "finished"
        return SwarmSummary(self.path, self.step, wall, before, after, self.recoveries,
                            self.chain.failovers, self.trust.counters(), self.trust.banned_peers(),
                            self.dashboard.url if self.dashboard is not None else None)

    def _announce_forever(self) -> None:
        """Keep the run config and the rollout inbox in the DHT (their entries expire), and the
        directory current: peers that joined (a restarted replica is a new peer) get sessions,
        and peers whose announcements expired stop being chosen."""
        last_snapshot = 0.0
        while not self.stop.wait(self.config.swarm.announce_every_s):
            try:
                self.directory.publish_config(self.config.model_dump_json())
                self.transport.announce_inbox()
                self.directory.refresh()
                if time.monotonic() - last_snapshot >= self.config.swarm.snapshot_every_s:
                    last_snapshot = time.monotonic()
                    self.observer.record()
            except Exception as error:  # noqa: BLE001 - the next round retries
                log.warning("announce failed: %s", error)

    def _generation_thread(self) -> None:
        try:
            self._generate_forever()
        except Exception:  # noqa: BLE001 - logged; the others keep generating
            log.exception("a generation thread failed")

    def close(self) -> None:
        self.stop.set()
        if self.dashboard is not None:
            self.dashboard.close()
        self.transport.close()
        self.store.close()

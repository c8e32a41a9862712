"""The swarm's backend of the training loop (coordinator/loop.py), for `decentrl coordinate`.

Generation loops route prompts through chains of inference peers, several groups per session,
with as many rows in flight as the swarm needs to hide the hops' latency: coordinator/inflight.py
sizes them from the round trips and throughput the sessions measure (or `swarm.sessions_in_flight`
fixes them). The stage trainers are the training peers, driven over RPC; they publish their own
weights to the replicas of their stage and write their own checkpoints (the coordinator moves
the `latest` pointer). The coordinator holds no weights. Beside the loop it keeps the run's config
and inbox announced, the directory of peers current, spot-checks rollouts (trust/gate.py) and
serves the dashboard. What it waits for from the stages is coordinator/stage_wait.py's.

The coordinator's node runs under the run owner's key (coordinator/manifest.py): it announces the
signed run manifest (config, model, stages, the roster of admitted training peers), drives only
training peers the operator admitted, and signs each stage's weight lineage
(coordinator/lineage.py).

Faults: a generation that loses a peer moves to another replica (client/sessions.py); a training
peer that dies ends the step, and the loop waits for a replacement (it loads the last checkpoint)
and rolls every stage back to that checkpoint. A stage left with no inference replica the run may
use (every one gone or banned) holds generation and evaluation until one joins or a ban ends
(`StageWait`), up to `swarm.stage_wait_s`; an evaluation resumes with the sessions it had done."""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import msgspec
import torch
from rich.console import Console
from rich.table import Table

from decentrl.client.push_sessions import PushSession
from decentrl.client.sessions import RemoteChain, RemoteSession
from decentrl.client.training import RemoteStageWorker, TrainAudit
from decentrl.client.training_push import PushedTraining
from decentrl.config import SWARM_SUPPORT_RULES, ConfigError, RunConfig, apply_rules
from decentrl.coordinator.backend import Generation, RunSummary, RunView, TrainingUnavailable
from decentrl.coordinator.inflight import RowsInFlight, SlottedChain, SlottedSession
from decentrl.coordinator.lineage import LineageSigner
from decentrl.coordinator.loop import RunHooks, TrainingLoop
from decentrl.coordinator.manifest import (
    ADMITTED_REPLICAS_FILE,
    admitted_peers,
    publish_manifest,
    run_manifest,
)
from decentrl.coordinator.replica_wait import wait_for_routed_replicas
from decentrl.coordinator.stage_wait import StageWait, stages_lacking
from decentrl.evaluate.runner import EvalResult
from decentrl.learn.checkpoints import CheckpointLayout
from decentrl.learn.stage_loss import loss_config_from
from decentrl.learn.stage_trainer import routing_replay_needs_experts
from decentrl.learn.trainer import PipelineTrainer
from decentrl.model.loading import load_tokenizer, model_spec, resolve_model
from decentrl.model.run_stage import stage_shapes
from decentrl.model.spec import ModelSpec
from decentrl.model.stages import StagePlan, routing_layers
from decentrl.net.directory import Directory, SwarmUnavailable
from decentrl.net.node import SwarmNode
from decentrl.net.protocol import SHARD_CHUNK_BYTES, PeerRecord, RosterEntry, layer_span
from decentrl.net.session import new_session
from decentrl.net.sizes import RunSizes
from decentrl.net.swarm_transport import HivemindTransport
from decentrl.net.text import peer_text
from decentrl.observe.dashboard import DashboardServer
from decentrl.observe.live import Phase, SwarmObserver
from decentrl.observe.terminal import terminal_text
from decentrl.progress import progress_bar
from decentrl.release.shards import (
    ShardError,
    ShardManifest,
    fetch_shard,
    missing_shards,
    read_manifest,
    reported_shard,
    shard_bytes_limit,
    write_manifest,
)
from decentrl.rollout.chain import InferenceChain, InferenceSession
from decentrl.rollout.sampling import sampling_config
from decentrl.rollout.types import RolloutGroup
from decentrl.trust.gate import Trust
from decentrl.trust.provenance import Provenance, group_shares

log = logging.getLogger(__name__)


def check_swarm_config(config: RunConfig, spec: ModelSpec) -> None:
    """Raise ConfigError for a config the swarm cannot run on a model of `spec`."""
    try:
        StagePlan.of(spec.num_layers, config.num_stages, config.stage_layers)
        routing_replay_needs_experts(spec, config.train)
    except ValueError as error:
        raise ConfigError(f"invalid configuration: {error}") from None
    try:
        apply_rules(config, SWARM_SUPPORT_RULES)
    except ValueError as error:
        raise ConfigError(str(error)) from None


class SwarmBackend:
    recoverable_step_errors: tuple[type[BaseException], ...] = (SwarmUnavailable,)
    checkpoint_at_start = True  # version 0: what a replacement training peer starts from

    def __init__(self, config: RunConfig, node: SwarmNode, console: Console,
                 planned: list[str] | None = None) -> None:
        """Checks everything about `config` that can be checked here (the model, the stages)
        before anything is announced. `planned`: the training peer planned for each stage,
        where the stages were planned from the peers' offers (coordinator/planning.py)."""
        folder = resolve_model(config.model)
        self.spec = model_spec(folder)
        check_swarm_config(config, self.spec)
        if config.host.threads:
            torch.set_num_threads(config.host.threads)  # the coordinator relays; the peers compute
        self.config, self.node, self.console = config, node, console
        self.manifest_ttl_s = 5 * config.swarm.announce_every_s
        # Everything but the roster is fixed for this start: hashed once, not every announcement.
        self.manifest = run_manifest(config, roster=[], session=new_session(), planned=planned)
        node.sizes = RunSizes.of(self.spec, config)  # bounds the replies it collects
        self.checkpoints = CheckpointLayout(config.path / "checkpoints")
        # What each stage's checkpoint shard may take: a training peer's report is bounded by it.
        self.shard_limits = [shard_bytes_limit(stage_shapes(config, self.spec, stage))
                             for stage in range(config.num_stages)]
        self.tokenizer = load_tokenizer(folder)
        self.directory = Directory(node, config.name, config.num_stages, config.swarm,
                                   on_change=self._peer_changed)
        # Admitted training peers start with a record (no probation); the set is read again at
        # every announce round, so admitting one mid-run takes effect within a round.
        self.vouched = admitted_peers(config.path)
        # trust.admit_replicas: only listed replicas serve (an admitted training peer serving as
        # "both" too), read again at every announce round as well.
        self.admitted_replicas = admitted_peers(config.path, ADMITTED_REPLICAS_FILE)
        admit_replicas = config.trust.admit_replicas
        plan = StagePlan.of(self.spec.num_layers, config.num_stages, config.stage_layers)
        # Each stage's part of a routing record: its training peer replays it, its verifiers
        # judge the experts claimed in it.
        stage_routing = [routing_layers(self.spec, plan.layers(stage))
                         for stage in range(config.num_stages)]
        self.trust = Trust(config, node, self.directory, self.spec.hidden_size,
                           self.tokenizer.pad_token_id, console,
                           vouched=lambda peer: peer in self.vouched,
                           admitted=lambda peer: admit_replicas and peer in self.admitted_replicas,
                           stage_routing=stage_routing)
        self.gate = self.trust
        if admit_replicas:
            self.directory.replica_admitted = \
                lambda peer: peer in self.admitted_replicas or peer in self.vouched
        # Sessions of `groups_per_session` groups; how many run at once follows the swarm.
        self.inflight = RowsInFlight(config, self._usable_replicas)
        self.chain = RemoteChain(node, self.directory, config.swarm, config.trust, self.spec,
                                 self.trust.reputation, on_step=self.inflight.observe,
                                 run_session=self.manifest.session,
                                 stage_layers=config.stage_layers)
        self.lineage = LineageSigner(node, config, self.manifest.session)
        # A stage's second training peer recomputes a random share of its steps (trust/audit.py).
        self.audit = (TrainAudit(node, self.directory, config, self.admitted,
                                 self.trust.reputation)
                      if config.trust.train_audit_fraction > 0 else None)
        self.workers = [RemoteStageWorker(node, self.directory, stage, config.num_stages,
                                          config.swarm, self.admitted, self.lineage, self.audit,
                                          stage_routing[stage])
                        for stage in range(config.num_stages)]
        self.directory.version_ceiling = lambda stage: self.workers[stage].version
        loss = loss_config_from(config.train, config.rollout.max_new_tokens, config.trust,
                                config.supervised)
        # Peer to peer, micro-batches go down the chain of training peers and only their row
        # statistics come back here (client/training_push.py).
        chain = PushedTraining(node, self.workers, config.swarm, config.name,
                               self.manifest.session) \
            if config.swarm.data_plane == "peer_to_peer" else None
        self.trainer = PipelineTrainer(self.workers, config.train, loss,
                                       sampling_config(config.rollout), torch.device("cpu"),
                                       chain=chain)
        # A resumed run's driver (its entropy bonus) goes on from its latest checkpoint.
        self._load_driver_state(self.checkpoints.latest_version())
        # Rollouts arrive through the transport, from this process's generation loops (no other
        # peer may submit: net/swarm_transport.py). The inbox holds one batch: more would wait
        # there until the staleness bound drops it.
        self.transport = HivemindTransport(node, node.peer_id,
                                           inbox_size=config.rollout.prompts_per_step,
                                           timeout_s=config.swarm.request_timeout_s)
        self.generation = Generation(
            self.chain, self.transport, loops=self.inflight.max_sessions,
            slots=self.inflight.slots, problems_per_session=self.inflight.groups_per_session,
            cpu_threads=None,  # the peers compute; this process relays
            transient_errors=(Exception,))  # a lost group
        self.closed = threading.Event()
        self.announcing = threading.Thread(target=self._announce_forever, args=(self.closed,),
                                           name="announce", daemon=True)
        self.verifying = threading.Thread(target=self.trust.verify_forever, args=(self.closed,),
                                          name="verify", daemon=True)
        self.stage_wait = StageWait(self.directory, self.trust.reputation.banned,
                                    config.swarm.stage_wait_s, console)
        self.observer: SwarmObserver | None = None  # made by `start`, which sees the loop
        self.dashboard: DashboardServer | None = None

    # ---- the swarm ------------------------------------------------------------------------

    def admitted(self, peer: str) -> bool:
        """Whether the operator admitted `peer` as a training peer (RUN/admitted.txt, read
        afresh: an operator admits a replacement without restarting the run)."""
        return peer in admitted_peers(self.config.path)

    def announce_run(self) -> None:
        """The signed run manifest, with the training peers driven now as its roster."""
        roster = [RosterEntry(stage=worker.stage, peer_id=worker.peer, since=worker.since)
                  for worker in self.workers if worker.peer is not None]
        publish_manifest(self.node, msgspec.structs.replace(self.manifest, roster=roster),
                         self.manifest_ttl_s)

    def start(self, run: RunView) -> list[threading.Thread]:
        self.console.print(f"[bold]{self.config.name}[/]: coordinator {self.node.peer_id[-8:]} "
                           f"waiting for {self.config.num_stages} stages")
        self.observer = SwarmObserver(self.config, self.directory, self.trust.reputation,
                                      run.metrics, run.version, run.step, self.trust.counters)
        if self.config.host.dashboard_port is not None:
            self.dashboard = DashboardServer(self.observer.state,
                                             port=self.config.host.dashboard_port)
            self.dashboard.start()
            self.console.print(f"dashboard: {self.dashboard.url}")
        self.wait_for_swarm(run.wait_s)
        self.console.print(self.peer_table())
        # Announcing (and with it the directory, the lineage records and the swarm snapshots)
        # starts now, so the dashboard follows the peers through the first evaluation too, and
        # goes on until the backend closes: replicas still catching up with the last version
        # after training need its lineage record, which expires unless renewed.
        self.announcing.start()
        # Spot-checks go on until the backend closes, not when training ends: the groups of the
        # evaluation after training are checked too.
        self.verifying.start()
        return []

    def wait_for_swarm(self, timeout_s: float) -> None:
        """Until every stage has an inference replica and a training peer that is ready."""
        started = time.monotonic()
        said = ""
        with progress_bar(self.console, "waiting for peers", timeout_s, counted=False) as update:
            while True:
                self.announce_run()
                self.directory.refresh()
                admitted = self.vouched = admitted_peers(self.config.path)  # once per look
                lacking = stages_lacking(self.directory.stage_peers(), admitted.__contains__)
                if not lacking:
                    return
                waited = time.monotonic() - started
                if waited > timeout_s:
                    raise SwarmUnavailable(f"after {timeout_s:.0f}s of waiting, "
                                           f"{'; '.join(lacking)}")
                waiting = f"waiting for peers: {'; '.join(lacking)}"
                update(waited, description=waiting)
                # Without a terminal (a server's log file) the bar is off: say each change.
                if not self.console.is_terminal and waiting != said:
                    self.console.print(waiting, highlight=False)
                    said = waiting
                time.sleep(1.0)

    def _usable_replicas(self) -> list[int]:
        """Each stage's inference replicas the run may use now (not banned)."""
        banned = self.trust.reputation.banned
        return [sum(record.role in ("inference", "both") and not banned(peer)
                    for peer, record in peers) for peers in self.directory.stage_peers()]

    def _peer_changed(self, peer: str, record: PeerRecord, joined: bool) -> None:
        what = (f"stage {record.stage} layers {layer_span(record.layers)}, {record.role}"
                if joined else f"stage {record.stage}: its announcement expired")
        self.console.print(f"{terminal_text(record.name)} ({terminal_text(peer[-8:])}) "
                           f"{'joined' if joined else 'left'}: {what}", highlight=False)
        log.info("peer %s", "joined" if joined else "left",
                 extra={"peer_id": peer_text(peer), "peer_name": peer_text(record.name),
                        "stage": record.stage, "role": record.role})

    def peer_table(self) -> Table:
        table = Table(title="who holds which layers")
        for column in ("stage", "peer", "layers", "role", "version", "tok/s"):
            table.add_column(column)
        for stage, records in enumerate(self.directory.stage_summary()):
            for record in sorted(records, key=lambda r: r.name):
                table.add_row(str(stage), terminal_text(record.name), layer_span(record.layers),
                              record.role, str(record.version), f"{record.tokens_per_s:.0f}")
        return table

    def _announce_forever(self, stop: threading.Event) -> None:
        """Keep the run config and the rollout inbox in the DHT (their entries expire), and the
        directory current: peers that joined (a restarted replica is a new peer) get sessions,
        and peers whose announcements expired stop being chosen."""
        last_snapshot = 0.0
        while not stop.wait(self.config.swarm.announce_every_s):
            try:
                self.announce_run()
                self.vouched = admitted_peers(self.config.path)
                self.admitted_replicas = admitted_peers(self.config.path, ADMITTED_REPLICAS_FILE)
                self.lineage.renew()
                self.directory.refresh()
                if self.observer is not None and \
                        time.monotonic() - last_snapshot >= self.config.swarm.snapshot_every_s:
                    last_snapshot = time.monotonic()
                    self.observer.record()
            except Exception as error:  # noqa: BLE001 - the next round retries
                log.warning("announce failed: %s", error)

    # ---- the stage trainers ---------------------------------------------------------------

    def versions(self) -> list[int]:
        try:
            return [worker.connect() for worker in self.workers]
        except SwarmUnavailable as error:
            raise TrainingUnavailable(str(error)) from error

    def load_checkpoint(self, version: int) -> None:
        for worker in self.workers:
            if worker.version != version:
                worker.checkpoint("load", version)
        self._load_driver_state(version)

    def _load_driver_state(self, version: int | None) -> None:
        """The driver's state (`PipelineTrainer.driver_state`) of checkpoint `version`, which
        this coordinator wrote beside its shard manifest; none before the first."""
        meta = None if version is None else self.checkpoints.meta_file(version)
        if meta is None or not meta.is_file():
            return
        try:
            saved = json.loads(meta.read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"{meta} is not a checkpoint's bookkeeping: {error}") from None
        self.trainer.load_driver_state(saved)

    def save_checkpoint(self, version: int, step: int, problem_position: int) -> None:
        committed = self.checkpoints.latest_version()
        saved = [worker.checkpoint("save", version, -1 if committed is None else committed)
                 for worker in self.workers]
        # Each shard sits on its training peer's disk: the run folder keeps, signed, which one
        # is part of this checkpoint (release/shards.py).
        try:
            shards = [reported_shard(worker.stage, worker.peer or "", reply.shard_sha256,
                                     reply.shard_bytes, self.shard_limits[worker.stage])
                      for worker, reply in zip(self.workers, saved, strict=True)]
        except ShardError as error:  # this checkpoint fails as if the peer had not answered
            raise SwarmUnavailable(f"checkpoint v{version}: {error}") from error
        write_manifest(self.checkpoints, ShardManifest(version, shards), self.node.identity)
        self.checkpoints.meta_file(version).write_text(json.dumps(
            {"version": version, "step": step, "scheduled": problem_position,
             **self.trainer.driver_state()}))
        self.checkpoints.commit(version)

    def fetch_shards(self) -> None:
        """Bring every shard of the latest checkpoint that the run folder lacks from its
        training peer, checked against the signed manifest: the release needs them all."""
        version = self.checkpoints.latest_version()
        manifest = None if version is None else \
            read_manifest(self.checkpoints, version, self.node.peer_id)
        if manifest is None:
            return
        for record in missing_shards(self.checkpoints, manifest):
            worker = self.workers[record.stage]
            self.console.print(f"fetching stage {record.stage}'s checkpoint shard "
                               f"({record.bytes / 2**20:.0f} MiB) from its training peer")
            fetch_shard(worker.shard_chunk, manifest.version, record,
                        self.checkpoints.stage_file(manifest.version, record.stage),
                        self.node.circuits.piece_bytes(record.peer) or SHARD_CHUNK_BYTES)

    def discard_step(self) -> None:
        for worker in self.workers:
            try:
                worker.discard()
            except SwarmUnavailable:
                pass  # the peer that failed the step; its replacement starts clean

    def publish(self) -> None:
        pass  # each training peer publishes its stage's update itself

    # ---- generation and evaluation --------------------------------------------------------

    def _shares(self, groups: list[RolloutGroup], session: InferenceSession) -> list[Provenance]:
        """Each group's share of the provenance of `session`, which generated them all."""
        if isinstance(session, SlottedSession):  # an evaluation's
            session = session.session
        assert isinstance(session, RemoteSession | PushSession)
        return group_shares(session.provenance, groups, self.config.trust.sketch_dims)

    def generated(self, groups: list[RolloutGroup], sessions: list[InferenceSession]) -> None:
        for group, provenance in zip(groups, self._shares(groups, sessions[0]), strict=True):
            self.trust.produced(group.group_id, provenance)

    def evaluation(self, version: int) -> tuple[InferenceChain, int]:
        self.await_servers(None)
        # Only the replicas sessions go to, a quorum per stage, for a short while at most (a
        # stage left with none is the sessions' StageWait's).
        waited = wait_for_routed_replicas(self.directory, version)
        if waited.waited_s >= 1 or not waited.complete:
            self.console.print(f"evaluation: {waited.text()}", markup=False, highlight=False)
        # As many sessions as the run may hold; the slots let as many run as the target allows.
        return SlottedChain(self.chain, self.inflight.slots), self.inflight.max_sessions

    def evaluated(self, groups: list[RolloutGroup], session: InferenceSession) -> None:
        for group, provenance in zip(groups, self._shares(groups, session), strict=True):
            self.trust.evaluated(group, provenance)

    def await_servers(self, stop: threading.Event | None) -> None:
        self.stage_wait.until_served(stop)

    def step_counters(self) -> dict[str, Any]:
        links = self.node.links
        inflight = self.inflight.state
        return {**self.trust.counters(), "failovers": self.chain.failovers,
                "wire_bytes": links.total_bytes() if links is not None else 0,
                "rows_in_flight": inflight.rows, "step_round_trip_s": inflight.round_trip_s,
                "rows_stepped_per_s": inflight.rows_per_s, **self.lineage.fidelity_fields()}

    def finish(self, summary: RunSummary) -> RunSummary:
        self.console.print(self.peer_table())
        try:
            self.fetch_shards()
        except (ShardError, SwarmUnavailable) as error:
            # The run is done; the release needs every shard, and `export` will say which.
            self.console.print(f"[yellow]the release lacks a checkpoint shard: "
                               f"{terminal_text(error)}[/]")
        summary.failovers = self.chain.failovers
        summary.trust = {**self.trust.counters(),
                         "trained_from_banned": self.trust.trained_from_banned(),
                         **(self.audit.count if self.audit is not None else {})}
        summary.banned = self.trust.banned_peers()
        summary.dashboard_url = self.dashboard.url if self.dashboard is not None else None
        return summary

    def close(self) -> None:
        self.closed.set()
        for thread in (self.verifying, self.announcing):  # both may be using the node
            if thread.is_alive():
                thread.join(timeout=self.config.swarm.request_timeout_s)
        if self.dashboard is not None:
            self.dashboard.close()
        self.lineage.close()
        self.transport.close()


class ObserverHooks(RunHooks):
    """Keeps the swarm observer's phase (the dashboard shows it) in step with the loop. Every hook
    runs after the backend started, which made the observer."""

    def __init__(self, backend: SwarmBackend) -> None:
        self.backend = backend
        self.phase_before_evaluation: Phase = "waiting"

    @property
    def observer(self) -> SwarmObserver:
        assert self.backend.observer is not None, "the loop calls its hooks once it started"
        return self.backend.observer

    def training_started(self, loop: TrainingLoop) -> None:
        self.observer.phase, self.observer.training_began = "training", time.time()

    def before_evaluation(self, loop: TrainingLoop, label: str) -> None:
        self.phase_before_evaluation = self.observer.phase
        self.observer.phase = "evaluating"

    def after_evaluation(self, loop: TrainingLoop, label: str, result: EvalResult) -> None:
        self.observer.phase = "finished" if label == "after" else self.phase_before_evaluation
        if label == "after":
            self.observer.record()

    def training_ended(self, loop: TrainingLoop) -> None:
        self.observer.training_ended = time.time()


def swarm_run(config: RunConfig, node: SwarmNode, console: Console | None = None,
              hooks: list[RunHooks] | None = None, planned: list[str] | None = None
              ) -> TrainingLoop[SwarmBackend]:
    """The coordinator of a swarm run on `node`; `.run(wait_s)` waits for the peers and runs,
    `.close()` releases it. Raises ConfigError for a config the swarm cannot run. `planned`:
    the peer of each stage, where the stages were planned from offers."""
    console = console or Console()
    backend = SwarmBackend(config, node, console, planned)
    return TrainingLoop(config, backend, console, [*(hooks or []), ObserverHooks(backend)])

"""A whole post-training run on one machine: the coordinator, a rollout worker (the inference
replicas of every stage) and the training chain, joined by the in-process transport. Asynchronous
by default: the worker keeps generating with the weights it has while the learner trains, and
picks up each new version between generations. `mode = "sync"` alternates instead.

A run folder holds the config it ran with, metrics.jsonl (one line per step and per evaluation),
eval_before.json / eval_after.json, checkpoints/ (resumable), and final/ (a Hugging Face folder).

With `train.lora_rank > 0` every stage, the learner's and the replicas', carries the same LoRA
adapters (the replicas' are overwritten by the learner's, so their state dicts must match); only
the adapters train, and the final export merges them."""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from decentrl.config import RunConfig, TrainConfig
from decentrl.device import compute_dtype, pick_device
from decentrl.envs import make_task_or_environment
from decentrl.evaluate.runner import EvalResult, evaluate
from decentrl.learn.checkpoints import CheckpointLayout
from decentrl.learn.trainer import PipelineTrainer, loss_config_from
from decentrl.model.loading import LoadedModel, load_model
from decentrl.model.lora import add_lora
from decentrl.model.stages import StageModule, StagePlan, build_stages
from decentrl.net.local import LocalTransport
from decentrl.progress import progress_bar
from decentrl.release.export import export_hf_folder
from decentrl.rollout.chain import LocalChain
from decentrl.rollout.types import ScoredGroup
from decentrl.swarm.ingest import Ingestion
from decentrl.swarm.scheduler import PromptScheduler
from decentrl.swarm.worker import RolloutWorker, sampling_config

# How long the learner waits for rollouts before checking that the worker is still alive.
POLL_SECONDS = 0.5


@dataclass
class RunSummary:
    path: Path
    steps: int
    wall_s: float
    before: EvalResult
    after: EvalResult


class MetricsLog:
    """metrics.jsonl, and this run's records in memory for the dashboard. Written from the
    training loop and the swarm's observer thread."""

    def __init__(self, path: Path, started: float) -> None:
        self.path, self.started = path, started
        self.records: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"event": event, "elapsed_s": round(time.time() - self.started, 3), **fields}
        with self.lock:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            self.records.append(record)
        return record

    def of(self, event: str) -> list[dict[str, Any]]:
        with self.lock:
            return [r for r in self.records if r["event"] == event]

    def evaluation(self, label: str, step: int, version: int, result: EvalResult,
                   pass_k: int) -> str:
        """Log an evaluation; returns its one-line summary."""
        self.write("eval", label=label, step=step, version=version, task=result.task,
                   problems=result.problems, pass1=result.pass1.mean,
                   pass1_low=result.pass1.low, pass1_high=result.pass1.high,
                   pass_k=result.pass_k.mean if result.pass_k else None, k=pass_k)
        text = f"eval ({label}) step {step}: pass@1 {result.pass1.as_percent()}"
        if result.pass_k is not None:
            text += f"  pass@{pass_k} {result.pass_k.as_percent()}"
        return text


def step_line(record: dict[str, Any]) -> str:
    """The console line of a training step's metrics record."""
    return (f"step {record['step']:4d}  v{record['version']}  reward {record['reward']:.3f}  "
            f"acc {record['accuracy']:.3f}  len {record['completion_tokens_mean']:.1f}  "
            f"stale {record['staleness_mean']:.2f}  wait {record['wait_s']:.1f}s  "
            f"train {record['train_s']:.1f}s  t={record['elapsed_s']:.0f}s")


def copy_weights(source: list[StageModule], target: LocalChain) -> None:
    for index, stage in enumerate(source):
        target.load_stage(index, stage.version, stage.state_dict())


def with_lora(stages: list[StageModule], train: TrainConfig, seed: int) -> list[StageModule]:
    """`stages`, with LoRA adapters added when the config trains adapters."""
    if train.lora_rank > 0:
        for stage in stages:
            add_lora(stage, train.lora_rank, train.lora_alpha, train.lora_targets, seed)
    return stages


class LocalRun:
    def __init__(self, config: RunConfig, console: Console | None = None,
                 model: LoadedModel | None = None) -> None:
        self.config = config
        self.console = console or Console()
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        random.seed(config.seed)
        torch.manual_seed(config.seed)
        self.device = pick_device(config.device)
        self.dtype = compute_dtype(self.device, config.dtype)
        self.model = model or load_model(config.model)
        spec = self.model.spec
        self.plan = StagePlan.even(spec.num_layers, config.num_stages)
        self.task = make_task_or_environment(config.task.name, config.task.options)
        self.eval_task = make_task_or_environment(config.eval.task.name,
                                                  config.eval.task.options)
        tensors = self.model.tensors
        # fp32 master weights for the learner; the inference replicas run in the compute dtype.
        learner = with_lora(build_stages(spec, self.plan, tensors, self.device, torch.float32),
                            config.train, config.seed)
        # The KL reference is the base model: no adapters.
        reference = (build_stages(spec, self.plan, tensors, self.device, self.dtype)
                     if config.train.kl_coef > 0 else None)
        self.trainer = PipelineTrainer.local(
            learner, config.train,
            loss_config_from(config.train, config.rollout.max_new_tokens, config.trust),
            sampling_config(config.rollout), self.dtype, reference)

        def replica() -> LocalChain:
            stages = build_stages(spec, self.plan, tensors, self.device, self.dtype)
            return LocalChain(with_lora(stages, config.train, config.seed))

        self.chain, self.eval_chain = replica(), replica()
        # Room for the batches allowed in flight by the staleness bound, no more.
        groups_in_flight = config.rollout.prompts_per_step * max(1, config.train.max_staleness)
        self.transport = LocalTransport(max_queued_groups=groups_in_flight)
        self.path = config.path
        self.checkpoints = self.path / "checkpoints"
        self.step = 0
        scheduler_start = 0
        if CheckpointLayout(self.checkpoints).latest() is not None:
            meta = self.trainer.load(self.checkpoints)
            self.step, scheduler_start = meta["step"], meta["scheduled"]
            copy_weights([t.stage for t in self.trainer.stage_trainers], self.chain)
            self.console.print(f"resumed {self.path} at step {self.step} "
                               f"(version {self.trainer.version})")
        self.scheduler = PromptScheduler(config.seed, start=scheduler_start)
        self.ingestion = Ingestion(config, self.task, self.model.tokenizer, self.scheduler)
        self.worker = RolloutWorker(self.chain, self.transport, self.task, self.model.tokenizer,
                                    config.rollout, self.scheduler, config.seed)

    # ---- evaluation ----------------------------------------------------------------------

    def evaluate(self, label: str, pass_k: int) -> EvalResult:
        copy_weights([t.stage for t in self.trainer.stage_trainers], self.eval_chain)
        ev = self.config.eval
        with progress_bar(self.console, f"evaluating ({label})", None) as update:
            result = evaluate(self.eval_chain, self.eval_task, self.model.tokenizer, ev.problems,
                              ev.max_new_tokens, ev.batch_size, pass_k=pass_k,
                              seed=self.config.seed,
                              progress=lambda done, total: update(done, total=total))
        self.console.print(self.metrics.evaluation(label, self.step, self.trainer.version,
                                                   result, pass_k))
        return result

    # ---- the loop ------------------------------------------------------------------------

    def _collect(self, stop: threading.Event, needed: int) -> list[tuple[ScoredGroup, int]]:
        """Accepted groups for one batch (asynchronous mode): waits on the transport, but never
        past a dead worker."""
        scored: list[tuple[ScoredGroup, int]] = []
        while len(scored) < needed:
            if self.worker.error is not None:
                raise RuntimeError("the rollout worker failed") from self.worker.error
            if stop.is_set():
                raise RuntimeError("the run was stopped while waiting for rollouts")
            group = self.transport.get_rollouts(timeout=POLL_SECONDS)
            if group is None:
                continue
            accepted = self.ingestion.ingest(group, self.trainer.version)
            if accepted is not None:
                scored.append(accepted)
        return scored

    def _generate_sync(self) -> list[tuple[ScoredGroup, int]]:
        self.worker.sync_weights()
        indices = self.scheduler.next(self.config.rollout.prompts_per_step)
        scored = []
        for group in self.worker.generate_groups(indices):
            accepted = self.ingestion.ingest(group, self.trainer.version)
            if accepted is not None:
                scored.append(accepted)
        return scored

    def _publish(self) -> None:
        for trainer in self.trainer.stage_trainers:
            self.transport.publish_stage(trainer.stage.index, trainer.stage.version,
                                         trainer.stage.state_dict())

    def _checkpoint(self) -> None:
        self.trainer.save(self.checkpoints, {"step": self.step,
                                             "scheduled": self.scheduler.position})

    def run(self) -> RunSummary:
        config = self.config
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "config.json").write_text(config.model_dump_json(indent=2))
        started = time.time()
        self.metrics = MetricsLog(self.path / "metrics.jsonl", started)
        self.console.print(
            f"[bold]{config.name}[/]: {self.model.path.name} on {self.device} ({self.dtype}), "
            f"{self.plan.num_stages} stages "
            + ", ".join(f"stage {i}: layers {r.start}-{r.stop - 1}"
                        for i, r in enumerate(map(self.plan.layers, range(self.plan.num_stages))))
            + f"; {config.train.mode} mode")
        before = self.evaluate("before", config.eval.pass_k)
        (self.path / "eval_before.json").write_text(json.dumps(before.to_json(), indent=2))
        self._publish()
        stop = threading.Event()
        worker_thread = None
        cores = torch.get_num_threads()
        if config.train.mode == "async":
            worker_threads = None
            if self.device.type == "cpu":
                # Two compute-bound threads on one pool oversubscribe the cores; split them.
                worker_threads = max(1, cores // 2)
                torch.set_num_threads(max(1, cores - worker_threads))
            worker_thread = threading.Thread(target=self.worker.run, args=(stop, worker_threads),
                                             name="rollout-worker", daemon=True)
            worker_thread.start()
        train_started = time.time()
        try:
            while self.step < config.train.steps:
                if config.train.time_budget_s is not None \
                        and time.time() - train_started > config.train.time_budget_s:
                    self.console.print(f"time budget of {config.train.time_budget_s:.0f}s "
                                       f"reached after {self.step} steps")
                    break
                self._train_one_step(stop)
                if config.eval.every and self.step % config.eval.every == 0 \
                        and self.step < config.train.steps:
                    self.evaluate("during", pass_k=1)
        finally:
            stop.set()
            if worker_thread is not None:
                worker_thread.join(timeout=600)
                if worker_thread.is_alive():
                    raise RuntimeError("the rollout worker did not stop within 600 s")
            self.transport.close()
            torch.set_num_threads(cores)
        self._checkpoint()
        wall = time.time() - started
        after = self.evaluate("after", config.eval.pass_k)
        (self.path / "eval_after.json").write_text(json.dumps(after.to_json(), indent=2))
        # The run's own folder: a resumed run replaces what it exported before.
        export_hf_folder([t.stage for t in self.trainer.stage_trainers], self.model.hf_config,
                         self.model.tokenizer, self.path / "final", force=True)
        return RunSummary(self.path, self.step, wall, before, after)

    def _train_one_step(self, stop: threading.Event) -> None:
        config = self.config
        wait_started = time.time()
        if config.train.mode == "async":
            scored = self._collect(stop, config.rollout.prompts_per_step)
        else:
            scored = self._generate_sync()
        waited = time.time() - wait_started
        if not scored:
            return
        batch, stats, _ = self.ingestion.make_batch(scored)
        train_started = time.time()
        losses: dict[str, float] = {}
        if batch is not None:
            losses = self.trainer.train_step(batch)
            self._publish()
        self.step += 1
        record = self.metrics.write(
            "step", step=self.step, version=self.trainer.version,
            wait_s=round(waited, 3), train_s=round(time.time() - train_started, 3),
            sequences=0 if batch is None else batch.num_sequences,
            stale_dropped=self.ingestion.stats.stale,
            rejected=self.ingestion.stats.rejected, **stats, **losses)
        if self.step % config.train.checkpoint_every == 0:
            self._checkpoint()
        self.console.print(step_line(record))

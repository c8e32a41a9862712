"""The backend of a run on one machine (coordinator/loop.py runs it): every stage in this process,
the learner's fp32 stage trainers, one inference replica of every stage for generation and one for
evaluation, joined by the in-process transport. Asynchronous by default: one generation loop keeps
generating with the weights it has while the learner trains, and picks up each new version between
generations. `mode = "sync"` alternates instead.

A run folder holds the config it ran with, metrics.jsonl, run.sqlite (accepted groups, steps,
checkpoints), eval_before.json / eval_after.json, checkpoints/ (resumable), and model/ (a Hugging
Face folder, `RUN_MODEL_DIR`).

With `train.lora_rank > 0` every stage, the learner's and the replicas', carries the same LoRA
adapters (the replicas' are overwritten by the learner's, so their state dicts must match); only
the adapters train, and the final export merges them."""

from __future__ import annotations

import random
import threading
from typing import Any

import torch
from rich.console import Console

from decentrl.config import RUN_MODEL_DIR, RunConfig, TrainConfig
from decentrl.coordinator.backend import Gate, Generation, RunSummary, RunView, TrustEveryone
from decentrl.coordinator.inflight import SessionSlots, groups_in_flight
from decentrl.coordinator.loop import RunHooks, TrainingLoop
from decentrl.device import compute_dtype, pick_device
from decentrl.learn.checkpoints import CheckpointLayout
from decentrl.learn.stage_loss import loss_config_from
from decentrl.learn.trainer import PipelineTrainer
from decentrl.model.loading import LoadedModel, load_model
from decentrl.model.lora import add_lora
from decentrl.model.stages import StageModule, StagePlan, build_stages
from decentrl.net.local import LocalTransport
from decentrl.release.export import export_hf_folder
from decentrl.rollout.chain import InferenceChain, InferenceSession, LocalChain
from decentrl.rollout.sampling import sampling_config
from decentrl.rollout.types import RolloutGroup


def copy_weights(source: list[StageModule], target: LocalChain) -> None:
    for index, stage in enumerate(source):
        target.load_stage(index, stage.version, stage.state_dict())


def with_lora(stages: list[StageModule], train: TrainConfig, seed: int) -> list[StageModule]:
    """`stages`, with LoRA adapters added when the config trains adapters."""
    if train.lora_rank > 0:
        for stage in stages:
            add_lora(stage, train.lora_rank, train.lora_alpha, train.lora_targets, seed)
    return stages


class LocalBackend:
    recoverable_step_errors: tuple[type[BaseException], ...] = ()
    checkpoint_at_start = False  # nothing to replace: the learner lives in this process

    def __init__(self, config: RunConfig, console: Console, model: LoadedModel | None = None,
                 gate: Gate | None = None) -> None:
        """`gate`: trust every rollout by default (this process generates them all); a test's
        own gate stands in for a swarm's."""
        self.config, self.console = config, console
        self.gate = gate or TrustEveryone()
        if config.host.threads:
            torch.set_num_threads(config.host.threads)
        random.seed(config.seed)
        torch.manual_seed(config.seed)
        self.device = pick_device(config.host.device)
        self.dtype = compute_dtype(self.device, config.host.dtype)
        self.model = model or load_model(config.model)
        self.tokenizer = self.model.tokenizer
        spec = self.model.spec
        self.plan = StagePlan.of(spec.num_layers, config.num_stages, config.stage_layers)
        tensors = self.model.tensors
        # fp32 master weights for the learner; the inference replicas run in the compute dtype.
        learner = with_lora(build_stages(spec, self.plan, tensors, self.device, torch.float32),
                            config.train, config.seed)
        # The KL reference is the base model: no adapters.
        reference = (build_stages(spec, self.plan, tensors, self.device, self.dtype)
                     if config.train.kl_coef > 0 else None)
        self.trainer = PipelineTrainer.local(
            learner, config.train,
            loss_config_from(config.train, config.rollout.max_new_tokens, config.trust,
                             config.supervised),
            sampling_config(config.rollout), self.dtype, reference, config.supervised)

        def replica() -> LocalChain:
            stages = build_stages(spec, self.plan, tensors, self.device, self.dtype)
            return LocalChain(with_lora(stages, config.train, config.seed))

        self.chain, self.eval_chain = replica(), replica()
        # Room for the batches allowed in flight by the staleness bound, no more.
        self.transport = LocalTransport(max_queued_groups=groups_in_flight(config))
        self.generation = Generation(
            self.chain, self.transport,
            loops=1, slots=SessionSlots(1),  # one session of a step's problems at a time
            problems_per_session=config.rollout.prompts_per_step,
            # Two compute-bound threads on one CPU pool oversubscribe the cores; split them.
            cpu_threads=(max(1, torch.get_num_threads() // 2)
                         if self.device.type == "cpu" and config.train.mode == "async" else None),
            transient_errors=())  # here, an error is a bug
        self.checkpoints = CheckpointLayout(config.path / "checkpoints")
        if self.checkpoints.latest() is not None:
            self.trainer.load(self.checkpoints.root)

    def start(self, run: RunView) -> list[threading.Thread]:
        config, plan = self.config, self.plan
        self.console.print(
            f"[bold]{config.name}[/]: {self.model.path.name} on {self.device} ({self.dtype}), "
            f"{plan.num_stages} stages "
            + ", ".join(f"stage {i}: layers {r.start}-{r.stop - 1}"
                        for i, r in enumerate(map(plan.layers, range(plan.num_stages))))
            + f"; {config.train.mode} mode")
        return []  # every stage is ready in this process, and no thread of its own runs

    def versions(self) -> list[int]:
        return [t.stage.version for t in self.trainer.stage_trainers]

    def load_checkpoint(self, version: int) -> None:
        if self.checkpoints.latest_version() != version:
            raise FileNotFoundError(f"{self.checkpoints.root} holds no checkpoint v{version}")
        self.trainer.load(self.checkpoints.root)

    def save_checkpoint(self, version: int, step: int, problem_position: int) -> None:
        self.trainer.save(self.checkpoints.root, {"step": step, "scheduled": problem_position})

    def discard_step(self) -> None:
        for worker in self.trainer.workers:
            worker.discard()

    def publish(self) -> None:
        for trainer in self.trainer.stage_trainers:
            self.transport.publish_stage(trainer.stage.index, trainer.stage.version,
                                         trainer.stage.state_dict())

    def generated(self, groups: list[RolloutGroup], sessions: list[InferenceSession]) -> None:
        pass

    def evaluation(self, version: int) -> tuple[InferenceChain, int]:
        copy_weights([t.stage for t in self.trainer.stage_trainers], self.eval_chain)
        return self.eval_chain, 1

    def evaluated(self, groups: list[RolloutGroup], session: InferenceSession) -> None:
        pass  # generated in this process: nothing to check

    def await_servers(self, stop: threading.Event | None) -> None:
        pass  # every stage is in this process

    def step_counters(self) -> dict[str, Any]:
        return {}

    def finish(self, summary: RunSummary) -> RunSummary:
        # The run's own folder: a resumed run replaces what it exported before.
        export_hf_folder([t.stage for t in self.trainer.stage_trainers], self.model.hf_config,
                         self.tokenizer, self.config.path / RUN_MODEL_DIR, force=True)
        return summary

    def close(self) -> None:
        self.transport.close()


def local_run(config: RunConfig, console: Console | None = None,
              model: LoadedModel | None = None, hooks: list[RunHooks] | None = None,
              gate: Gate | None = None) -> TrainingLoop[LocalBackend]:
    """A run with every stage in this process; `.run()` runs it, `.close()` releases it."""
    console = console or Console()
    return TrainingLoop(config, LocalBackend(config, console, model, gate), console, hooks)

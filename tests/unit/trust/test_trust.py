"""The trust layer's pieces that need no network: reputation and bans, the teacher-forced layout
of a generation session (re-executing it reproduces the behaviour log-probs), its segments per
version span, and the trainer's own poison flags."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import build, layout_logits
from swarm_helpers import tiny_run_config

from decentrl.config import TrainConfig, TrustConfig
from decentrl.coordinator.scheduler import PromptScheduler
from decentrl.coordinator.worker import RolloutWorker
from decentrl.learn.batch import TrainBatch, build_batch
from decentrl.learn.losses import LossConfig, flagged_rows
from decentrl.learn.stage_loss import loss_config_from
from decentrl.learn.trainer import PipelineTrainer
from decentrl.model.loading import LoadedModel, load_model
from decentrl.model.stages import StageModule
from decentrl.rollout.chain import LocalChain
from decentrl.rollout.sampling import sampling_config, sampling_logprobs
from decentrl.rollout.types import Rollout, RolloutGroup, VersionSpan
from decentrl.tasks import make_task
from decentrl.trust.reputation import Reputation
from decentrl.trust.verify import segments, session_layout


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_reputation_bans_liars_and_forgives_an_honest_peers_rare_miss() -> None:
    clock = Clock()
    bans: list[tuple[str, float]] = []
    reputation = Reputation(ban_score=0.5, ban_s=100, on_ban=[lambda p, s: bans.append((p, s))],
                            clock=clock)
    for _ in range(10):
        reputation.record("honest", "passed")
    assert not reputation.record("honest", "failed", "a false alarm")
    assert reputation.score("honest") == pytest.approx(11 / 12)
    assert not reputation.banned("honest")

    assert not reputation.record("liar", "failed", "first")  # 1 / 2: not below 0.5
    assert reputation.record("liar", "failed", "second")  # 1 / 3
    assert reputation.banned("liar") and bans == [("liar", 100)]
    assert reputation.counts("liar") == {"failed": 2}

    assert reputation.record("forger", "proved", "signed a lie")  # one proof is enough
    for _ in range(4):
        assert not reputation.record("noisy", "malformed")  # 1 / 2 after four
    assert reputation.record("noisy", "malformed")

    clock.now = 101  # the first ban is over: a fresh start, but the next ban is twice as long
    assert not reputation.banned("liar")
    reputation.record("liar", "failed")
    assert reputation.record("liar", "failed")
    assert bans[-1] == ("liar", 200)


def group_of(chain: LocalChain, model: LoadedModel, config, index: int = 0) -> RolloutGroup:
    task = make_task(config.task.name, **config.task.options)
    worker = RolloutWorker(chain, None, task, model.tokenizer, config.rollout,
                           PromptScheduler(config.seed), config.seed)
    return worker.generate_groups([index])[0]


def test_teacher_forced_layout_reproduces_the_behaviour_logprobs(
        tiny_sharp_dir: Path) -> None:
    model = load_model(str(tiny_sharp_dir))
    config = tiny_run_config(tiny_sharp_dir, 2, rollout={
        "group_size": 4, "max_new_tokens": 10, "temperature": 0.9, "top_k": 30})
    stages = build(model, 2)
    group = group_of(LocalChain(stages), model, config)
    layout = session_layout(group, model.tokenizer.pad_token_id)
    lengths = [len(r.completion_tokens) for r in group.rollouts]
    assert layout.width == layout.prompt_columns + max(lengths) - 1
    assert int((layout.targets >= 0).sum()) == sum(lengths)
    # One prefill over the whole layout gives every sampled token's log-prob again.
    logits = layout_logits(stages, layout)
    scored = layout.targets >= 0
    again = sampling_logprobs(logits[scored], layout.targets[scored],
                              sampling_config(config.rollout))
    torch.testing.assert_close(again, layout.claimed[scored], rtol=0, atol=1e-4)


def test_segments_follow_the_version_spans() -> None:
    rollout = Rollout(prompt_tokens=[5, 6, 7], completion_tokens=[1, 2, 3, 4, 5],
                      behaviour_logprobs=[-1.0] * 5, finished=False)
    short = Rollout(prompt_tokens=[5], completion_tokens=[1, 2], behaviour_logprobs=[-1.0] * 2,
                    finished=True)
    group = RolloutGroup(group_id="g", task="sums", problem_index=0, stage_versions=[3, 7],
                         version_spans=[VersionSpan(start=0, versions=[3, 7]),
                                        VersionSpan(start=2, versions=[4, 7])],
                         sampling_seed=1, rollouts=[rollout, short])
    layout = session_layout(group, pad_id=0)
    # Prompts left-padded to 3 columns, then the first 4 completion tokens fed (5 steps); the
    # short row's stop token was fed too, then padding.
    assert layout.prompt_columns == 3 and layout.width == 7
    assert layout.ids[1].tolist() == [0, 0, 5, 1, 2, 0, 0]
    assert layout.valid[1].tolist() == [False, False, True, True, True, False, False]
    assert layout.positions[1, 2:].tolist() == [0, 1, 2, 3, 4]
    assert layout.targets[1].tolist() == [-1, -1, 1, 2, -1, -1, -1]
    # Steps 0-1 (prefill and the column of token 0) at [3, 7], steps 2-4 at [4, 7].
    assert segments(group, layout) == [(0, 4, [3, 7]), (4, 7, [4, 7])]


def step_gradients(model: LoadedModel, train: TrainConfig, loss: LossConfig, batch: TrainBatch
                   ) -> torch.Tensor:
    """Every parameter's gradient, flattened in stage and parameter order, as one training step
    from fresh copies of `model`'s weights hands it to the optimizer."""
    trainer = PipelineTrainer.local(build(model, 2), train, loss, sampling_config(
        tiny_run_config(Path("."), 2).rollout), torch.float32)
    captured: list[torch.Tensor] = []
    for worker in trainer.stage_trainers:
        def capture(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any,
                    stage: StageModule = worker.stage) -> None:
            captured.extend(torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                            for p in stage.parameters())
        worker.optimizer.register_step_pre_hook(capture)
    trainer.train_step(batch)
    return torch.cat([g.flatten() for g in captured])


def relative_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b|: how far `a` is from `b`, whatever the gradients' scale."""
    return float((a - b).norm() / b.norm())


def test_trainer_flags_poisoned_rows_and_leaves_them_out_of_the_loss(
        tiny_model: LoadedModel) -> None:
    # No clipping: the gradients compared below reach the optimizer exactly as the loss made them.
    train = TrainConfig(micro_batch_size=4, lr=1e-2, max_grad_norm=None)
    loss = loss_config_from(train, 8, TrustConfig())
    assert flagged_rows(torch.tensor([-1.0, -7.0, -1.0]), torch.tensor([0.1, 0.1, -2.0]),
                        loss).tolist() == [False, True, True]
    assert not flagged_rows(torch.tensor([-9.0]), torch.tensor([9.0]),
                            LossConfig(name="grpo")).any()
    stages = build(tiny_model, 2)
    trainer = PipelineTrainer.local(stages, train, loss, sampling_config(
        tiny_run_config(Path("."), 2).rollout), torch.float32)
    # Four rows of one prompt with different completions, behaviour log-probs = the policy's,
    # except the third row's, forged 3 nats low. Distinct rows: a trainer that left out the
    # wrong row would not match the batch without the forged one.
    prompt = [3, 4, 5]
    completions = [[7, 8, 9, 10], [11, 12, 13, 14], [15, 16, 17, 18], [19, 20, 21, 22]]
    forged = 2
    honest = trainer._chain_logprobs(stages, build_batch(
        [Rollout(prompt_tokens=prompt, completion_tokens=tokens, behaviour_logprobs=[0.0] * 4,
                 finished=False) for tokens in completions],
        [0.0] * 4, [0] * 4, 0)).tolist()
    rows = [Rollout(prompt_tokens=prompt, completion_tokens=tokens,
                    behaviour_logprobs=[v - 3.0 for v in logprobs] if i == forged else logprobs,
                    finished=False)
            for i, (tokens, logprobs) in enumerate(zip(completions, honest))]
    advantages = [1.0, -1.0, 1.0, -0.5]
    batch = build_batch(rows, advantages, [0] * 4, 0)
    metrics = trainer.train_step(batch)
    assert trainer.flagged is not None and trainer.flagged.tolist() == [False, False, True, False]
    assert metrics["flagged_fraction"] == pytest.approx(0.25)
    assert trainer.row_stats is not None
    torch.testing.assert_close(trainer.row_stats[1][:2], torch.zeros(2), atol=1e-4, rtol=0)

    # Left out of the loss: the flagged batch's gradient is the gradient of the batch without
    # the forged row. The loss's normalisers keep the whole batch's counts (4 rows of 4 tokens)
    # so that a flag does not reweight the other rows; the smaller batch normalises by 3 rows,
    # hence the factor 3/4.
    kept = [i for i in range(4) if i != forged]
    flagged = step_gradients(tiny_model, train, loss, batch)
    without = step_gradients(tiny_model, train, loss, build_batch(
        [rows[i] for i in kept], [advantages[i] for i in kept], [0] * 3, 0))
    assert relative_distance(flagged, 0.75 * without) < 1e-5
    # With the flags off, the forged row (its behaviour weight capped at tis_cap) moves the
    # gradient: the comparison above can tell a row left out from a row left in.
    unflagged_loss = loss_config_from(train, 8)
    assert unflagged_loss.flag_log_ratio is None and unflagged_loss.flag_surprise is None
    assert relative_distance(step_gradients(tiny_model, train, unflagged_loss, batch),
                             flagged) > 0.1

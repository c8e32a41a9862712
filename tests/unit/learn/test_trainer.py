"""The training chain: batch layout, gradient accumulation and stage boundaries that change nothing,
learning that happens, several updates per batch, the KL term, checkpoints that resume exactly, and
a non-finite gradient that is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import ADVANTAGES, MAX_NEW, SAMPLING, build, max_difference, weights

from decentrl.config import TrainConfig
from decentrl.learn.batch import TrainBatch, build_batch, minibatch_rows
from decentrl.learn.losses import LOSS_NAMES
from decentrl.learn.stage_loss import loss_config_from
from decentrl.learn.stage_trainer import stage_forward
from decentrl.learn.trainer import PipelineTrainer
from decentrl.model.loading import LoadedModel
from decentrl.model.stages import StageModule
from decentrl.rollout.types import Rollout


def make_trainer(model: LoadedModel, num_stages: int = 2, *,
                 reference: list[StageModule] | None = None, **train: object) -> PipelineTrainer:
    config = TrainConfig(**{"lr": 1e-4, **train})
    return PipelineTrainer.local(build(model, num_stages), config,
                                 loss_config_from(config, MAX_NEW), SAMPLING, torch.float32,
                                 reference_stages=reference)


@pytest.fixture(scope="module")
def batch(rollouts: list[Rollout], tiny_model: LoadedModel) -> TrainBatch:
    return build_batch(rollouts, ADVANTAGES, [0] * len(rollouts), tiny_model.tokenizer.pad_token_id)


# ------------------------------------------------------------------------------------ batch layout

def rollout(prompt: list[int], completion: list[int], logprobs: list[float]) -> Rollout:
    return Rollout(prompt_tokens=prompt, completion_tokens=completion,
                   behaviour_logprobs=logprobs, finished=True)


def test_batch_layout_by_hand() -> None:
    pad = 9
    batch = build_batch([rollout([5, 6, 7], [8, 3], [-0.1, -0.2]),
                         rollout([1], [2, 3, 4], [-0.3, -0.4, -0.5]),
                         rollout([5, 6, 7], [4], [-0.6])],
                        [0.5, -0.5, 0.25], [0, 2, 1], pad)
    # Each distinct prompt once, left-padded to 3; rows 0 and 2 share prompt 0.
    assert batch.prompts.tolist() == [[5, 6, 7], [pad, pad, 1]]
    assert batch.prompt_valid.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch.prompt_positions.tolist() == [[0, 1, 2], [0, 0, 0]]
    assert batch.prompt_of.tolist() == [0, 1, 0]
    # Completions right-padded to 3; their positions continue after each prompt's real length.
    assert batch.completions.tolist() == [[8, 3, pad], [2, 3, 4], [4, pad, pad]]
    assert batch.completion_valid.tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0]]
    assert batch.completion_positions.tolist() == [[3, 4, 5], [1, 2, 3], [3, 4, 5]]
    assert torch.allclose(batch.behaviour_logprobs,
                          torch.tensor([[-0.1, -0.2, 0], [-0.3, -0.4, -0.5], [-0.6, 0, 0]]))
    assert batch.advantages.tolist() == [0.5, -0.5, 0.25]
    assert batch.staleness.tolist() == [0, 2, 1]
    assert batch.num_sequences == 3 and batch.num_target_tokens == 6
    assert [b.num_sequences for b in batch.split(2)] == [2, 1]
    # A selection keeps only the prompts its rows use, re-indexed.
    tail = batch.select(slice(1, 3))
    assert tail.prompts.tolist() == [[5, 6, 7], [pad, pad, 1]]
    assert tail.prompt_of.tolist() == [1, 0]
    last = batch.select(slice(2, 3))
    assert last.prompts.tolist() == [[5, 6, 7]] and last.prompt_of.tolist() == [0]


def test_shared_prompt_forward_equals_the_flat_forward(tiny_model: LoadedModel,
                                                       batch: TrainBatch) -> None:
    """Running each prompt once and gathering its keys/values for every completion gives the
    same logits as running every (prompt + completion) row in full."""
    stages = build(tiny_model, 2)
    x: object = (batch.prompts, batch.completions)
    for stage in stages:
        x = stage_forward(stage, x, batch)  # type: ignore[arg-type]
    shared_logits = x
    # Flat: each row is its prompt (left-padded) followed by its completion.
    tokens = torch.cat([batch.prompts[batch.prompt_of], batch.completions], dim=1)
    valid = torch.cat([batch.prompt_valid[batch.prompt_of], batch.completion_valid], dim=1)
    positions = torch.cat([batch.prompt_positions[batch.prompt_of],
                           batch.completion_positions], dim=1)
    flat = tokens
    for stage in stages:
        flat = stage(flat, positions, valid)
    prompt_length = batch.prompts.shape[1]
    predicting = flat[:, prompt_length - 1:-1][batch.completion_valid]
    assert torch.allclose(shared_logits, predicting, atol=1e-5)


@pytest.mark.parametrize(("rollouts_", "advantages", "staleness", "message"), [
    ([], [], [], "no rollouts"),
    ([rollout([1], [2], [-0.1])], [1.0, 2.0], [0], "1 rollouts but 2 advantages"),
    ([rollout([1], [2], [-0.1])], [1.0], [], "0 staleness"),
])
def test_batch_errors(rollouts_: list[Rollout], advantages: list[float], staleness: list[int],
                      message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_batch(rollouts_, advantages, staleness, 0)


@pytest.mark.parametrize(("prompt", "completion", "logprobs", "generated", "message"), [
    ([1], [2, 3], [-0.1], None, "2 completion tokens but 1 behaviour log-probs"),
    ([], [2], [-0.1], None, "needs a prompt and a completion"),
    ([1], [], [], None, "needs a prompt and a completion"),
    ([1], [2, 3], [-0.1, 0.0], [True], "the generated mask has 1 entries for 2"),
    ([1], [2], [-0.1], [False], "must mark at least one sampled"),
])
def test_a_rollouts_lists_must_agree(prompt: list[int], completion: list[int],
                                     logprobs: list[float], generated: list[bool] | None,
                                     message: str) -> None:
    # Ingestion runs this check on every rollout a peer sends; batching relies on it.
    broken = Rollout(prompt_tokens=prompt, completion_tokens=completion,
                     behaviour_logprobs=logprobs, finished=True, generated=generated)
    with pytest.raises(ValueError, match=message):
        broken.check_lengths()
    rollout([1], [2, 3], [-0.1, -0.2]).check_lengths()  # a consistent one passes


# -------------------------------------------------------- the same update however the work is cut

@pytest.mark.parametrize("loss", LOSS_NAMES)
def test_gradient_accumulation_matches_full_batch(tiny_model: LoadedModel, batch: TrainBatch,
                                                  loss: str) -> None:
    initial = weights(make_trainer(tiny_model))
    results = []
    for micro_batch_size in (1, 3, batch.num_sequences):
        trainer = make_trainer(tiny_model, loss=loss, micro_batch_size=micro_batch_size)
        metrics = trainer.train_step(batch)
        results.append((weights(trainer), metrics["grad_norm"]))
    (full, full_norm) = results[-1]
    # Adam's first step moves every weight with a real gradient by ~lr = 1e-4.
    assert max_difference(full, initial) > 5e-5
    for accumulated, norm in results[:-1]:
        # The gradients agree to ~1e-6 relative (fp32 sums in another order). Adam's first step
        # is lr * g / (|g| + 1e-8): it amplifies that noise only where |g| ~ 1e-8, which a
        # few weights always have; measured worst case 3e-7, so 1e-6 is 1% of the step size.
        assert max_difference(accumulated, full) < 1e-6
        # Adam hides a uniform gradient scale (a wrong normaliser); the norm does not.
        assert norm == pytest.approx(full_norm, rel=1e-5)


def test_stage_boundaries_change_nothing(tiny_model: LoadedModel, batch: TrainBatch) -> None:
    results = []
    for num_stages in (1, 3, 4):
        trainer = make_trainer(tiny_model, num_stages, micro_batch_size=4)
        metrics = trainer.train_step(batch)
        results.append((weights(trainer), metrics))
    (one, one_metrics) = results[0]
    for many, metrics in results[1:]:
        assert max_difference(many, one) < 1e-6
        assert metrics["grad_norm"] == pytest.approx(one_metrics["grad_norm"], rel=1e-5)
        assert metrics["policy_loss"] == pytest.approx(one_metrics["policy_loss"], abs=1e-6)


# ----------------------------------------------------------------------------------------- learning

def completion_logprobs(trainer: PipelineTrainer, batch: TrainBatch) -> torch.Tensor:
    """Summed log-prob of each sequence's completion under the trainer's current weights."""
    logprobs = trainer._chain_logprobs([t.stage for t in trainer.stage_trainers], batch)
    return (logprobs * batch.completion_valid).sum(1)


def test_positive_advantage_raises_the_completion_logprob(tiny_model: LoadedModel,
                                                          rollouts: list[Rollout]) -> None:
    # Two completions of the same prompt: the first rewarded, the second punished.
    batch = build_batch(rollouts[:2], [1.0, -1.0], [0, 0], tiny_model.tokenizer.pad_token_id)
    trainer = make_trainer(tiny_model, lr=1e-2)
    before = completion_logprobs(trainer, batch)
    for _ in range(5):
        trainer.train_step(batch)
    after = completion_logprobs(trainer, batch)
    assert trainer.version == 5
    # Each completion is ~12 tokens at ~-4.4 nats under a near-uniform start; five steps of
    # lr 1e-2 move them by whole nats, far beyond any numerical noise.
    assert after[0] > before[0] + 1.0
    assert after[1] < before[1] - 1.0


def test_two_minibatches_per_batch(tiny_model: LoadedModel, batch: TrainBatch) -> None:
    trainer = make_trainer(tiny_model, lr=5e-2, minibatches_per_batch=2, micro_batch_size=2)
    metrics = trainer.train_step(batch)
    assert trainer.version == 2
    assert all(t.stage.version == 2 for t in trainer.stage_trainers)
    for key in ("clip_fraction", "ratio_mean", "tis_weight_mean", "policy_loss", "grad_norm",
                "entropy"):
        assert key in metrics
    # The second minibatch is scored against the proximal policy fixed before the first step,
    # so its ratios move away from 1 and some get clipped.
    assert metrics["ratio_mean"] != pytest.approx(1.0, abs=1e-3)
    assert 0 < metrics["clip_fraction"] <= 1


def test_minibatches_share_the_rows_and_each_is_a_version(tiny_model: LoadedModel,
                                                          batch: TrainBatch) -> None:
    assert [(r.start, r.stop) for r in minibatch_rows(6, 4)] == [(0, 1), (1, 3), (3, 4), (4, 6)]
    assert [(r.start, r.stop) for r in minibatch_rows(2, 4)] == [(0, 1), (1, 2)]
    # Rounded up (the former split), 8 rows in 3 minibatches were 3 + 3 + 2 rows, and 6 rows in
    # 4 only 3 minibatches: a batch took fewer versions than asked for.
    trainer = make_trainer(tiny_model, lr=1e-3, minibatches_per_batch=3, micro_batch_size=2)
    trainer.train_step(batch)
    assert trainer.version == 3
    trainer.train_step(batch.select(slice(0, 2)))  # fewer rows than minibatches: one a row
    assert trainer.version == 5


def test_one_update_scores_against_the_current_policy(tiny_model: LoadedModel,
                                                      batch: TrainBatch,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With one optimizer step the proximal log-probs are the detached current ones: a
    forward-only pass computes the same numbers, so the step is the same with it or without."""
    plain = make_trainer(tiny_model, lr=5e-2, micro_batch_size=3)
    plain_metrics = plain.train_step(batch)
    forced = make_trainer(tiny_model, lr=5e-2, micro_batch_size=3)
    monkeypatch.setattr(PipelineTrainer, "needs_proximal", property(lambda self: True))
    forced_metrics = forced.train_step(batch)
    assert forced.version == plain.version == 1
    assert forced_metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert forced_metrics["clip_fraction"] == 0
    assert forced_metrics["policy_loss"] == pytest.approx(plain_metrics["policy_loss"], abs=1e-6)
    assert max_difference(weights(forced), weights(plain)) < 1e-6


def test_the_proximal_pass_changes_nothing(tiny_model: LoadedModel, batch: TrainBatch) -> None:
    trainer = make_trainer(tiny_model, micro_batch_size=3, minibatches_per_batch=2)
    before = weights(trainer)
    proximal = trainer.proximal_logprobs(batch)
    stages = [t.stage for t in trainer.stage_trainers]
    torch.testing.assert_close(proximal, trainer._chain_logprobs(stages, batch), atol=1e-6,
                               rtol=0)
    assert bool((proximal[~batch.completion_valid] == 0).all())
    assert bool((proximal[batch.completion_valid] < 0).all())
    assert trainer.version == 0 and max_difference(weights(trainer), before) == 0
    assert all(not t.saved and not t.optimizer.state for t in trainer.stage_trainers)
    assert all(p.grad is None for t in trainer.stage_trainers for p in t.params)


def test_epochs_pass_over_the_batch_again(tiny_model: LoadedModel, batch: TrainBatch) -> None:
    once = make_trainer(tiny_model, lr=5e-2, minibatches_per_batch=2, micro_batch_size=2)
    once.train_step(batch)
    twice = make_trainer(tiny_model, lr=5e-2, minibatches_per_batch=2, epochs_per_batch=2,
                         micro_batch_size=2)
    seen: list[tuple[int, dict[str, float]]] = []  # (version, metrics) of each micro-batch
    micro_step = twice._micro_step

    def recorded(*args: object) -> tuple[dict[str, float], object]:
        metrics, rows = micro_step(*args)  # type: ignore[arg-type]
        seen.append((twice.version, metrics))
        return metrics, rows
    twice._micro_step = recorded  # type: ignore[method-assign]
    metrics = twice.train_step(batch)
    assert once.version == 2 and twice.version == 4
    assert max_difference(weights(twice), weights(once)) > 1e-3
    # The trust flags come from the first pass: the same as one pass's, not those of a policy
    # already trained on the rows.
    assert once.row_stats is not None and twice.row_stats is not None
    for first, again in zip(once.row_stats, twice.row_stats, strict=True):
        assert torch.equal(first, again)
    # Both passes scored every row against the proximal log-probs fixed before the first
    # update: the first update's ratios are 1, every later one's moved off it (the second pass
    # sees a policy trained on its rows), and the step's metrics are the means over all of them.
    ratios = {version: [m["ratio_mean"] for v, m in seen if v == version] for version in range(4)}
    assert all(r == pytest.approx(1.0, abs=1e-6) for r in ratios[0])
    assert all(abs(r - 1) > 1e-3 for version in (1, 2, 3) for r in ratios[version])
    for key in ("ratio_mean", "clip_fraction", "policy_loss"):
        assert metrics[key] == pytest.approx(sum(m[key] for _, m in seen) / len(seen))


def test_kl_to_reference(tiny_model: LoadedModel, batch: TrainBatch) -> None:
    trainer = make_trainer(tiny_model, lr=1e-2, kl_coef=0.1, reference=build(tiny_model, 2))
    first = trainer.train_step(batch)
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy starts at the reference
    for _ in range(2):
        last = trainer.train_step(batch)
    assert last["kl"] > 1e-4
    with pytest.raises(ValueError, match="reference stages"):
        make_trainer(tiny_model, kl_coef=0.1)


# -------------------------------------------------------------------------------------- checkpoints

def test_checkpoint_resumes_exactly(tiny_model: LoadedModel, batch: TrainBatch,
                                    tmp_path: Path) -> None:
    config = {"lr": 1e-2, "lr_warmup_steps": 4, "micro_batch_size": 3}
    straight = make_trainer(tiny_model, **config)
    for _ in range(3):
        straight.train_step(batch)

    first = make_trainer(tiny_model, **config)
    for _ in range(2):
        first.train_step(batch)
    first.save(tmp_path / "ckpt", {"step": 2})
    resumed = make_trainer(tiny_model, **config)
    assert resumed.load(tmp_path / "ckpt") == {"version": 2, "step": 2}
    assert resumed.version == 2
    resumed.train_step(batch)
    assert resumed.version == 3
    # Weights, Adam moments, step counts and the warmup position all came back: bitwise equal.
    straight_weights, resumed_weights = weights(straight), weights(resumed)
    assert all(torch.equal(straight_weights[k], resumed_weights[k]) for k in straight_weights)


def test_checkpoint_missing_files(tiny_model: LoadedModel, batch: TrainBatch,
                                  tmp_path: Path) -> None:
    trainer = make_trainer(tiny_model)
    trainer.train_step(batch)
    trainer.save(tmp_path / "ckpt", {})
    fresh = make_trainer(tiny_model)
    before = weights(fresh)
    with pytest.raises(FileNotFoundError, match="no 'latest' pointer"):
        fresh.load(tmp_path / "elsewhere")
    # Resuming needs the optimizer state beside the weights (an export does not).
    (tmp_path / "ckpt" / "v1" / "stage1.optimizer.pt").unlink()
    with pytest.raises(FileNotFoundError, match=r"has no stage1\.optimizer\.pt"):
        fresh.load(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "v1" / "stage1.pt").unlink()
    with pytest.raises(FileNotFoundError, match="stage1.pt"):
        fresh.load(tmp_path / "ckpt")
    # A checkpoint that cannot load whole changes nothing: stage 0 was not loaded on its own.
    assert max_difference(weights(fresh), before) == 0
    assert fresh.version == 0


def test_checkpoint_keeps_the_previous_one_until_the_new_one_is_complete(
        tiny_model: LoadedModel, batch: TrainBatch, tmp_path: Path) -> None:
    trainer = make_trainer(tiny_model)
    trainer.train_step(batch)
    trainer.save(tmp_path / "ckpt", {"step": 1})
    trainer.train_step(batch)
    # A save that died before moving the pointer: v2 is half written, v1 stays the checkpoint.
    (tmp_path / "ckpt" / "v2").mkdir()
    (tmp_path / "ckpt" / "v2" / "stage0.pt").write_bytes(b"partial")
    fresh = make_trainer(tiny_model)
    assert fresh.load(tmp_path / "ckpt") == {"version": 1, "step": 1}
    # A complete save moves the pointer and removes the older folders.
    trainer.save(tmp_path / "ckpt", {"step": 2})
    assert (tmp_path / "ckpt" / "latest").read_text() == "v2"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest", "v2"]


def test_checkpoint_with_mismatched_stage_versions_is_refused(
        tiny_model: LoadedModel, batch: TrainBatch, tmp_path: Path) -> None:
    trainer = make_trainer(tiny_model)
    trainer.train_step(batch)
    folder = trainer.save(tmp_path / "ckpt", {})
    state = torch.load(folder / "stage1.pt", weights_only=True)
    state["version"] = 7
    torch.save(state, folder / "stage1.pt")
    fresh = make_trainer(tiny_model)
    with pytest.raises(ValueError, match="holds version 7"):
        fresh.load(tmp_path / "ckpt")
    assert fresh.version == 0


# ------------------------------------------------------------------------------ non-finite gradient

def test_non_finite_gradient_is_refused(tiny_model: LoadedModel, batch: TrainBatch) -> None:
    trainer = make_trainer(tiny_model)
    before = weights(trainer)
    layer = trainer.stage_trainers[0].stage.layers[0]
    hook = layer.mlp.up_proj.weight.register_hook(lambda grad: grad * float("nan"))
    with pytest.raises(FloatingPointError, match="gradient norm is nan"):
        trainer.train_step(batch)
    assert max_difference(weights(trainer), before) == 0
    assert trainer.version == 0
    assert all(p.grad is None for t in trainer.stage_trainers for p in t.stage.parameters())
    hook.remove()
    trainer.train_step(batch)  # the discarded update left nothing behind to trip the next one
    assert trainer.version == 1
    assert max_difference(weights(trainer), before) > 5e-5


# ---------------------------------------------------------------------------- entropy control

def test_clip_cov_over_every_token_stops_the_whole_policy_gradient(
        tiny_model: LoadedModel, batch: TrainBatch) -> None:
    """Clip-Cov's selection is made over the whole batch from its proximal log-probs and reaches
    every micro-batch: with every token selected nothing moves, with 30% a step happens and
    30% of the counted tokens are reported selected."""
    every = {"method": "clip_cov", "fraction": 1.0, "clip_cov_bounds": (-1e9, 1e9)}
    frozen = make_trainer(tiny_model, lr=5e-2, micro_batch_size=2, entropy=every)
    assert frozen.needs_proximal  # the selection needs the proximal log-probs first
    before = weights(frozen)
    metrics = frozen.train_step(batch)
    assert frozen.version == 1 and metrics["cov_selected_fraction"] == pytest.approx(1.0)
    assert max_difference(weights(frozen), before) == 0.0
    some = make_trainer(tiny_model, lr=5e-2, micro_batch_size=2,
                        entropy={**every, "fraction": 0.3})
    metrics = some.train_step(batch)
    counted = int(batch.completion_generated.sum())
    # Micro-batches of equal token counts would make the mean exact; here it is close.
    assert metrics["cov_selected_fraction"] == pytest.approx(int(0.3 * counted) / counted,
                                                             abs=0.1)
    assert max_difference(weights(some), before) > 1e-3


def test_the_selection_is_the_batchs_and_the_same_for_the_same_version(
        tiny_model: LoadedModel, batch: TrainBatch) -> None:
    trainer = make_trainer(tiny_model, micro_batch_size=2,
                           entropy={"method": "kl_cov", "fraction": 0.25},
                           minibatches_per_batch=2)
    proximal = trainer.proximal_logprobs(batch)
    chosen = trainer._covariance_selection(batch, proximal)
    assert chosen is not None and chosen.dtype == torch.bool
    counted = batch.completion_generated & ~batch.supervised[:, None]
    assert int(chosen.sum()) == int(0.25 * int(counted.sum()))
    assert not bool((chosen & ~counted).any())
    assert torch.equal(chosen, trainer._covariance_selection(batch, proximal))


def test_the_adaptive_bonus_rises_below_its_target_and_raises_the_entropy(
        tiny_model: LoadedModel, batch: TrainBatch) -> None:
    """A target above any entropy the tiny model has: the coefficient climbs by a step per
    update up to its cap, and the bonus moves the policy towards more entropy than the same
    steps without it."""
    bonus = {"target": 20.0, "coef_step": 0.5, "max_coef": 1.0}
    with_bonus = make_trainer(tiny_model, lr=5e-2, micro_batch_size=2, entropy=bonus)
    without = make_trainer(tiny_model, lr=5e-2, micro_batch_size=2)
    coefs = []
    for _ in range(3):
        metrics = with_bonus.train_step(batch)
        coefs.append(metrics["entropy_coef"])
        plain = without.train_step(batch)
    assert coefs == [0.0, 0.5, 1.0]  # applied from the update after the first below target
    assert with_bonus.entropy_bonus is not None and with_bonus.entropy_bonus.coef == 1.0
    assert "entropy_coef" not in plain
    assert with_bonus.train_step(batch)["entropy"] > without.train_step(batch)["entropy"]


def test_a_checkpoint_keeps_the_adaptive_coefficient(tiny_model: LoadedModel, batch: TrainBatch,
                                                     tmp_path: Path) -> None:
    bonus = {"target": 20.0, "coef_step": 0.25, "max_coef": 1.0}
    trainer = make_trainer(tiny_model, micro_batch_size=4, entropy=bonus)
    for _ in range(2):
        trainer.train_step(batch)
    trainer.save(tmp_path, {"step": 2})
    resumed = make_trainer(tiny_model, micro_batch_size=4, entropy=bonus)
    assert resumed.entropy_bonus is not None and resumed.entropy_bonus.coef == 0.0
    info = resumed.load(tmp_path)
    assert info["entropy_coef"] == resumed.entropy_bonus.coef == 0.5
    assert resumed.entropy_bonus.applied == 0.5  # below target when saved: applied at once
    with pytest.raises(ValueError, match="entropy_coef must be a number in \\[0, 1.0\\]"):
        resumed.load_driver_state({"entropy_coef": 7.0})
    assert resumed.entropy_bonus.coef == 0.5

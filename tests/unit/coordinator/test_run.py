"""The whole single-machine loop on a tiny model: both modes run, write a complete run folder,
resume from their checkpoint, and reject what a peer must not be able to slip in."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import msgspec
import pytest
import torch
from swarm_helpers import tiny_run_config
from transformers import AutoModelForCausalLM

from decentrl.config import RUN_MODEL_DIR, ConfigError, RunConfig, load_config, parse_config
from decentrl.coordinator.ingest import Ingestion
from decentrl.coordinator.local_backend import local_run
from decentrl.coordinator.pool import DYNAMIC_SAMPLING_LIMIT
from decentrl.coordinator.scheduler import replay_attempt, replay_index
from decentrl.rollout.types import RolloutGroup, ScoredGroup


def tiny_config(model_dir: Path, run_dir: Path, curriculum: bool = False,
                **train: object) -> RunConfig:
    """A two-stage local run of three steps; a fixed name, so that a second call resumes it."""
    return tiny_run_config(
        model_dir, 2, name="tiny", host={"run_dir": str(run_dir), "threads": 1},
        task={"name": "sums", "options": {"max_digits": 1}}, curriculum={"enabled": curriculum},
        rollout={"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 6},
        train={"steps": 3, "micro_batch_size": 4, "checkpoint_every": 2,
               "zero_variance_groups": "keep", **train},
        eval={"problems": 4, "pass_k": 2, "max_new_tokens": 6})


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_run_writes_a_complete_run_folder(tiny_model_dir: Path, tmp_path: Path, mode: str) -> None:
    config = tiny_config(tiny_model_dir, tmp_path, mode=mode)
    summary = local_run(config).run()
    assert summary.steps == 3
    records = read_metrics(summary.path)
    steps = [r for r in records if r["event"] == "step"]
    evals = [r for r in records if r["event"] == "eval"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    # "keep" leaves every group in the batch, so every step is an optimizer step.
    assert [r["version"] for r in steps] == [1, 2, 3]
    assert all(0 <= r["staleness_max"] <= config.train.max_staleness for r in steps)
    # The curriculum's estimates are kept and logged even while it schedules nothing.
    assert all(0 <= r["zero_spread_share_total"] <= 1 and r["bucket_pass_rates"] for r in steps)
    assert [e["label"] for e in evals] == ["before", "after"]
    # eval.greedy (the default): greedy pass@1 beside the sampled one, with its interval.
    assert all(0 <= e["greedy_pass1_low"] <= e["greedy_pass1"] <= e["greedy_pass1_high"] <= 1
               for e in evals)
    assert json.loads((summary.path / "config.json").read_text())["train"]["mode"] == mode
    for name, record in zip(("eval_before.json", "eval_after.json"), evals):
        result = json.loads((summary.path / name).read_text())
        assert result["problems"] == 4 and result["greedy_pass1"]["n"] == 4
        assert result["greedy_pass1"]["mean"] == record["greedy_pass1"]
    model = AutoModelForCausalLM.from_pretrained(summary.path / RUN_MODEL_DIR)
    assert model.config.tie_word_embeddings is False
    checkpoint = json.loads((summary.path / "checkpoints" / "v3" / "trainer.json").read_text())
    assert checkpoint["step"] == 3 and checkpoint["version"] == 3


@pytest.mark.parametrize("curriculum", [False, True])
def test_sync_run_resumes_exactly(tiny_model_dir: Path, tmp_path: Path, curriculum: bool) -> None:
    """With the curriculum too: the resumed run gets its estimates back from the stored groups,
    so it passes over and hands out the same problems as the straight run."""
    straight = local_run(tiny_config(tiny_model_dir, tmp_path / "a", curriculum, mode="sync",
                                     steps=4))
    straight.run()
    first = local_run(tiny_config(tiny_model_dir, tmp_path / "b", curriculum, mode="sync",
                                  steps=2))
    first.run()
    resumed = local_run(tiny_config(tiny_model_dir, tmp_path / "b", curriculum, mode="sync",
                                    steps=4))
    assert resumed.step == 2 and resumed.trainer.version == 2
    assert resumed.curriculum.estimates() == first.curriculum.estimates()
    resumed.run()
    assert resumed.scheduler.position == straight.scheduler.position
    assert resumed.curriculum.estimates() == straight.curriculum.estimates()
    for a, b in zip(straight.trainer.stage_trainers, resumed.trainer.stage_trainers):
        for (name, x), y in zip(a.stage.state_dict().items(), b.stage.state_dict().values()):
            assert torch.equal(x, y), name


def test_async_run_learner_drops_groups_past_the_staleness_bound(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    run = local_run(tiny_config(tiny_model_dir, tmp_path, mode="sync", max_staleness=0))
    indices = run.scheduler.next(1)
    group = run.worker.generate_groups(indices)[0]
    # The learner moved on two versions while the group was in flight.
    for trainer in run.trainer.stage_trainers:
        trainer.stage.version = 2
    assert run.ingestion.ingest(group, run.trainer.version) is None
    assert run.ingestion.stats.stale == 1


@pytest.mark.parametrize("dynamic", [False, True])
def test_dynamic_sampling_fills_a_batch_with_groups_whose_rewards_vary(
        tiny_model_dir: Path, tmp_path: Path, dynamic: bool) -> None:
    run = local_run(tiny_config(tiny_model_dir, tmp_path, mode="sync", dynamic_sampling=dynamic,
                                zero_variance_groups="drop"))
    groups = run.worker.generate_groups(run.scheduler.next(9))
    flat, varied = [0.0] * 4, [1.0, 0.0, 0.0, 0.0]

    def scored(group: RolloutGroup, rewards: list[float]) -> tuple[ScoredGroup, int]:
        return ScoredGroup(group=group, rewards=rewards, correct=rewards), 0

    run.pool.pending = [scored(groups[0], flat), scored(groups[1], varied), scored(groups[2], flat),
                   scored(groups[3], varied), scored(groups[4], varied)]
    taken = [s.group.group_id for s, _ in run.collect(2)]
    expected = groups[:4] if dynamic else groups[:2]
    assert taken == [g.group_id for g in expected]
    assert len(run.pool.pending) == 5 - len(expected)
    # Where nothing varies a step still comes, after a bounded number of groups.
    run.pool.pending = [scored(g, flat) for g in groups]
    assert len(run.collect(2)) == (2 * DYNAMIC_SAMPLING_LIMIT if dynamic else 2)


def refusal_reason(ingestion: Ingestion, group: RolloutGroup,
                   caplog: pytest.LogCaptureFixture) -> str:
    """Why the coordinator's ingestion refused `group`, as its log tells the operator; fails the
    test if the group was accepted."""
    logger = Ingestion.__module__
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=logger):
        assert ingestion.ingest(group, 0) is None, f"group {group.group_id} was accepted"
    [record] = [r for r in caplog.records if r.name == logger]
    return record.getMessage()


def test_coordinator_rejects_unscheduled_replayed_and_malformed_groups(
        tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = local_run(tiny_config(tiny_model_dir, tmp_path, mode="sync"))
    [index] = run.scheduler.next(1)
    group = run.worker.generate_groups([index])[0]
    unscheduled = msgspec.structs.replace(group, problem_index=index + 1000)
    assert re.search(rf"problem {index + 1000} was not scheduled",
                     refusal_reason(run.ingestion, unscheduled, caplog))
    first = group.rollouts[0]
    bad_token = msgspec.structs.replace(
        first, completion_tokens=[10**6] * len(first.completion_tokens))
    malformed = msgspec.structs.replace(group, rollouts=[bad_token, *group.rollouts[1:]])
    assert re.search(rf"group {group.group_id}: token id outside the vocabulary",
                     refusal_reason(run.ingestion, malformed, caplog))
    assert run.ingestion.stats.rejected == 2
    # The genuine group is still accepted after the bad ones (they changed nothing) ...
    accepted = run.ingestion.ingest(group, 0)
    assert accepted is not None
    scored, staleness = accepted
    assert staleness == 0 and len(scored.rewards) == 4
    # ... and a replay of it is refused: its problem's result is already in.
    assert re.search(rf"problem {index} was not scheduled, or its result was already accepted",
                     refusal_reason(run.ingestion, group, caplog))
    assert run.ingestion.stats.rejected == 3


def test_only_groups_the_coordinator_accepts_move_the_curriculum(
        tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = local_run(tiny_config(tiny_model_dir, tmp_path, curriculum=True, mode="sync"))
    [index] = run.generation.schedule(1)
    group = run.worker.generate_groups([index])[0]
    with caplog.at_level(logging.WARNING, logger="decentrl.coordinator.ingest"):
        unscheduled = msgspec.structs.replace(group, problem_index=index + 1000)
        assert run.pool.accept(unscheduled, run.trainer.version) is None
    assert run.curriculum.clock == 0 and not run.curriculum.estimates()
    assert run.pool.accept(group, run.trainer.version) is not None
    assert run.curriculum.clock == 1
    [estimate] = run.curriculum.estimates()
    assert estimate.bucket.startswith("sums 1+1 digits") and estimate.groups == 1


def test_a_problem_handed_out_again_is_its_source_problem_with_samples_of_its_own(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    config = tiny_config(tiny_model_dir, tmp_path, mode="sync")
    config = config.model_copy(update={"curriculum": config.curriculum.model_copy(
        update={"enabled": True, "replay_share": 0.5})})
    run = local_run(config)
    [index] = run.generation.schedule(1)
    [first] = run.worker.generate_groups([index])
    taught = ScoredGroup(group=first, rewards=[1.0, 0.0, 0.0, 1.0], correct=[1.0, 0.0, 0.0, 1.0])
    run.curriculum.observe(taught)  # as if its group had reward spread
    handed = run.generation.schedule(2)
    assert replay_index(index, 1) in handed
    [again] = run.worker.generate_groups([replay_index(index, 1)])
    assert again.rollouts[0].prompt_tokens == first.rollouts[0].prompt_tokens
    assert again.sampling_seed != first.sampling_seed and again.group_id != first.group_id
    # Scored against the source problem's answer, and accepted once.
    answer = run.task.problem("train", index).answer
    tokens = run.backend.tokenizer.encode(answer, add_special_tokens=False)
    right = msgspec.structs.replace(again.rollouts[0], completion_tokens=tokens,
                                    behaviour_logprobs=[-1.0] * len(tokens))
    accepted = run.pool.accept(
        msgspec.structs.replace(again, rollouts=[right, *again.rollouts[1:]]), run.trainer.version)
    assert accepted is not None and accepted[0].correct[0] == 1.0
    assert replay_attempt(accepted[0].group.problem_index) == 1
    assert run.pool.accept(again, run.trainer.version) is None  # its result was already taken
    # A replay the coordinator never handed out is refused like any unscheduled problem.
    [forged] = run.worker.generate_groups([replay_index(index, 2)])
    rejected = run.ingestion.stats.rejected
    assert run.pool.accept(forged, run.trainer.version) is None
    assert run.ingestion.stats.rejected == rejected + 1


def test_coordinator_rewards_what_the_completion_tokens_say(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """A rollout carries tokens and no reward: the coordinator decodes and scores them itself, so
    a peer that edits a completion to the right answer earns the right answer's reward, and one
    edited to a wrong answer the wrong answer's, whatever the peer sampled."""
    run = local_run(tiny_config(tiny_model_dir, tmp_path, mode="sync"))
    tokenizer = run.backend.tokenizer

    def edited(group: RolloutGroup, answer: str) -> RolloutGroup:
        """`group` with its first completion replaced by the tokens of `answer`."""
        tokens = tokenizer.encode(answer, add_special_tokens=False)
        first = msgspec.structs.replace(group.rollouts[0], completion_tokens=tokens,
                                        behaviour_logprobs=[-1.0] * len(tokens))
        return msgspec.structs.replace(group, rollouts=[first, *group.rollouts[1:]])

    for group in run.worker.generate_groups(run.scheduler.next(2)):
        problem = run.task.problem("train", group.problem_index)
        right, wrong = problem.answer, str(int(problem.answer) + 1)
        earned = {answer: run.task.reward(problem, answer).total for answer in (right, wrong)}
        assert earned[right] != earned[wrong]
        sampled = run.ingestion.score(group).rewards
        for answer in (right, wrong):
            # The edited row earns what its tokens say; the other rows keep their rewards.
            assert run.ingestion.score(edited(group, answer)).rewards == [earned[answer],
                                                                         *sampled[1:]]
        # Through the coordinator's gate too: accepted, and scored from the edited tokens.
        accepted = run.ingestion.ingest(edited(group, right), 0)
        assert accepted is not None
        assert (accepted[0].rewards[0], accepted[0].correct[0]) == (earned[right], 1.0)


def test_config_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"train\.lr"):
        parse_config({"train": {"lr": -1}})
    with pytest.raises(ConfigError, match=r"rollout\.group_sizes"):
        parse_config({"rollout": {"group_sizes": 4}})
    with pytest.raises(ConfigError, match="mis_low must be below"):
        parse_config({"train": {"mis_low": 1.0, "mis_high": 1.0}})
    with pytest.raises(ConfigError, match=r"train\.mis_high"):
        parse_config({"train": {"mis_high": 0.5}})  # must bracket 1
    with pytest.raises(ConfigError, match="dynamic_sampling skips groups without reward spread"):
        parse_config({"train": {"dynamic_sampling": True, "zero_variance_groups": "keep"}})
    with pytest.raises(ConfigError, match=r"m2_threshold needs train\.off_policy_correction"):
        parse_config({"train": {"m2_threshold": 0.04, "off_policy_correction": False}})
    with pytest.raises(ConfigError, match=r"train\.m2_threshold"):
        parse_config({"train": {"m2_threshold": 0}})
    with pytest.raises(ConfigError, match=r"host\.link.*rtt_ms"):
        parse_config({"host": {"link": {"rtt_ms": [120, 60]}}})
    with pytest.raises(ConfigError, match=r"swarm\.activation_codec"):
        parse_config({"swarm": {"activation_codec": "fp8"}})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(bad)


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[3] / "examples").glob("*.toml")),
                         ids=lambda p: p.name)
def test_example_configs_load(path: Path) -> None:
    config = load_config(path)
    # The demo's recipes all run as runs/demo (--name changes it); the others by their file.
    assert config.name == ("demo" if path.stem.startswith("demo") else path.stem)


def test_unknown_task_lists_the_known_ones(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = tiny_config(tiny_model_dir, tmp_path)
    config = config.model_copy(update={"task": config.task.model_copy(update={"name": "nope"})})
    with pytest.raises(ValueError, match="unknown task 'nope'; tasks: sums"):
        local_run(config)

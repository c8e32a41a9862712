"""Difficulty-aware scheduling (coordinator/curriculum.py, coordinator/scheduler.py): the estimates,
the preference for problems likely to have reward spread, the train split only, no problem handed
out twice across a restart, and no say for peers."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest

from decentrl.config import ConfigError, CurriculumConfig, parse_config
from decentrl.coordinator.curriculum import Curriculum, DecayedCounts, bucket_of, spread_chance
from decentrl.coordinator.scheduler import (
    REPLAY_STRIDE,
    PromptScheduler,
    replay_attempt,
    replay_index,
    source_index,
)
from decentrl.coordinator.store import RunStore
from decentrl.envs import make_environment
from decentrl.rollout.types import Rollout, RolloutGroup, ScoredGroup, VersionSpan
from decentrl.tasks import SumsTask, split_of
from decentrl.tasks.arithmetic import sums_difficulty
from decentrl.tasks.base import DIFFICULTY, Problem, difficulty_of

GROUP_SIZE = 8
SEED = 3
TASK = SumsTask(min_digits=1, max_digits=2)
# Decay too slow to matter, except where a test sets its own.
ON = CurriculumConfig(enabled=True, floor=0.1, half_life_groups=1e12)


def scored(index: int, solved: int, group_id: str | None = None) -> ScoredGroup:
    """A group of problem `index` whose first `solved` rows solved it (reward 1, else 0)."""
    rollouts = [Rollout(prompt_tokens=[1], completion_tokens=[2], behaviour_logprobs=[-0.5],
                        finished=True) for _ in range(GROUP_SIZE)]
    group = RolloutGroup(group_id=group_id or f"sums/{index}", task="sums", problem_index=index,
                         stage_versions=[0], version_spans=[VersionSpan(start=0, versions=[0])],
                         sampling_seed=0, rollouts=rollouts)
    correct = [1.0 if row < solved else 0.0 for row in range(GROUP_SIZE)]
    return ScoredGroup(group=group, rewards=correct, correct=correct)


def indices_by_bucket(count: int, start: int = 10**6) -> dict[str, list[int]]:
    """Up to `count` train problem indices of every bucket of TASK, from `start` on."""
    found: dict[str, list[int]] = {}
    for index in range(start, start + 4000):
        bucket = found.setdefault(bucket_of(TASK.problem("train", index)), [])
        if len(bucket) < count:
            bucket.append(index)
    return found


def taught(curriculum: Curriculum, groups: int = 40) -> None:
    """The policy always solves sums of one-digit numbers, never of two-digit ones, and half of
    those that mix the two."""
    for bucket, indices in indices_by_bucket(groups).items():
        solved = {"1+1": GROUP_SIZE, "1+2": GROUP_SIZE // 2, "2+2": 0}[digits(bucket)]
        for index in indices:
            curriculum.observe(scored(index, solved))


def digits(bucket: str) -> str:
    """"1+2" of "sums 1+2 digits, 1 carry"."""
    return bucket.split()[1]


def test_spread_chance_under_a_beta_pass_rate() -> None:
    # A uniform pass rate: all G rows alike with chance 2 / (G + 1).
    assert spread_chance(1.0, 1.0, 8) == pytest.approx(1 - 2 / 9)
    # A pass rate known to be 0.5: independent rows, 1 - 2 x 0.5^8.
    assert spread_chance(5e6, 5e6, 8) == pytest.approx(1 - 2 / 256, rel=1e-5)
    assert spread_chance(9e6, 1e6, 2) == pytest.approx(2 * 0.9 * 0.1, rel=1e-5)
    # Beta(2, 1): E[p^2] = 2/4 x 3/5... that is (2 x 3) / (3 x 4) = 1/2, E[(1-p)^2] = 1/6.
    assert spread_chance(2.0, 1.0, 2) == pytest.approx(1 - 1 / 2 - 1 / 6)


def test_counts_halve_every_half_life_and_start_from_a_uniform_prior() -> None:
    counts = DecayedCounts(solved=8.0, unsolved=0.0, spread=0.0, flat=4.0)
    assert counts.pass_rate == pytest.approx(9 / 10)
    assert counts.spread_rate == pytest.approx(1 / 6)
    later = counts.at(10, 0.5 ** (1 / 10))
    assert (later.solved, later.flat, later.clock) == (pytest.approx(4.0), pytest.approx(2.0), 10)
    assert counts.plus(1.0, 7.0, True) == DecayedCounts(9.0, 7.0, 1.0, 4.0, 0)


def test_bucket_estimates_follow_the_observed_groups() -> None:
    curriculum = Curriculum(ON, TASK, GROUP_SIZE, SEED)
    taught(curriculum, groups=10)
    estimates = {e.bucket: e for e in curriculum.estimates()}
    # Digit counts and carries: 1+1 carries 0 or 1 times, the others 0, 1 or 2 times.
    assert len(estimates) == 8
    easy = estimates["sums 1+1 digits, 1 carry"]
    mixed = estimates["sums 1+2 digits, 0 carries"]
    hard = estimates["sums 2+2 digits, 2 carries"]
    assert easy.pass_rate == pytest.approx(81 / 82)
    assert hard.pass_rate == pytest.approx(1 / 82)
    assert mixed.pass_rate == pytest.approx(0.5)
    assert easy.spread_chance == pytest.approx(1 / 12)
    assert mixed.spread_chance == pytest.approx(11 / 12)
    assert curriculum.counters()["zero_spread_share_total"] == pytest.approx(50 / 80)


def test_old_observations_fade_so_the_estimate_follows_the_policy() -> None:
    curriculum = Curriculum(CurriculumConfig(enabled=True, half_life_groups=8.0), TASK,
                            GROUP_SIZE, SEED)
    hard = indices_by_bucket(40)["sums 2+2 digits, 1 carry"]
    for index in hard[:20]:
        curriculum.observe(scored(index, 0))  # never solved: no spread
    assert curriculum.chance(TASK.problem("train", hard[-1])) < 0.1
    for index in hard[20:36]:
        curriculum.observe(scored(index, 3))  # the policy learns: spread
    # 20 flat groups two half-lives ago weigh ~2.5, the 16 with spread ~9.
    assert curriculum.chance(TASK.problem("train", hard[-1])) > 0.7


def test_a_problem_seen_before_is_judged_by_its_own_rows() -> None:
    curriculum = Curriculum(ON, TASK, GROUP_SIZE, SEED)
    mixed = indices_by_bucket(20)["sums 1+2 digits, 0 carries"]
    for index in mixed[:10]:
        curriculum.observe(scored(index, GROUP_SIZE // 2))
    seen = TASK.problem("train", mixed[10])
    assert curriculum.chance(seen) == pytest.approx(11 / 12)  # the bucket's: 10 of 10 had spread
    curriculum.observe(scored(mixed[10], GROUP_SIZE, group_id="sums/again"))
    bucket = curriculum.buckets["sums 1+2 digits, 0 carries"]
    # Its own 8 solved rows and 2 rows' worth of the bucket's pass rate.
    assert curriculum.chance(seen) == pytest.approx(spread_chance(
        8 + 2 * bucket.pass_rate, 2 * (1 - bucket.pass_rate), GROUP_SIZE))
    assert curriculum.chance(seen) < 0.5 < bucket.spread_rate


def test_scheduling_prefers_the_buckets_likely_to_have_spread() -> None:
    curriculum = Curriculum(ON, TASK, GROUP_SIZE, SEED)
    taught(curriculum)
    scheduler = PromptScheduler(SEED, admits=curriculum.admits)
    handed = Counter(digits(bucket_of(TASK.problem("train", i))) for i in scheduler.next(2000))
    natural = Counter(digits(bucket_of(TASK.problem("train", SEED * 1_000_003 + p)))
                      for p in range(scheduler.position))
    # The stream draws each operand's digit count uniformly: half the sums mix 1 and 2 digits.
    assert natural["1+2"] / scheduler.position == pytest.approx(0.5, abs=0.03)
    # Handed out at ~0.98 against the floor, 0.1: 0.5 x 0.98 / (0.5 x 0.98 + 0.5 x 0.1) = ~0.9.
    assert handed["1+2"] / 2000 == pytest.approx(0.9, abs=0.03)
    # The floor keeps the others in the stream, so their estimates keep moving.
    assert min(handed.values()) > 50


def test_a_sharper_curriculum_keeps_closer_to_the_best_bucket() -> None:
    """Buckets with a middling chance of spread are handed out less, the sharper it is."""
    shares = []
    for sharpness in (1.0, 4.0):
        curriculum = Curriculum(ON.model_copy(update={"sharpness": sharpness}), TASK,
                                GROUP_SIZE, SEED)
        for bucket, indices in indices_by_bucket(40).items():
            # Spread in every 1+2 group, in every other 2+2 group, in no 1+1 group.
            for n, index in enumerate(indices):
                solved = {"1+1": GROUP_SIZE, "1+2": 4, "2+2": 4 * (n % 2)}[digits(bucket)]
                curriculum.observe(scored(index, solved))
        indices = PromptScheduler(SEED, admits=curriculum.admits).next(2000)
        shares.append(sum(digits(bucket_of(TASK.problem("train", i))) == "2+2"
                          for i in indices) / 2000)
    # 2+2 handed out at ~0.5 / ~0.06 of 1+2's rate: ~0.25 / 0.5 x 0.98 + ... = ~0.2, then ~0.05.
    assert shares[0] == pytest.approx(0.2, abs=0.04)
    assert shares[1] == pytest.approx(0.07, abs=0.04)


def test_off_hands_out_the_whole_stream_and_still_estimates() -> None:
    curriculum = Curriculum(CurriculumConfig(), TASK, GROUP_SIZE, SEED)
    taught(curriculum)
    scheduler = PromptScheduler(SEED, admits=curriculum.admits)
    assert scheduler.next(50) == [SEED * 1_000_003 + p for p in range(50)]
    assert curriculum.counters()["bucket_pass_rates"]


def test_a_restart_hands_out_no_problem_twice_and_gets_its_estimates_back(
        tmp_path: Path) -> None:
    store = RunStore(tmp_path / "run.sqlite")
    curriculum = Curriculum(ON, TASK, GROUP_SIZE, SEED)
    scheduler = PromptScheduler(SEED, store.problem_position(), admits=curriculum.admits)
    before = []
    for round_ in range(30):
        indices = scheduler.next(4, reserve=store.reserve_problems)
        before += indices
        for index in indices:
            group = scored(index, {0: 0, 1: GROUP_SIZE, 2: 3}[round_ % 3])
            store.add_group(group, 0, 0)
            curriculum.observe(group)
    assert store.problem_position() == scheduler.position > len(before)  # some passed over
    store.close()

    store = RunStore(tmp_path / "run.sqlite")
    restarted = Curriculum(ON, TASK, GROUP_SIZE, SEED)
    restarted.replay(store.accepted_groups())
    assert restarted.estimates() == curriculum.estimates()
    assert restarted.counters() == curriculum.counters()
    scheduler = PromptScheduler(SEED, store.problem_position(), admits=restarted.admits)
    after = [i for _ in range(30) for i in scheduler.next(4, reserve=store.reserve_problems)]
    assert len(set(before + after)) == len(before) + len(after)


def test_a_scheduler_behind_its_store_refuses_to_hand_out(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "run.sqlite")
    store.reserve_problems(5)  # another scheduler of the same run
    with pytest.raises(RuntimeError, match="position 0 but the store reserved from 5"):
        PromptScheduler(SEED).next(2, reserve=store.reserve_problems)


def test_the_choice_is_the_coordinators_alone() -> None:
    """Which problems are handed out depends on the run's seed and the groups the coordinator
    accepted, not on when or how often anyone asks: each candidate's draw is seeded by the run
    and its index, not taken from a shared generator a caller could advance."""
    first, second = (Curriculum(ON, TASK, GROUP_SIZE, SEED) for _ in range(2))
    taught(first)
    taught(second)
    for index in range(SEED * 1_000_003, SEED * 1_000_003 + 300):
        second.admits(index + 7)  # other requests in between
        assert second.admits(index) == first.admits(index)
    one = PromptScheduler(SEED, admits=first.admits)
    other = PromptScheduler(SEED, admits=second.admits)
    assert [i for _ in range(50) for i in one.next(2)] == other.next(100)
    reseeded = Curriculum(ON, TASK, GROUP_SIZE, SEED + 1)
    taught(reseeded)
    shifted = [reseeded.admits(i) for i in range(SEED * 1_000_003, SEED * 1_000_003 + 300)]
    assert shifted != [first.admits(i) for i in range(SEED * 1_000_003, SEED * 1_000_003 + 300)]


REPLAYING = CurriculumConfig(enabled=True, floor=0.1, half_life_groups=1e12, replay_share=0.5,
                             max_replays=2)


def test_replay_indices_stand_for_their_source_problem() -> None:
    first = SEED * 1_000_003 + 12
    again = replay_index(first, 2)
    assert again != first and again >= REPLAY_STRIDE
    assert (source_index(again), replay_attempt(again)) == (first, 2)
    assert (source_index(first), replay_attempt(first)) == (first, 0)
    for source, attempt in ((first, 0), (-1, 1), (REPLAY_STRIDE, 1)):
        with pytest.raises(ValueError, match="no replay index"):
            replay_index(source, attempt)


def teaches(index: int) -> bool:
    """Whether a problem's groups have spread in the replay tests: by its key (keys repeat among
    the stream's sums), those whose smallest operand is odd."""
    return int(TASK.problem("train", source_index(index)).key.split("+")[0]) % 2 == 1


def test_problems_likely_to_teach_are_handed_out_again_for_a_share_of_the_slots() -> None:
    curriculum = Curriculum(REPLAYING, TASK, GROUP_SIZE, SEED)
    scheduler = PromptScheduler(SEED, admits=curriculum.admits, replay=curriculum.next_replay)
    handed: list[int] = []
    for _ in range(60):
        indices = scheduler.next(4)
        handed += indices
        for index in indices:
            solved = 3 if teaches(index) else 0  # 3 of 8: spread
            assert scheduler.take(index)
            curriculum.observe(scored(index, solved, group_id=f"sums/{index}"))
    replays = [i for i in handed if replay_attempt(i) > 0]
    assert len(set(handed)) == len(handed)  # every hand-out has an index of its own
    assert len(replays) / len(handed) == pytest.approx(0.5, abs=0.05)
    assert curriculum.counters()["replays_handed_out"] == len(replays)
    # Only problems whose own groups had spread come back, each at most max_replays times, as
    # attempts 1, 2 in order.
    assert all(teaches(i) for i in replays)
    attempts: dict[int, list[int]] = {}
    for index in replays:
        attempts.setdefault(source_index(index), []).append(replay_attempt(index))
    assert all(seen == list(range(1, len(seen) + 1)) and len(seen) <= 2
               for seen in attempts.values())
    assert any(len(seen) == 2 for seen in attempts.values())
    # Each replay was handed out after its source's first group: none from the held-out split.
    assert all(split_of(TASK.problem("train", source_index(i)).key, TASK.heldout_fraction)
               == "train" for i in handed)


def test_a_problem_that_stopped_teaching_is_not_handed_out_again() -> None:
    curriculum = Curriculum(REPLAYING, TASK, GROUP_SIZE, SEED)
    index = SEED * 1_000_003 + 5
    curriculum.observe(scored(index, 4))
    again = curriculum.next_replay() or curriculum.next_replay()  # half the slots
    assert again == replay_index(index, 1)
    curriculum.observe(scored(again, GROUP_SIZE, group_id=f"sums/{again}"))  # all solved now
    assert not curriculum.replays
    other = SEED * 1_000_003 + 6
    curriculum.observe(scored(replay_index(other, REPLAYING.max_replays), 4, group_id="last"))
    assert [curriculum.next_replay() for _ in range(6)] == [None] * 6  # no more than max
    off = Curriculum(ON, TASK, GROUP_SIZE, SEED)
    off.observe(scored(index, 4))
    assert [off.next_replay() for _ in range(6)] == [None] * 6


def test_a_restart_gets_the_same_problems_to_hand_out_again(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "run.sqlite")
    curriculum = Curriculum(REPLAYING, TASK, GROUP_SIZE, SEED)
    scheduler = PromptScheduler(SEED, store.problem_position(), admits=curriculum.admits,
                                replay=curriculum.next_replay)
    for _ in range(20):
        for index in scheduler.next(4, reserve=store.reserve_problems):
            group = scored(index, 2 if source_index(index) % 3 else 8, group_id=f"sums/{index}")
            store.add_group(group, 0, 0)
            curriculum.observe(group)
    store.close()
    store = RunStore(tmp_path / "run.sqlite")
    restarted = Curriculum(REPLAYING, TASK, GROUP_SIZE, SEED)
    restarted.replay(store.accepted_groups())
    assert restarted.replays == curriculum.replays and restarted.replays


def test_difficulty_buckets_of_the_tasks_and_environments() -> None:
    assert sums_difficulty([3, 4]) == "1+1 digits, 0 carries"
    assert sums_difficulty([8, 7]) == "1+1 digits, 1 carry"
    assert sums_difficulty([95, 5]) == "1+2 digits, 2 carries"  # 5 + 5, then 9 + 1
    assert sums_difficulty([57, 68]) == "2+2 digits, 2 carries"
    assert sums_difficulty([9, 9, 9]) == "1+1+1 digits, 1 carry"  # 27: the ones carry 2
    problem = TASK.problem("train", 0)
    assert difficulty_of(problem) == sums_difficulty(problem.metadata["operands"])
    assert bucket_of(problem) == f"sums {difficulty_of(problem)}"
    calculator = make_environment("agentic-calculator").problem("train", 0)
    assert difficulty_of(calculator) == f"{len(calculator.metadata['chain'])} steps"
    countdown = make_environment("agentic-countdown").problem("train", 0)
    assert difficulty_of(countdown) == f"{len(countdown.metadata['numbers'])} numbers"
    assert difficulty_of(make_environment("task:sums").problem("train", 0)) \
        == difficulty_of(problem)
    # A task that names no difficulty: the question's length in words, to a power of two.
    plain = Problem(task="t", index=0, question=" ".join(["word"] * 11), answer="1", key="k")
    assert difficulty_of(plain) == f"~{2 ** round(math.log2(11))} words" == "~8 words"


@pytest.mark.parametrize(("section", "field"), [
    ({"floor": 0}, "floor"), ({"floor": 1.5}, "floor"),
    ({"half_life_groups": 0}, "half_life_groups"),
    ({"half_life_groups": float("inf")}, "half_life_groups"),
    ({"sharpness": 0}, "sharpness"), ({"sharpness": 100}, "sharpness"),
    ({"enabled": "maybe"}, "enabled"), ({"warmup": 3}, "warmup"),
    ({"replay_share": 1.0}, "replay_share"), ({"replay_share": -0.1}, "replay_share"),
    ({"max_replays": 0}, "max_replays"),
    ({"min_level_share": -0.1}, "min_level_share"), ({"min_level_share": 0.6}, "min_level_share"),
])
def test_bad_curriculum_settings_are_refused(section: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=f"curriculum.{field}"):
        parse_config({"curriculum": section})


# --- a floor under every level -------------------------------------------------------------------


class Levels:
    """Three levels like countdown's: half the stream is the easy one, whose groups nearly always
    have spread; the two hard ones a quarter each, with spread in a quarter of their groups."""

    name = "levels"

    def problem(self, split: str, index: int) -> Problem:
        level = ("2 numbers", "2 numbers", "3 numbers", "4 numbers")[index % 4]
        return Problem(task=self.name, index=index, question="?", answer="1", key=f"p{index}",
                       metadata={DIFFICULTY: level})


LEVELS = Levels()


def solved_rows(index: int) -> int:
    source = source_index(index)
    if LEVELS.problem("train", source).metadata[DIFFICULTY] == "2 numbers":
        return 0 if (source // 4) % 10 == 0 else GROUP_SIZE // 2  # spread 9 times in 10
    return 1 if (source // 4) % 4 == 0 else 0  # spread once in 4


def level_shares(config: CurriculumConfig, rounds: int = 100,
                 curriculum: Curriculum | None = None) -> tuple[Counter[str], list[ScoredGroup]]:
    """The levels of the problems handed out over `rounds` steps of 4, each group accepted."""
    curriculum = curriculum or Curriculum(config, LEVELS, GROUP_SIZE, SEED)
    scheduler = PromptScheduler(SEED, admits=curriculum.admits, replay=curriculum.next_replay)
    handed: Counter[str] = Counter()
    groups = []
    for _ in range(rounds):
        for index in scheduler.next(4):
            handed[LEVELS.problem("train", source_index(index)).metadata[DIFFICULTY]] += 1
            groups.append(scored(index, solved_rows(index), group_id=f"levels/{index}"))
            curriculum.observe(groups[-1])
    total = sum(handed.values())
    return Counter({level: count / total for level, count in handed.items()}), groups


@pytest.mark.parametrize("config", [ON, REPLAYING], ids=["stream", "with replays"])
def test_a_level_share_keeps_the_hard_levels_in_the_schedule(config: CurriculumConfig) -> None:
    assert CurriculumConfig().min_level_share == 0
    # Without it (the default), the hard levels get what their chance of spread earns: the
    # floor, ~0.1 x a quarter of the stream each against the easy half, ~5% of the groups each.
    starving, _ = level_shares(config)
    assert starving["3 numbers"] < 0.1 and starving["4 numbers"] < 0.1
    assert starving["2 numbers"] > 0.8
    # With it, each keeps about its share (give or take the groups in flight), the easy level
    # the rest; its replays wait while a level is below.
    shares, groups = level_shares(config.model_copy(update={"min_level_share": 0.25}))
    assert 0.22 <= shares["3 numbers"] <= 0.3 and 0.22 <= shares["4 numbers"] <= 0.3
    assert shares["2 numbers"] >= 0.4
    if config.replay_share:
        assert any(replay_attempt(g.group.problem_index) for g in groups)
    # The choice follows the accepted groups alone: a restart that replays them chooses alike.
    first = Curriculum(config.model_copy(update={"min_level_share": 0.25}), LEVELS, GROUP_SIZE,
                       SEED)
    first.replay(groups)
    again = Curriculum(first.config, LEVELS, GROUP_SIZE, SEED)
    again.replay(groups)
    stream = range(SEED * 1_000_003 + 10**6, SEED * 1_000_003 + 10**6 + 200)
    assert [first.admits(i) for i in stream] == [again.admits(i) for i in stream]


def test_a_level_below_its_share_is_handed_out_and_the_others_wait() -> None:
    curriculum = Curriculum(REPLAYING.model_copy(update={"min_level_share": 0.2}), LEVELS,
                            GROUP_SIZE, SEED)
    easy = [i for i in range(400) if i % 4 in (0, 1)]
    hard = [i for i in range(400) if i % 4 == 2]
    for index in easy[:18]:
        curriculum.observe(scored(index, GROUP_SIZE // 2))  # spread: queued for replays
    for index in hard[:2]:
        curriculum.observe(scored(index, 0))
    # 3 numbers: 2 of 20 groups, below 0.2; 4 numbers never seen: below too.
    assert curriculum.admits(hard[10]) and curriculum.admits(hard[10] + 1)
    assert not any(curriculum.admits(i) for i in easy[100:140])  # whatever their spread
    # The easy level's problems queued for a replay wait too; the slot goes to the stream.
    assert curriculum.replays and [curriculum.next_replay() for _ in range(6)] == [None] * 6
    for index in hard[2:8]:
        curriculum.observe(scored(index, 0))
    for index in range(3, 40, 4)[:7]:
        curriculum.observe(scored(index, 0))  # 4 numbers: 7 of 33 groups, 3 numbers 8
    # No level below the share: the estimates decide again, and replays come back.
    assert any(curriculum.admits(i) for i in easy[100:140])
    assert curriculum.next_replay() is not None

"""Ingestion, the coordinator's gate for rollouts: check a rollout group, recompute its rewards
itself (a peer's claim never counts), enforce the staleness bound, and turn accepted groups into
training batches with group-relative advantages.

An episode's reward comes from replaying it: a fresh episode of the same problem is played
through the rollout's assistant turns, and the environment's replies must be exactly the tokens
the rollout says the environment gave (rollout/episodes.py, `replay_episode`). The episode's
return is its final reward (0 when the token budget cut it short) plus its per-turn signals.

Replaying runs the episode's tool calls again, within REPLAY_ALLOWANCE times its CPU budget
(envs/budget.py), and refuses without running a call the rollout recorded as refused by the
budget. A group has group_size episodes (checked first), so its replay costs at most group_size x
REPLAY_ALLOWANCE x tool_budget_s CPU seconds of tools, however its peer wrote the transcripts
(plus, per episode, what its last call's sandbox overruns: its CPU timer's margin and startup)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from decentrl.config import RunConfig
from decentrl.coordinator.scheduler import PromptScheduler, source_index
from decentrl.envs import Environment
from decentrl.errors import DecentrlError
from decentrl.learn.advantages import filter_zero_variance_groups, group_advantages
from decentrl.learn.batch import TrainBatch, build_batch
from decentrl.learn.losses import StaleRolloutError, check_staleness
from decentrl.net.text import SHOWN_ID_CHARS, peer_text
from decentrl.rollout.episodes import replay_episode
from decentrl.rollout.types import Rollout, RolloutGroup, ScoredGroup, check_version_spans
from decentrl.tasks import Task

log = logging.getLogger(__name__)


class RejectedGroup(DecentrlError, ValueError):
    """A group that failed a check; it changes nothing."""


@dataclass
class IngestStats:
    accepted: int = 0
    stale: int = 0
    rejected: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    def count_rejection(self, reason: str) -> None:
        self.rejected += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1


class Ingestion:
    def __init__(self, config: RunConfig, task: Task | Environment, tokenizer: Any,
                 scheduler: PromptScheduler) -> None:
        self.config, self.task, self.tokenizer, self.scheduler = config, task, tokenizer, scheduler
        self.vocab_size = len(tokenizer)
        self.stats = IngestStats()

    def check(self, group: RolloutGroup, learner_version: int) -> int:
        """Validate a group; returns its staleness. Raises RejectedGroup or StaleRolloutError."""
        rollout = self.config.rollout
        if group.task != self.task.name:
            raise RejectedGroup(f"group {group.group_id} is for task {group.task!r}, this run "
                                f"trains {self.task.name!r}")
        if len(group.rollouts) != rollout.group_size:
            raise RejectedGroup(f"group {group.group_id} has {len(group.rollouts)} rollouts, "
                                f"expected {rollout.group_size}")
        for r in group.rollouts:
            try:
                r.check_lengths()
            except ValueError as error:
                raise RejectedGroup(f"group {group.group_id}: {error}") from None
            if len(r.completion_tokens) > rollout.max_new_tokens:
                raise RejectedGroup(f"group {group.group_id}: completion of "
                                    f"{len(r.completion_tokens)} tokens, limit "
                                    f"{rollout.max_new_tokens}")
            if any(not (t == t and -1e4 <= t <= 0.0) for t in r.behaviour_logprobs):
                raise RejectedGroup(f"group {group.group_id}: behaviour log-probs must be finite "
                                    "and <= 0")
            if any(not 0 <= t < self.vocab_size for t in r.completion_tokens + r.prompt_tokens):
                raise RejectedGroup(f"group {group.group_id}: token id outside the vocabulary")
            if r.generated is not None and not isinstance(self.task, Environment):
                raise RejectedGroup(f"group {group.group_id}: a single-turn rollout has no "
                                    "environment tokens")
        try:
            check_version_spans(group, self.config.num_stages)
        except ValueError as error:
            raise RejectedGroup(f"group {group.group_id}: {error}") from None
        # Every span's versions, not only the oldest: a span may not claim weights that do not
        # exist yet.
        try:
            staleness = check_staleness(
                learner_version, [v for span in group.version_spans for v in span.versions],
                self.config.train.max_staleness)
        except ValueError as error:  # StaleRolloutError is not one: the caller counts it apart
            raise RejectedGroup(f"group {group.group_id}: {error}") from None
        return staleness

    def score(self, group: RolloutGroup) -> ScoredGroup:
        """The group's rewards, computed here; raises RejectedGroup for an episode whose
        environment tokens are not the environment's."""
        if isinstance(self.task, Environment):
            return self.score_episodes(group, self.task)
        problem = self.task.problem("train", source_index(group.problem_index))
        rewards, correct = [], []
        for r in group.rollouts:
            # Decode the tokens ourselves: the text a peer sends along is not trusted.
            text = self.tokenizer.decode(r.completion_tokens, skip_special_tokens=True)
            reward = self.task.reward(problem, text)
            rewards.append(reward.total)
            correct.append(float(reward.solved))
        return ScoredGroup(group=group, rewards=rewards, correct=correct)

    def score_episodes(self, group: RolloutGroup, environment: Environment) -> ScoredGroup:
        rewards, correct = [], []
        for row, r in enumerate(group.rollouts):
            try:
                episode = environment.episode("train", source_index(group.problem_index))
                replayed = replay_episode(episode, self.tokenizer, r)
            except ValueError as error:
                raise RejectedGroup(f"group {group.group_id}, rollout {row}: {error}") from None
            final = replayed.episode.reward
            signals = sum(s for s in replayed.turn_signals if s is not None)
            rewards.append((final.total if final is not None else 0.0) + signals)
            correct.append(float(final is not None and final.solved))
        return ScoredGroup(group=group, rewards=rewards, correct=correct)

    def ingest(self, group: RolloutGroup, learner_version: int) -> tuple[ScoredGroup, int] | None:
        """The scored group and its staleness, or None (counted) if it is rejected or too stale."""
        try:
            staleness = self.check(group, learner_version)
            scored = self.score(group)
            # Taken last: a group that fails a check leaves its problem index claimable.
            if not self.scheduler.take(group.problem_index):
                raise RejectedGroup(f"group {group.group_id}: problem {group.problem_index} was "
                                    "not scheduled, or its result was already accepted")
        except StaleRolloutError:
            self.stats.stale += 1
            return None
        except (RejectedGroup, ValueError) as error:
            self.stats.count_rejection(type(error).__name__)
            # The group id, and so the error, may be a submitter's own text.
            log.warning("rejected group %s: %s", peer_text(group.group_id, SHOWN_ID_CHARS),
                        peer_text(error))
            return None
        self.stats.accepted += 1
        return scored, staleness

    def make_batch(self, scored: list[tuple[ScoredGroup, int]],
                   demonstrations: Sequence[Rollout] = ()
                   ) -> tuple[TrainBatch | None, dict[str, Any], list[str]]:
        """A training batch from scored groups and, after their rows, `demonstrations` as
        supervised rows (None when neither carries signal), stats (numbers, and the groups per
        staleness), and the group id of every rollout row."""
        size = self.config.rollout.group_size
        train = self.config.train
        rewards = torch.tensor([r for s, _ in scored for r in s.rewards], dtype=torch.float32)
        correct = [c for s, _ in scored for c in s.correct]
        advantages = group_advantages(rewards, size, train.scale_advantages_by_std)
        keep = filter_zero_variance_groups(rewards, size, train.zero_variance_groups)
        rollouts = [r for s, _ in scored for r in s.group.rollouts]
        staleness = [st for s, st in scored for _ in s.group.rollouts]
        kept = [i for i, k in enumerate(keep.keep_mask.tolist()) if k]
        stats = {
            "reward": float(rewards.mean()),
            "accuracy": sum(correct) / len(correct),
            "zero_variance_groups": float(keep.num_zero_variance_groups),
            "groups": float(len(scored)),
            "staleness_mean": sum(staleness) / len(staleness),
            "staleness_max": float(max(staleness)),
            "completion_tokens_mean":
                sum(len(r.completion_tokens) for r in rollouts) / len(rollouts),
            "finished_fraction": sum(r.finished for r in rollouts) / len(rollouts),
            "generated_tokens": float(sum(len(r.completion_tokens) for r in rollouts)),
            # JSON object keys are strings; the report's histogram reads them back as versions.
            "staleness_counts": {str(k): n for k, n in
                                 sorted(Counter(st for _, st in scored).items())},
        }
        if not kept and not demonstrations:
            return None, stats, []
        batch = build_batch([rollouts[i] for i in kept], [float(advantages[i]) for i in kept],
                            [staleness[i] for i in kept], self.tokenizer.pad_token_id,
                            demonstrations, routing=train.routing_replay)
        group_ids = [s.group.group_id for s, _ in scored for _ in s.group.rollouts]
        return batch, stats, [group_ids[i] for i in kept]

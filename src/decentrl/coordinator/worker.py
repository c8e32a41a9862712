"""A rollout worker: the inference side. It takes the prompts the coordinator schedules, generates
G samples of each over its chain of stages, and hands the groups over the transport. Between
generations it picks up newer stage weights; every group records which versions sampled which of
its tokens. For an environment a sample is a whole episode: assistant turns and the
environment's replies, in one session (rollout/episodes.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from decentrl.config import RolloutConfig
from decentrl.coordinator.scheduler import PromptScheduler, source_index
from decentrl.envs import Environment
from decentrl.net.transport import RolloutTransport, Transport
from decentrl.rollout.chain import InferenceChain, InferenceSession, LocalChain
from decentrl.rollout.episodes import generate_episodes
from decentrl.rollout.generate import Generation, generate, rollout_group
from decentrl.rollout.sampling import sampling_config
from decentrl.rollout.types import RolloutGroup
from decentrl.tasks import Task, render_prompt


class RolloutWorker:
    def __init__(self, chain: InferenceChain, transport: RolloutTransport | None,
                 task: Task | Environment,
                 tokenizer: Any, rollout: RolloutConfig, scheduler: PromptScheduler,
                 seed: int, record_routing: bool = False) -> None:
        """`record_routing`: each rollout carries its tokens' experts (train.routing_replay)."""
        self.chain, self.transport, self.task, self.tokenizer = chain, transport, task, tokenizer
        self.rollout, self.scheduler, self.seed = rollout, scheduler, seed
        self.record_routing = record_routing
        self.sampling = sampling_config(rollout)
        self.generated_tokens = 0

    def sync_weights(self) -> bool:
        """Load every stage whose published weights are newer than ours; True if any changed.
        A swarm's replicas follow their training peers themselves; nothing to do here."""
        if not isinstance(self.chain, LocalChain) or not isinstance(self.transport, Transport):
            return False
        changed = False
        for index, stage in enumerate(self.chain.stages):
            update = self.transport.fetch_stage(index, current_version=stage.version)
            if update is not None:
                self.chain.load_stage(index, *update)
                changed = True
        return changed

    def generate_groups(self, problem_indices: list[int],
                        on_session: Callable[[InferenceSession], None] | None = None
                        ) -> list[RolloutGroup]:
        size = self.rollout.group_size
        # Seeded by the problems, so a rerun (or a resumed run) draws the same samples.
        sampling_seed = self.seed * 2**32 + problem_indices[0]
        generations, prompts = self._generate(problem_indices, sampling_seed, on_session)
        self.generated_tokens += sum(len(g.tokens) for g in generations)
        return [rollout_group(f"{self.task.name}/{index}", self.task.name, index, prompt,
                              generations[i * size:(i + 1) * size], sampling_seed)
                for i, (index, prompt) in enumerate(zip(problem_indices, prompts))]

    def _generate(self, problem_indices: list[int], sampling_seed: int,
                  on_session: Callable[[InferenceSession], None] | None
                  ) -> tuple[list[Generation], list[list[int]]]:
        """G generations per problem (problem-major) and each problem's prompt."""
        size, max_new_tokens = self.rollout.group_size, self.rollout.max_new_tokens
        if isinstance(self.task, Environment):
            episodes = [self.task.episode("train", source_index(i))
                        for i in problem_indices for _ in range(size)]
            played = generate_episodes(self.chain, episodes, self.tokenizer, max_new_tokens,
                                       self.sampling, sampling_seed, on_session,
                                       self.record_routing)
            return [p.generation for p in played], [p.prompt for p in played[::size]]
        task = self.task
        prompts = [render_prompt(task, task.problem("train", source_index(i)), self.tokenizer)
                   for i in problem_indices]
        generations = generate(
            self.chain, [p for p in prompts for _ in range(size)], max_new_tokens, self.sampling,
            {self.tokenizer.eos_token_id}, self.tokenizer.pad_token_id, sampling_seed, on_session,
            record_routing=self.record_routing)
        return generations, prompts

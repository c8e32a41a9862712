"""The loop's evaluations: held-out pass@1 (and pass@k, greedy pass@1) on a chain the backend
gives at the learner's version, in sessions shaped as its generation sessions, so a peer cannot
tell an evaluation from training (docs/architecture.md, Evaluation). A session that fails on a
transient error runs again once every stage has a server, up to EVALUATION_ATTEMPTS times; each
result goes to the metrics log and the console."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from rich.console import Console

from decentrl.config import RunConfig
from decentrl.coordinator.backend import Backend
from decentrl.envs import Environment
from decentrl.evaluate.runner import EvalResult, TrainingShape, evaluate
from decentrl.observe.metrics import EvalRecord, MetricsLog
from decentrl.progress import progress_bar
from decentrl.rollout.sampling import sampling_config
from decentrl.tasks import Task

log = logging.getLogger(__name__)

# Times one evaluation session may fail (after waiting for its stages' servers each time) before
# the evaluation gives up: a session that fails with every stage served is a bug, not a fault.
EVALUATION_ATTEMPTS = 5


class Evaluations:
    def __init__(self, config: RunConfig, backend: Backend, task: Task | Environment,
                 tokenizer: Any, metrics: MetricsLog, console: Console) -> None:
        self.config, self.backend, self.task, self.tokenizer = config, backend, task, tokenizer
        self.metrics, self.console = metrics, console

    def run(self, label: str, pass_k: int, step: int, version: int) -> EvalResult:
        """Evaluate the learner's `version` at `step`, record it and say it."""
        chain, concurrency = self.backend.evaluation(version)
        ev = self.config.eval
        # Sessions as the backend's generation makes them: a peer cannot tell which it serves
        # (but for the greedy ones, at temperature 0, which are spot-checked like the rest).
        shape = TrainingShape(self.config.rollout.group_size, sampling_config(self.config.rollout),
                              self.backend.generation.problems_per_session, ev.greedy)
        with progress_bar(self.console, f"evaluating ({label})", None) as update:
            result = evaluate(chain, self.task, self.tokenizer, ev.problems,
                              ev.max_new_tokens, ev.batch_size, pass_k=pass_k,
                              seed=self.config.seed, concurrency=concurrency,
                              progress=lambda done, total: update(done, total=total),
                              shape=shape, on_groups=self.backend.evaluated,
                              retry=self._retry)
        greedy = result.greedy_pass1
        self.metrics.write(EvalRecord(
            label=label, step=step, version=version, task=result.task,
            problems=result.problems, pass1=result.pass1.mean, pass1_low=result.pass1.low,
            pass1_high=result.pass1.high,
            pass_k=result.pass_k.mean if result.pass_k else None, k=pass_k,
            greedy_pass1=greedy.mean if greedy else None,
            greedy_pass1_low=greedy.low if greedy else None,
            greedy_pass1_high=greedy.high if greedy else None))
        text = f"eval ({label}) step {step}: pass@1 {result.pass1.as_percent()}"
        if result.pass_k is not None:
            text += f"  pass@{pass_k} {result.pass_k.as_percent()}"
        if greedy is not None:
            text += f"  greedy pass@1 {greedy.as_percent()}"
        self.console.print(text)
        return result

    def _retry(self, error: Exception, failures: int) -> None:
        """An evaluation session failed: wait until every stage has a server, then it runs again
        (the sessions already done count). Raises `error` when it is not one of the backend's
        transient errors or the session failed EVALUATION_ATTEMPTS times."""
        if not isinstance(error, self.backend.generation.transient_errors) \
                or failures >= EVALUATION_ATTEMPTS:
            raise error
        log.warning("an evaluation session failed (%d of %d attempts): %s", failures,
                    EVALUATION_ATTEMPTS, error)
        # Not the run's stop event: the evaluation after training runs once it is set.
        self.backend.await_servers(None)


def write_evaluation(path: Path, result: EvalResult) -> None:
    path.write_text(json.dumps(result.to_json(), indent=2))

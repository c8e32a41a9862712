"""The model card of an exported run: what the model is, how it was trained, how well it does
(with intervals), where its weights came from, and what it cannot be trusted for."""

from __future__ import annotations

from decentrl.config import RunConfig
from decentrl.envs import AGENTIC_ENVIRONMENTS
from decentrl.evaluate.runner import EvalResult
from decentrl.evaluate.suite import SuiteResult, suite_table_markdown
from decentrl.model.loading import DEFAULT_MODEL, DEFAULT_MODEL_HUB_ID
from decentrl.observe.report import SwarmRecord, held_out_table, markdown_text, peer_name


def suite_section(suite: SuiteResult | None) -> str:
    if suite is None:
        return ""
    families = ", ".join(f"`{f.family.label}`" for f in suite.families)
    sampled = f", pass@{suite.pass_k} sampled at T=1" if suite.pass_k > 1 else ""
    return (f"Against the base model, on held-out problems of {families}, and on a general "
            f"prompt set (drift from the base: perplexity and KL per token); pass@1 greedy"
            f"{sampled}, 95% intervals:\n\n"
            f"{suite_table_markdown(suite)}\nThe run's own evaluation, through the swarm:\n\n")


def swarm_section(snapshot: SwarmRecord | None) -> str:
    """The peers at the run's last snapshot (who trained it and who served it)."""
    if snapshot is None:
        return "No record of the swarm's peers was kept for this run.\n"
    lines = [f"The swarm at the run's last snapshot (step {snapshot.step}):", "",
             "| peer | stage | role | weight version | peer id |", "|---|---|---|---|---|"]
    for peer in sorted(snapshot.peers, key=lambda p: (p.stage, p.role, p.name)):
        lines.append(f"| {markdown_text(peer_name(peer.name, peer.peer_id))} | {peer.stage} | "
                     f"{peer.role} | {peer.version} | `{markdown_text(peer.peer_id)}` |")
    return "\n".join(lines) + "\n"


def model_card(config: RunConfig, version: int, steps: int, stage_hashes: list[str],
               before: EvalResult | None, after: EvalResult | None,
               suite: SuiteResult | None = None, snapshot: SwarmRecord | None = None,
               weights: str = "learner") -> str:
    train, rollout = config.train, config.rollout
    stages = "\n".join(f"| {index} | `{digest}` |" for index, digest in enumerate(stage_hashes))
    options = ", ".join(f"{k}={v}" for k, v in sorted(config.task.options.items())) or "defaults"
    adapters = (f"LoRA rank {train.lora_rank} (alpha {train.lora_alpha}) on "
                f"{', '.join(train.lora_targets)}, merged into the weights"
                if train.lora_rank else "full fine-tuning")
    base = DEFAULT_MODEL_HUB_ID if config.model == DEFAULT_MODEL else config.model
    episodes = ("\n\nThe problems were multi-turn episodes with tools: the system prompt lists the "
                "tools as JSON schemas, the model calls one as `<tool_call>{\"name\": ..., "
                "\"arguments\": {...}}</tool_call>` and reads its result in a `tool` message, and "
                "the reply without a call is the final answer. Prompt it the same way (with the "
                "options above: a prefilled first call, a worked example)."
                if config.task.name in AGENTIC_ENVIRONMENTS else "")
    return f"""---
base_model: {base}
tags: [decentrl, reinforcement-learning, grpo]
---
# {config.name}: {config.model} post-trained with RL by decentrl

Post-trained from `{config.model}` with reinforcement learning on verifiable `{config.task.name}`
problems ({options}), by a decentrl swarm: the model was cut into {config.num_stages} pipeline
stages, each trained by its own peer, while inference replicas of each stage generated the
rollouts.{episodes}

## Training
- Algorithm: `{train.loss}` with group-relative advantages (group of {rollout.group_size}),
  {rollout.prompts_per_step} prompts per step, lr {train.lr}, {adapters}.
- Off-policy corrections: truncated importance weights (cap {train.tis_cap}), decoupled
  objective {train.decoupled}, at most {train.max_staleness} versions of staleness.
- Sampling for rollouts: temperature {rollout.temperature}, top-p {rollout.top_p}, top-k
  {rollout.top_k}, at most {rollout.max_new_tokens} new tokens.
- {steps} optimizer steps; this is weight version {version} of every stage, {WEIGHTS_TEXT[weights]}.
- Trust: every reward recomputed by the coordinator, {100 * config.trust.verify_fraction:.0f}% of
  rollout groups re-executed by other replicas, poisoned rows flagged and left out of the loss.

## Evaluation
{suite_section(suite)}{held_out_table(before, after)}

## Provenance
{swarm_section(snapshot)}
The stage shards this folder was assembled from (sha256 of each checkpoint file):

| stage | sha256 |
|---|---|
{stages}

`SHA256SUMS` lists the checksum of every file in this folder.

## Known limits
- {limits_of(suite)}
- Small RL runs vary from run to run; the intervals above are over the held-out problems, not
  over training runs.
"""


WEIGHTS_TEXT = {
    "served": "as the swarm's inference replicas served it (sparse updates: the learner's smallest "
              "changes not yet sent are not in it)",
    "learner": "the training peers' own weights",
}


def limits_of(suite: SuiteResult | None) -> str:
    if suite is None:
        return ("Trained and evaluated on one task family only, through the swarm's replicas (a "
                "replica not yet banned could have skewed it); other abilities were not measured "
                "and may have regressed.")
    return ("Abilities beyond the families above and the general prompt set were not measured "
            "and may have regressed. The comparison with the base was run on this folder's "
            "weights on one machine, not through the swarm.")

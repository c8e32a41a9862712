"""The model card of an exported run, as a Hugging Face user reads it: metadata the Hub indexes
(license, base model, library), how to prompt the model the way it was trained, what the weights
are, how it was trained, how well it does (with intervals), where its weights came from, and what
it cannot be trusted for."""

from __future__ import annotations

import json
from dataclasses import dataclass

from decentrl.config import RunConfig, TrainConfig
from decentrl.envs import AGENTIC_ENVIRONMENTS, Environment, Message, make_task_or_environment
from decentrl.envs.tool_calls import CLOSE_TAG
from decentrl.evaluate.runner import EvalResult
from decentrl.evaluate.suite import SuiteResult, suite_table_markdown
from decentrl.model.loading import DEFAULT_MODEL, BaseOrigin
from decentrl.observe.markdown import markdown_text, peer_name
from decentrl.observe.metrics import SwarmRecord
from decentrl.observe.report import held_out_table

# Where the usage snippet loads the model from; a reader replaces it with this folder or the
# Hub repository it was uploaded to.
MODEL_PLACEHOLDER = "path/to/this/folder"


@dataclass(frozen=True)
class ModelSize:
    """The exported weights, counted from the tensors written."""

    parameters: int
    base_parameters: int  # as the base stores them: a tied head and embedding count once
    dtype: str  # as config.json names it: "float32", "bfloat16", "float16"
    nbytes: int


# What each objective does, for a reader who does not know its name.
LOSS_TEXT = {
    "grpo": "GRPO: each answer's tokens are averaged, then answers are averaged, and each update "
            "is clipped to stay close to the weights it started from",
    "dapo": "DAPO: every token of the batch weighs the same, and the clip range is wider upwards "
            "so that unlikely good answers can grow",
    "dr_grpo": "Dr. GRPO: token losses are summed and divided by a fixed budget, so that long "
               "answers are not favoured",
    "gspo": "GSPO: each update is clipped on the probability of a whole answer, not token by "
            "token",
    "cispo": "CISPO: every token keeps its gradient; it is the importance weight that is clipped, "
             "not the update",
}
WEIGHTS_TEXT = {
    "served": "as the swarm's inference replicas served it (sparse updates: the learner's smallest "
              "changes not yet sent are not in it)",
    "learner": "the training peers' own weights",
}


def millions(count: int) -> str:
    return f"{count / 1e6:.1f}M" if count >= 100_000 else f"{count:,}"


def megabytes(nbytes: int) -> str:
    return f"{nbytes / 1e6:.0f} MB" if nbytes >= 10**7 else f"{nbytes / 1e6:.2f} MB"


def base_name(config: RunConfig, base: BaseOrigin) -> str:
    return base.hub_id if config.model == DEFAULT_MODEL and base.hub_id else config.model


def front_matter(config: RunConfig, base: BaseOrigin) -> str:
    # Values as JSON strings: valid YAML, whatever characters a name holds.
    fields = {"license": base.license, "library_name": "transformers",
              "pipeline_tag": "text-generation"}
    if base.hub_id is not None:
        fields |= {"base_model": base.hub_id, "base_model_relation": "finetune"}
    tags = ["decentrl", "reinforcement-learning", config.train.loss]
    lines = [f"{key}: {json.dumps(value)}" for key, value in fields.items()]
    return "\n".join(["---", *lines, "tags:", *(f"- {json.dumps(tag)}" for tag in tags), "---"])


def example_conversation(config: RunConfig) -> tuple[list[Message], str]:
    """A held-out problem's opening messages in the run's prompt format, and the text the
    model's first turn starts with (the environment's prefill; "" for none)."""
    source = make_task_or_environment(config.task.name, dict(config.task.options))
    if isinstance(source, Environment):
        episode = source.episode("heldout", 0)
        return episode.messages(), episode.turn_prefix()
    return source.messages(source.problem("heldout", 0)), ""


def usage_section(config: RunConfig) -> str:
    messages, prefill = example_conversation(config)
    agentic = config.task.name in AGENTIC_ENVIRONMENTS
    prefill_lines = (f"prefill = {json.dumps(prefill)}\n"
                     "prompt += tokenizer.encode(prefill, add_special_tokens=False)\n"
                     if prefill else "")
    stop = (f", stop_strings=[{json.dumps(CLOSE_TAG)}], tokenizer=tokenizer" if agentic else "")
    shown = "prefill + " if prefill else ""
    snippet = f"""```python
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

folder = "{MODEL_PLACEHOLDER}"  # or the Hub repository it was uploaded to
tokenizer = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder)

messages = {json.dumps(messages, indent=4, ensure_ascii=False)}
prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                       return_dict=True)["input_ids"]
{prefill_lines}inputs = torch.tensor([prompt])
output = model.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=False,
                        max_new_tokens={config.rollout.max_new_tokens}{stop})
print({shown}tokenizer.decode(output[0, len(prompt):], skip_special_tokens=True))
```"""
    intro = ("The model was trained on prompts in exactly this form: the messages of a problem "
             f"of `{config.task.name}` (here a held-out one, which training never saw) through "
             "the tokenizer's chat template.")
    if not agentic:
        return f"{intro}\n\n{snippet}\n"
    options = config.task.options
    prefilled = (" Its first turn was started for it with the opening of a tool call (`prefill` "
                 "in the example); the model writes the rest." if prefill else "")
    example = (" The conversation opens with one worked example as real turns."
               if options.get("worked_example") else "")
    episodes = ("Each problem is an episode with tools: the system prompt lists them as JSON "
                "schemas, the model calls one as `<tool_call>{\"name\": ..., \"arguments\": "
                "{...}}</tool_call>`, and the reply without a call is its final answer.")
    next_turns = ("To continue the episode, append the reply as an `assistant` message, run its "
                  "call, append the result as a `tool` message (an error starts with `error: `), "
                  "and generate again, until a reply holds no call.")
    return f"{intro} {episodes}{example}{prefilled}\n\n{snippet}\n\n{next_turns}\n"


def model_section(size: ModelSize) -> str:
    untied = size.parameters - size.base_parameters
    parameters = f"{millions(size.parameters)} parameters"
    if untied:
        parameters += (f": the base's {millions(size.base_parameters)} plus {millions(untied)} for "
                       "an output head of its own. The base shares one matrix between the token "
                       "embedding and the head; the pipeline puts them on different machines, so "
                       "they were untied and trained apart.")
    # Training peers keep float32 master weights whatever their compute dtype.
    stored = ("the precision the training peers keep their weights in, so the export rounded "
              "nothing" if size.dtype == "float32" else
              "rounded from the float32 weights the run trained, as asked at export")
    return f"""- {parameters}
- Stored in {size.dtype} ({megabytes(size.nbytes)} of tensors): {stored}.
"""


def training_section(config: RunConfig, version: int, steps: int, weights: str) -> str:
    train, rollout = config.train, config.rollout
    options = ", ".join(f"{k}={v}" for k, v in sorted(config.task.options.items())) or "defaults"
    adapters = (f"Only small LoRA adapters (rank {train.lora_rank}, alpha {train.lora_alpha}) on "
                f"{', '.join(train.lora_targets)} were trained; they are merged into these weights."
                if train.lora_rank else "Every weight was trained (full fine-tuning).")
    scaled = ", divided by the group's spread" if train.scale_advantages_by_std else ""
    dropped = (" Groups in which every answer scored the same teach nothing and were left out."
               if train.zero_variance_groups == "drop" else "")
    top_k = f", top-k {rollout.top_k}" if rollout.top_k else ""
    bullets = [
        f"**Problems.** `{config.task.name}` ({options}), from its training split. Each step took "
        f"{rollout.prompts_per_step} problems and sampled {rollout.group_size} answers to each "
        f"(temperature {rollout.temperature}, top-p {rollout.top_p}{top_k}, at most "
        f"{rollout.max_new_tokens} new tokens). A program scored every answer: no reward model.",
        "**Learning.** An answer that scored above its group's average was made more likely, one "
        f"below less, in proportion to the difference{scaled}.{dropped} The objective was "
        f"{LOSS_TEXT[train.loss]}. Learning rate {train.lr}. {adapters}",
        *([supervised_text(config, steps)] if config.supervised.steps
          or config.supervised.interleave_rows else []),
        f"**Stale answers.** {staleness_text(train)}",
        f"**Trust.** {trust_text(config)}",
        f"**Length.** {steps} optimizer steps; this is weight version {version} of every stage, "
        f"{WEIGHTS_TEXT[weights]}.",
    ]
    return "".join(f"- {bullet}\n" for bullet in bullets)


def supervised_text(config: RunConfig, steps: int) -> str:
    """The warm-up as it ran: a run whose budget ended inside it made fewer of its steps."""
    supervised = config.supervised
    parts = []
    if supervised.steps:
        parts.append(f"The first {min(supervised.steps, steps)} steps, before any RL, were "
                     f"supervised: "
                     f"{supervised.rows_per_step} demonstrations each, at learning rate "
                     f"{supervised.lr or config.train.lr}.")
    rl_steps = steps - supervised.steps
    if supervised.interleave_rows and rl_steps > 0:
        parts.append(f"Each of the {rl_steps} RL steps also learned "
                     f"{supervised.interleave_rows} demonstrations.")
    return (f"**Demonstrations.** {' '.join(parts)} A demonstration is the environment's own "
            "scripted solution of a training problem (no teacher model, no downloaded data); "
            "the model learned its assistant turns by likelihood, the tool replies were context.")


def trust_text(config: RunConfig) -> str:
    trust = config.trust
    done = ["recomputed every reward",
            f"had {100 * trust.verify_fraction:.0f}% of the groups of answers generated again by "
            "other replicas, to catch a replica that lies about what it generated"
            if trust.verify_fraction else "had no answers generated again"]
    if trust.flag_log_ratio is not None or trust.flag_surprise is not None:
        done.append("left answers the learner found implausible out of the loss")
    return f"The coordinator {', '.join(done[:-1])}, and {done[-1]}."


def staleness_text(train: TrainConfig) -> str:
    if train.mode == "sync":
        generated = "Answers were generated by the current weights before each step."
    else:
        generated = (f"Answers were generated while training went on, so an answer could come "
                     f"from weights up to {train.max_staleness} updates older than those it "
                     "trained; older ones were dropped.")
    if not train.decoupled:
        return (f"{generated} Each update was clipped against the weights that generated the "
                "answer (classic PPO), which also limits how far an old answer can move them.")
    cap = f"capped at {train.tis_cap}" if train.tis_cap is not None else "not capped"
    return (f"{generated} Each update was clipped against the learner's own weights, and an "
            f"answer from older weights was reweighted by how much likelier the learner finds it "
            f"({cap}): the decoupled objective with truncated importance weights.")


def origin_section(config: RunConfig, base: BaseOrigin) -> str:
    if base.gguf is not None:
        gguf = base.gguf
        if gguf.distribution is None:
            return (f"The starting weights were dequantized to float32 from the GGUF file "
                    f"`{markdown_text(gguf.file)}`, sha256 `{gguf.sha256}`. Training started from "
                    "its weights as stored (a quantized file's rounding included), and the "
                    "evaluation's base is the same.\n")
        return (f"The starting weights are not the Hub's files: they were dequantized to float32 "
                f"from `{gguf.file}`, a GGUF quantization of `{base_name(config, base)}` (most "
                f"matrices in 4 bits) that the `{gguf.distribution}` {gguf.version} pip package "
                f"ships, sha256 `{gguf.sha256}`. Training started from that rounding of the "
                "original weights, and the evaluation's base is the same rounding.\n")
    files = "\n".join(f"| `{markdown_text(name)}` | `{digest}` |"
                      for name, digest in sorted(base.weight_files.items()))
    lineage = (f", which descends from `{base.hub_id}`" if base.hub_id is not None else "")
    return (f"The starting weights are the local folder `{markdown_text(config.model)}`"
            f"{lineage}:\n\n| file | sha256 |\n|---|---|\n{files}\n")


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
        # Every text here came from a peer: escaped, and no code span (a backtick would end it,
        # and Markdown's escapes do not work inside one).
        lines.append(f"| {markdown_text(peer_name(peer.name, peer.peer_id))} | {peer.stage} | "
                     f"{markdown_text(peer.role)} | {peer.version} | "
                     f"{markdown_text(peer.peer_id)} |")
    return "\n".join(lines) + "\n"


def model_card(config: RunConfig, base: BaseOrigin, size: ModelSize, version: int, steps: int,
               stage_hashes: list[str], before: EvalResult | None, after: EvalResult | None,
               suite: SuiteResult | None = None, snapshot: SwarmRecord | None = None,
               weights: str = "learner") -> str:
    stages = "\n".join(f"| {index} | `{digest}` |" for index, digest in enumerate(stage_hashes))
    name = base_name(config, base)
    warm_up = (" (after a supervised warm-up on the environment's own demonstrations)"
               if config.supervised.steps else "")
    summary = (f"Post-trained from `{name}` with reinforcement learning{warm_up} on verifiable "
               f"`{config.task.name}` problems, by a decentrl swarm: the model was cut into "
               f"{config.num_stages} pipeline stages, each trained by its own peer, while "
               "inference replicas of each stage generated the answers it learned from.")
    return f"""{front_matter(config, base)}
# {config.name}: {name} post-trained with RL by decentrl

{summary}

## Use
{usage_section(config)}
## Weights
{model_section(size)}
## Training
{training_section(config, version, steps, weights)}
## Evaluation
{suite_section(suite)}{held_out_table(before, after)}

## Provenance
{origin_section(config, base)}
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


def limits_of(suite: SuiteResult | None) -> str:
    if suite is None:
        return ("Trained and evaluated on one task family only, through the swarm's replicas (a "
                "replica not yet banned could have skewed it); other abilities were not measured "
                "and may have regressed.")
    return ("Abilities beyond the families above and the general prompt set were not measured "
            "and may have regressed. The comparison with the base was run on this folder's "
            "weights on one machine, not through the swarm.")

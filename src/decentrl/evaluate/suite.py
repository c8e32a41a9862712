"""An evaluation suite: held-out pass@1 and pass@k of a model, and of its base when given, on
several task families (the one a run trained on and some it did not, to catch regressions), plus
the drift from the base on general text (divergence.py). `decentrl eval`, the run report and the
model card read its result; `suite_table_markdown` is the table they embed.

Intervals are 95%. The change of pass@1 is Newcombe's interval for two independent proportions
and the change of a sampled pass@k the normal interval of a difference of two independent means.
Model and base answer the same problems (and draw their samples with the same seeds), so the
real differences are paired and these intervals err on the wide side.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import torch

from decentrl.device import compute_dtype, pick_device
from decentrl.envs import Environment, make_task_or_environment
from decentrl.evaluate.divergence import (
    GeneralPrompt,
    GeneralResult,
    Interval,
    evaluate_general,
    load_general_prompts,
)
from decentrl.evaluate.runner import (
    EpisodeStats,
    EvalResult,
    episode_rows,
    evaluate,
    level_order,
    pass1_label,
)
from decentrl.evaluate.stats import Z_95, Accuracy, difference_interval
from decentrl.model.loading import LoadedModel, load_model, load_tokenizer, resolve_model
from decentrl.model.stages import StageModule, StagePlan, build_stages
from decentrl.rollout.chain import LocalChain
from decentrl.tasks import Task

# Reports progress as (what is being done, units done, units in all; None: not known yet).
SuiteProgress = Callable[[str, int, int | None], None]


@dataclass(frozen=True)
class Family:
    """One task family of a suite: a task with its options, evaluated on its first `problems`
    held-out problems."""

    task: str
    options: dict[str, Any] = field(default_factory=dict)
    problems: int = 100
    max_new_tokens: int = 64

    def __post_init__(self) -> None:
        if self.problems < 1:
            raise ValueError(f"{self.label}: problems must be >= 1, got {self.problems}")
        if self.max_new_tokens < 1:
            raise ValueError(f"{self.label}: max_new_tokens must be >= 1, got "
                             f"{self.max_new_tokens}")

    @property
    def label(self) -> str:
        """"sums min_digits=2 max_digits=2": the task and its options, for tables."""
        options = " ".join(f"{key}={json.dumps(value, separators=(',', ':'))}"
                           for key, value in self.options.items())
        return f"{self.task} {options}".strip()


# The demo trains on sums of two terms of up to two digits and is scored on two-digit sums; three
# terms and three digits are sums it never trains on. SmolLM2-135M-Instruct solves some of each
# before training (about 9% and 3% of 32), so a regression has room to show. The reasoning-gym
# families are absent: their scorer reads the answer only inside <answer></answer> tags, which
# this model never writes, so it scores 0% before and after whatever it has learnt.
DEFAULT_SUITE: tuple[Family, ...] = (
    Family("sums", {"min_digits": 2, "max_digits": 2}, max_new_tokens=24),
    Family("sums", {"min_digits": 1, "max_digits": 1, "terms": 3}, max_new_tokens=24),
    Family("sums", {"min_digits": 3, "max_digits": 3}, max_new_tokens=24),
)


@dataclass(frozen=True)
class FamilyResult:
    family: Family
    model: EvalResult
    base: EvalResult | None
    pass1_change: Interval | None  # model minus base
    pass_k_change: Interval | None  # model minus base; None without a base or with k = 1


@dataclass(frozen=True)
class SuiteResult:
    model: str
    base: str | None
    pass_k: int
    seed: int
    families: list[FamilyResult]
    general: GeneralResult
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SuiteResult:
        return cls(**{**data,
                      "families": [family_result_from_json(f) for f in data["families"]],
                      "general": general_result_from_json(data["general"])})


def eval_result_from_json(data: dict[str, Any]) -> EvalResult:
    """An EvalResult's `to_json`, nested results included; a field newer than the file takes its
    default."""
    return msgspec.convert(data, EvalResult)


def interval_from_json(data: dict[str, Any] | None) -> Interval | None:
    return Interval(**data) if data is not None else None


def family_result_from_json(data: dict[str, Any]) -> FamilyResult:
    return FamilyResult(
        family=Family(**data["family"]), model=eval_result_from_json(data["model"]),
        base=eval_result_from_json(data["base"]) if data["base"] else None,
        pass1_change=interval_from_json(data["pass1_change"]),
        pass_k_change=interval_from_json(data["pass_k_change"]))


def general_result_from_json(data: dict[str, Any]) -> GeneralResult:
    return GeneralResult(**{**data, "kl": interval_from_json(data["kl"])})


def pass1_change(model: Accuracy, base: Accuracy) -> Interval:
    """model - base of two pass@1 proportions, with Newcombe's interval."""
    solved_model, solved_base = round(model.mean * model.n), round(base.mean * base.n)
    low, high = difference_interval(solved_model, model.n, solved_base, base.n)
    return Interval(model.mean - base.mean, low, high)


def half_width(estimate: Accuracy) -> float:
    return max(estimate.mean - estimate.low, estimate.high - estimate.mean)


def mean_change(model: Accuracy, base: Accuracy) -> Interval:
    """model - base of two means of sampled scores: the standard errors, read back from the
    intervals as their wider side / Z_95, add in quadrature. A sampled interval is Wilson's on the
    effective number of trials (stats.Accuracy.from_scores): its wider side is about Z_95 standard
    errors, a little less near 1/2 (by 1/sqrt(1 + Z_95^2 / n_eff)) and more near 0 and 1, where a
    share that did not move still has a spread. The bounds are clipped to [-1, 1], the
    differences two shares can have."""
    standard_error = math.hypot(half_width(model), half_width(base)) / Z_95
    difference = model.mean - base.mean
    return Interval(difference, max(-1.0, difference - Z_95 * standard_error),
                    min(1.0, difference + Z_95 * standard_error))


def load_stages(source: str, num_stages: int, device: torch.device, dtype: torch.dtype
                ) -> tuple[LoadedModel, list[StageModule]]:
    loaded = load_model(source)
    plan = StagePlan.even(loaded.spec.num_layers, num_stages)
    stages = build_stages(loaded.spec, plan, loaded.tensors, device, dtype)
    loaded.tensors.clear()  # the stages hold copies; the checkpoint's fp32 ones are dead weight
    return loaded, stages


def evaluate_families(label: str, stages: list[StageModule], tokenizer: Any,
                      tasks: Sequence[tuple[Family, Task | Environment]], pass_k: int,
                      batch_size: int, seed: int, progress: SuiteProgress) -> list[EvalResult]:
    results = []
    for family, task in tasks:
        description = f"{label} · {family.label}"
        progress(description, 0, None)  # names the work before its first batch is done
        results.append(evaluate(
            LocalChain(stages), task, tokenizer, family.problems, family.max_new_tokens,
            batch_size, pass_k=pass_k, seed=seed, progress=partial(progress, description)))
    return results


def evaluate_suite(model: str | Path, base: str | Path | None = None,
                   families: Sequence[Family] = DEFAULT_SUITE, pass_k: int = 4,
                   batch_size: int = 64, num_stages: int = 1, device: str = "auto",
                   dtype: str = "auto", seed: int = 0,
                   general_prompts: Sequence[GeneralPrompt] | None = None,
                   progress: SuiteProgress | None = None) -> SuiteResult:
    """Evaluate `model` (a Hugging Face folder or a cached model name, as `load_model` takes) on
    every family and on the general prompt set (the packaged one unless given); with `base`, the
    same for the base, the changes of pass@1 and pass@k, and KL(model || base). Bad arguments
    raise ValueError (FileNotFoundError for a missing model) before any evaluation starts."""
    started = time.time()
    report: SuiteProgress = progress or (lambda description, done, total: None)
    if not families:
        raise ValueError("the suite has no task family")
    if pass_k < 1:
        raise ValueError(f"pass_k must be >= 1, got {pass_k}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    tasks = [(family, make_task_or_environment(family.task, family.options))
             for family in families]
    model_folder = resolve_model(str(model))
    if base is not None and (load_tokenizer(resolve_model(str(base))).get_vocab()
                             != load_tokenizer(model_folder).get_vocab()):
        raise ValueError(f"{model} and its base {base} have different tokenizers; the comparison "
                         "needs one shared vocabulary")
    chosen_device = pick_device(device)
    chosen_dtype = compute_dtype(chosen_device, dtype)
    prompts = list(general_prompts) if general_prompts is not None else load_general_prompts()

    report(f"loading {model}", 0, None)
    loaded, model_stages = load_stages(str(model), num_stages, chosen_device, chosen_dtype)
    model_results = evaluate_families("model", model_stages, loaded.tokenizer, tasks, pass_k,
                                      batch_size, seed, report)
    base_stages: list[StageModule] | None = None
    base_results: list[EvalResult | None] = [None] * len(tasks)
    if base is not None:
        report(f"loading {base}", 0, None)
        base_loaded, base_stages = load_stages(str(base), num_stages, chosen_device, chosen_dtype)
        base_results = list(evaluate_families("base", base_stages, base_loaded.tokenizer, tasks,
                                              pass_k, batch_size, seed, report))

    general = evaluate_general(model_stages, base_stages, loaded.tokenizer, prompts,
                               progress=partial(report, "general set"))
    family_results = []
    for (family, _), after, before in zip(tasks, model_results, base_results):
        pass_k_change = None
        if before is not None and before.pass_k is not None and after.pass_k is not None:
            pass_k_change = mean_change(after.pass_k, before.pass_k)
        family_results.append(FamilyResult(
            family=family, model=after, base=before,
            pass1_change=pass1_change(after.pass1, before.pass1) if before is not None else None,
            pass_k_change=pass_k_change))
    return SuiteResult(model=str(model), base=str(base) if base is not None else None,
                       pass_k=pass_k, seed=seed, families=family_results, general=general,
                       seconds=time.time() - started)


def with_overrides(families: Sequence[Family], problems: int | None = None,
                   max_new_tokens: int | None = None) -> list[Family]:
    """The families with their problem count and token budget replaced where given."""
    changes = {name: value for name, value in
               (("problems", problems), ("max_new_tokens", max_new_tokens)) if value is not None}
    return [replace(family, **changes) for family in families]


def percent_change(change: Interval) -> str:
    return (f"{100 * change.mean:+.1f} pts [{100 * change.low:+.1f}, "
            f"{100 * change.high:+.1f}]")


def accuracy_row(label: str, before: Accuracy | None, after: Accuracy | None,
                 change_of: Callable[[Accuracy, Accuracy], Interval]) -> list[str]:
    """[label, before, after, change]; `change_of(after, before)` is the change's interval."""
    change = percent_change(change_of(after, before)) if before and after else "-"
    return [label, before.as_percent() if before else "-", after.as_percent() if after else "-",
            change]


def episodes_text(episodes: EpisodeStats) -> str:
    """"2.10 · 1.30 · 12.0%": turns and tool calls per episode, the share of calls invalid."""
    invalid = ("-" if episodes.invalid_call_rate is None
               else f"{100 * episodes.invalid_call_rate:.1f}%")
    return f"{episodes.mean_turns:.2f} · {episodes.mean_tool_calls:.2f} · {invalid}"


def chain_steps_text(counts: dict[str, int]) -> str:
    """"step 1 60%, step 2 10% (of 40)": the share of episodes that reached at least each step
    of the chain."""
    total = sum(counts.values())

    def share(step: int) -> str:
        reached = sum(episodes for steps, episodes in counts.items() if int(steps) >= step)
        return f"step {step} {100 * reached / total:.0f}%"

    shares = ", ".join(share(step) for step in range(1, max(map(int, counts)) + 1))
    return f"{shares or 'no step'} (of {total})"


def level_rows(before: EvalResult | None, after: EvalResult | None) -> list[list[str]]:
    """Rows [level, metric, before, after, change] per difficulty level of either result (none
    for files from before levels): pass@1, greedy pass@1 beside a sampled one, and for an
    environment what its episodes did and how far along their chain they got. A level's name
    and problem count are on its first row only."""
    shown = after or before
    if shown is None:
        return []
    change_of = pass1_change if shown.pass1_temperature is None else mean_change
    rows: list[list[str]] = []
    for name in sorted({*(before.levels if before else ()), *(after.levels if after else ())},
                       key=level_order):
        old = before.levels.get(name) if before else None
        new = after.levels.get(name) if after else None
        level = new or old
        assert level is not None  # the name is one of theirs
        label = f"{name} ({level.problems} problems)"
        rows.append([label, *accuracy_row(pass1_label(shown), old.pass1 if old else None,
                                          new.pass1 if new else None, change_of)])
        if level.greedy_pass1 is not None:
            rows.append(["", *accuracy_row("pass@1 (greedy)", old.greedy_pass1 if old else None,
                                           new.greedy_pass1 if new else None,
                                           pass1_change)])
        if level.episodes is not None:
            rows.append(["", "turns · tool calls · invalid-call rate",
                         *(episodes_text(stats.episodes) if stats and stats.episodes else "-"
                           for stats in (old, new)), "-"])
        if any(stats and stats.chain_steps for stats in (old, new)):
            rows.append(["", "episodes that reached chain step",
                         *(chain_steps_text(stats.chain_steps) if stats and stats.chain_steps
                           else "-" for stats in (old, new)), "-"])
    return rows


def suite_table_rows(result: SuiteResult) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the result table: per family pass@1 and pass@k, then the general set.
    With a base the columns are base, model and change; without one, only the model."""
    with_base = result.base is not None
    header = ["family", "metric", *(["base", "model", "change"] if with_base else ["model"])]
    rows: list[list[str]] = []
    for item in result.families:
        name = f"{item.family.label} ({item.model.problems} problems)"
        metrics = [(pass1_label(item.model), item.model.pass1,
                    item.base.pass1 if item.base else None, item.pass1_change)]
        if item.model.pass_k is not None:
            metrics.append((f"pass@{item.model.k} (T=1)", item.model.pass_k,
                            item.base.pass_k if item.base else None, item.pass_k_change))
        for metric, after, before, change in metrics:
            row = [name, metric]
            if with_base:
                row += [before.as_percent() if before else "", after.as_percent(),
                        percent_change(change) if change else ""]
            else:
                row.append(after.as_percent())
            rows.append(row)
            name = ""
        for metric, before_cell, after_cell in episode_rows(item.base, item.model):
            rows.append(["", metric, *([before_cell, after_cell, ""] if with_base
                                       else [after_cell])])
        level = ""
        for label, metric, before_cell, after_cell, change_cell in level_rows(item.base,
                                                                               item.model):
            level = label or level
            rows.append(["", f"{level}: {metric}", *([before_cell, after_cell, change_cell]
                                                     if with_base else [after_cell])])
    general = result.general
    name = f"general set ({general.prompts} prompts, {general.tokens} tokens)"
    if general.base_perplexity is not None and general.kl is not None:
        relative = general.perplexity / general.base_perplexity - 1
        rows.append([name, "perplexity", f"{general.base_perplexity:.3f}",
                     f"{general.perplexity:.3f}", f"{100 * relative:+.1f}%"])
        rows.append(["", "KL(model ‖ base), nats/token", "",
                     f"{general.kl.mean:.4f} [{general.kl.low:.4f}, {general.kl.high:.4f}]", ""])
    else:
        rows.append([name, "perplexity", f"{general.perplexity:.3f}"])
    return header, rows


def suite_table_markdown(result: SuiteResult) -> str:
    """The result table in Markdown (95% intervals in brackets), for reports and model cards."""
    header, rows = suite_table_rows(result)

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    return "\n".join([line(header), line(["---"] * len(header)), *map(line, rows)]) + "\n"

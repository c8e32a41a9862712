"""Share of rollout groups without reward spread, with and without difficulty-aware scheduling.

Two parts. Measure: the base model (`--model`, default SmolLM2-135M-Instruct) samples
`--group-size` rows (the demo's 8, at the demo's rollout sampling and `max_new_tokens`) for
`--problems` train problems of every difficulty bucket of the demo's task (sums of one- and
two-digit numbers: buckets by digit counts and carries, coordinator/curriculum.py `bucket_of`), with
decentrl's own generation (rollout/generate.py) in this process, and the task's rewards. That
gives each measured problem its group's rewards as the base would produce them.

Simulate: `--groups` groups are scheduled from the demo task's seeded train stream, as the
coordinator schedules them (coordinator/scheduler.py `PromptScheduler`), three times: without the
curriculum, with it but no problem handed out again (`replay_share` 0), and with the demo's
`[curriculum]` settings, replays included (coordinator/curriculum.py `Curriculum`). Each scheduled
problem starts as one measured problem of its bucket (the same one whenever its key comes back,
or it is handed out again): its success chance is that problem's measured pass rate, and its
group is `--group-size` rows each solved with that chance (the demo's task rewards 0 or 1). The
policy moves: every group of a problem with reward spread (the only ones that carry an
advantage, so a gradient) moves that problem's chance `--learning-rate` of the way to 1, so a
replay sees the outcomes of a policy trained on its earlier groups, and a problem the policy
has learned loses its spread. A group without spread teaches nothing (its advantages are 0), so
a problem the base never solves stays at 0; nothing transfers between problems. The model is
deliberately simple: the rate is one number, not fitted to a run (0.1: a problem solved 1 time
in 8 is solved half the time after 5 groups with spread, 3 times in 4 after 12). Each variant
runs twice, with the policy fixed (rate 0: the base's rates throughout, the start of a run) and
moving. The curriculum is told every group's rewards as the loop would tell it. Figures: the
share of scheduled groups without reward spread and the share of rows solved, each variant and
policy, and the buckets' share of scheduled groups.

The measured groups are written to `--outcomes` (JSON) and read from there when it exists, so
the simulation can be rerun without the model.

Run: python -m bench.curriculum [--problems 40] [--groups 4000] [--learning-rate 0.1]
     [--threads 2]
Smoke: python -m bench.curriculum --model tiny --problems 2 --groups 50
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import common

if TYPE_CHECKING:
    from decentrl.config import RunConfig

# Candidates of the train stream scanned per measured problem of a bucket: a bucket the task
# draws at least 1 time in 50 gets its problems (the demo's rarest: 1 in 40).
SCANNED_PER_PROBLEM = 100


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = common.bench_parser("curriculum", __doc__, "simulated run",
                                 {"batch": "problems per generation session"})
    parser.add_argument("--problems", type=int, default=40,
                        help="measured train problems per difficulty bucket")
    parser.add_argument("--group-size", type=int, default=8, help="rows per problem (the demo's)")
    parser.add_argument("--groups", type=int, default=4000,
                        help="groups scheduled in each simulated run")
    parser.add_argument("--floor", type=float, default=None,
                        help="curriculum.floor of the run with it (default: the demo's)")
    parser.add_argument("--sharpness", type=float, default=None,
                        help="curriculum.sharpness of the run with it (default: the demo's)")
    parser.add_argument("--learning-rate", type=float, default=0.1,
                        help="per group with reward spread, the share of the way to 1 its "
                             "problem's success chance moves (the moving policy's runs)")
    parser.add_argument("--outcomes", default=None,
                        help="JSON file of measured groups: read if it exists, else written")
    args = parser.parse_args(argv)
    if args.problems < 1 or args.group_size < 2 or args.groups < 1 or args.batch < 1:
        parser.error("--problems, --groups and --batch must be >= 1, --group-size >= 2")
    if not 0 < args.learning_rate <= 1:
        parser.error("--learning-rate must be in (0, 1]")
    return args


def demo_task_config(args: argparse.Namespace) -> RunConfig:
    """The demo's sums run, with this bench's group size, model and seed."""
    from decentrl.config import parse_config
    from decentrl.demo import demo_config

    data = demo_config("sums")
    data["rollout"]["group_size"] = args.group_size
    data["model"] = common.bench_model(args.model)
    data["seed"] = args.seed
    return parse_config(data)


def measure(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Every bucket's measured groups: each problem's key and the rewards of its `group_size`
    sampled rows."""
    import torch

    from decentrl.coordinator.curriculum import bucket_of
    from decentrl.device import compute_dtype, pick_device
    from decentrl.envs import Environment, make_task_or_environment
    from decentrl.evaluate.suite import load_stages
    from decentrl.model.loading import load_tokenizer, resolve_model
    from decentrl.rollout.chain import LocalChain
    from decentrl.rollout.generate import generate
    from decentrl.rollout.sampling import sampling_config
    from decentrl.tasks import render_prompt

    if args.threads:
        torch.set_num_threads(args.threads)
    config = demo_task_config(args)
    task = make_task_or_environment(config.task.name, config.task.options)
    assert not isinstance(task, Environment), "the measurement runs a single-turn task"
    problems: dict[str, list[Any]] = {}
    for index in range(SCANNED_PER_PROBLEM * args.problems):
        problem = task.problem("train", index)
        found = problems.setdefault(bucket_of(problem), [])
        if len(found) < args.problems:
            found.append(problem)
    device = pick_device(args.device)
    _, stages = load_stages(config.model, 1, device, compute_dtype(device, args.dtype))
    chain = LocalChain(stages)
    tokenizer = load_tokenizer(resolve_model(config.model))
    sampling = sampling_config(config.rollout)
    size = config.rollout.group_size
    measured: dict[str, list[dict[str, Any]]] = {}
    started = time.time()
    for bucket, bucket_problems in sorted(problems.items()):
        for first in range(0, len(bucket_problems), args.batch):
            batch = bucket_problems[first:first + args.batch]
            prompts = [render_prompt(task, p, tokenizer) for p in batch]
            generations = generate(chain, [p for p in prompts for _ in range(size)],
                                   config.rollout.max_new_tokens, sampling,
                                   {tokenizer.eos_token_id}, tokenizer.pad_token_id,
                                   seed=args.seed * 2**32 + batch[0].index)
            for i, problem in enumerate(batch):
                rows = generations[i * size:(i + 1) * size]
                rewards = [task.reward(problem, tokenizer.decode(g.tokens,
                                                                 skip_special_tokens=True)).total
                           for g in rows]
                measured.setdefault(bucket, []).append({"key": problem.key, "rewards": rewards})
        print(f"measured {bucket}: {len(bucket_problems)} problems "
              f"({time.time() - started:.0f} s so far)", flush=True)
    return measured


# The simulated runs: name -> changes to the demo's [curriculum].
VARIANTS: dict[str, dict[str, Any]] = {"without": {"enabled": False},
                                       "with": {"enabled": True, "replay_share": 0.0},
                                       "replays": {"enabled": True}}


def simulate(args: argparse.Namespace, measured: dict[str, list[dict[str, Any]]],
             variant: dict[str, Any], learning_rate: float) -> dict[str, Any]:
    """`args.groups` groups scheduled as the coordinator schedules them, each problem's rows
    solved with its current chance (from a measured problem of its bucket, moved toward 1 by
    `learning_rate` per group with spread); the curriculum observes every one."""
    from decentrl.config import CurriculumConfig
    from decentrl.coordinator.curriculum import Curriculum, bucket_of, has_spread
    from decentrl.coordinator.scheduler import PromptScheduler, source_index
    from decentrl.envs import make_task_or_environment
    from decentrl.rollout.types import Rollout, RolloutGroup, ScoredGroup, VersionSpan

    config = demo_task_config(args)
    task = make_task_or_environment(config.task.name, config.task.options)
    changes = {**variant, "floor": args.floor, "sharpness": args.sharpness}
    settings = CurriculumConfig(**{**config.curriculum.model_dump(),
                                   **{k: v for k, v in changes.items() if v is not None}})
    curriculum = Curriculum(settings, task, args.group_size, args.seed)
    scheduler = PromptScheduler(args.seed, admits=curriculum.admits,
                                replay=curriculum.next_replay)
    draw = random.Random(args.seed)
    row = Rollout(prompt_tokens=[0], completion_tokens=[0], behaviour_logprobs=[0.0],
                  finished=True)
    flat = solved = 0
    mix: dict[str, int] = {}
    chance: dict[str, float] = {}  # per problem key: the policy's success chance now
    # A step's worth at a time: what the loop schedules before those groups come back.
    per_round = config.rollout.prompts_per_step
    scheduled = 0
    while scheduled < args.groups:
        for index in scheduler.next(min(per_round, args.groups - scheduled)):
            problem = task.problem("train", source_index(index))
            bucket = bucket_of(problem)
            if bucket not in measured:
                raise SystemExit(f"no measured problem of bucket {bucket!r}: measure more "
                                 "problems (--problems)")
            # A problem starts as one measured problem of its bucket, the same each time its
            # key comes back: the base's pass rate on it.
            if problem.key not in chance:
                measured_rows = random.Random(problem.key).choice(measured[bucket])["rewards"]
                chance[problem.key] = sum(measured_rows) / len(measured_rows)
            rewards = [float(draw.random() < chance[problem.key])
                       for _ in range(args.group_size)]
            group = RolloutGroup(group_id=str(index), task=task.name, problem_index=index,
                                 stage_versions=[0],
                                 version_spans=[VersionSpan(start=0, versions=[0])],
                                 sampling_seed=0, rollouts=[row] * args.group_size)
            # The demo's task has no partial credit: a reward of 1 is a solved row.
            curriculum.observe(ScoredGroup(group=group, rewards=rewards,
                                           correct=[float(r >= 1.0) for r in rewards]))
            if has_spread(rewards):  # an advantage, so a gradient: the policy learns it
                chance[problem.key] += learning_rate * (1.0 - chance[problem.key])
            else:
                flat += 1
            solved += sum(rewards)
            mix[bucket] = mix.get(bucket, 0) + 1
            scheduled += 1
    return {"zero_spread_share": flat / args.groups,
            "solved_share": solved / (args.groups * args.group_size), "mix": mix,
            "candidates_per_group": scheduler.position / args.groups,
            "estimates": curriculum.counters(), "settings": settings.model_dump()}


def measured_outcomes(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    if args.outcomes and Path(args.outcomes).is_file():
        return json.loads(Path(args.outcomes).read_text())
    measured = measure(args)
    if args.outcomes:
        Path(args.outcomes).write_text(json.dumps(measured))
    return measured


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    measured = measured_outcomes(args)
    # Each variant with the policy fixed (the base throughout) and moving.
    policies = {"fixed": 0.0, "moving": args.learning_rate}
    runs = {(name, policy): simulate(args, measured, variant, rate)
            for name, variant in VARIANTS.items() for policy, rate in policies.items()}
    results = {name: runs[name, "fixed"] for name in VARIANTS}
    rows = []
    for bucket in sorted(measured):
        groups = measured[bucket]
        rewards = [r for g in groups for r in g["rewards"]]
        flat = sum(max(g["rewards"]) == min(g["rewards"]) for g in groups)
        rows.append([bucket, len(groups), sum(rewards) / len(rewards), flat / len(groups),
                     *(result["mix"].get(bucket, 0) / args.groups
                       for result in results.values())])
    common.print_table("the base model's groups per difficulty bucket, and the buckets' shares "
                       "of the groups scheduled",
                       ["bucket", "problems", "mean reward", "groups without spread",
                        "share without", "share with", "share with replays"], rows,
                       f"{args.model}, {args.group_size} rows per problem at the demo's rollout "
                       "sampling")
    figures: dict[str, float] = {}
    rows = []
    for (name, policy), result in runs.items():
        rows.append([name, policy, result["zero_spread_share"], result["solved_share"],
                     result["candidates_per_group"],
                     result["estimates"]["replays_handed_out"] / args.groups])
        prefix = name if policy == "fixed" else f"{name}_{policy}"
        figures[f"{prefix}_zero_spread_share"] = result["zero_spread_share"]
        figures[f"{prefix}_solved_share"] = result["solved_share"]
        figures[f"{prefix}_candidates_per_group"] = result["candidates_per_group"]
    common.print_table("groups without reward spread, scheduled as the coordinator does",
                       ["curriculum", "policy", "without spread", "rows solved",
                        "candidates per group", "replays"],
                       rows, f"{args.groups} groups per run; a problem starts at a measured "
                       f"problem's pass rate of its bucket; moving: +{args.learning_rate:g} of "
                       f"the way to 1 per group with spread; curriculum "
                       f"{results['replays']['settings']}, seed {args.seed}")
    common.print_figures("curriculum", figures)
    common.write_json(args.json, {"measured": measured,
                                  "results": {f"{name}/{policy}": result
                                              for (name, policy), result in runs.items()}})


if __name__ == "__main__":
    main()

"""Share of rollout groups without reward spread, with and without difficulty-aware scheduling.

Two parts. Measure: the base model (`--model`, default SmolLM2-135M-Instruct) samples
`--group-size` rows (the demo's 8, at the demo's rollout sampling and `max_new_tokens`) for
`--problems` train problems of every difficulty bucket of the demo's task (sums of one- and
two-digit numbers: buckets 1+1, 1+2 and 2+2 digits, swarm/curriculum.py `bucket_of`), with
decentrl's own generation (rollout/generate.py) in this process, and the task's rewards. That
gives each measured problem its group's rewards as the base would produce them.

Simulate: `--groups` groups are scheduled from the demo task's seeded train stream, as the
coordinator schedules them (swarm/scheduler.py `PromptScheduler`), once without the curriculum
and once with it (swarm/curriculum.py `Curriculum`, the demo's `[curriculum]` settings). Each
scheduled problem's group is the measured group of a measured problem of its bucket, drawn at
random (the base model does not learn here, so the estimates settle on the base's pass rates),
and the curriculum is told its rewards as the loop would tell it. Figures: the share of scheduled
groups without reward spread, each variant, and the buckets' share of scheduled groups.

The measured groups are written to `--outcomes` (JSON) and read from there when it exists, so
the simulation can be rerun without the model.

Run: python bench/curriculum.py [--problems 40] [--groups 4000] [--threads 2]
Smoke: python bench/curriculum.py --model tiny --problems 2 --groups 50
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

# Measured groups per bucket above this are enough; candidates beyond this many per measured
# problem mean the task hardly ever draws the bucket.
MAX_CANDIDATES_PER_PROBLEM = 200


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = common.bench_parser("curriculum", __doc__, "simulated run",
                                 {"batch": "problems per generation session"})
    parser.add_argument("--problems", type=int, default=40,
                        help="measured train problems per difficulty bucket")
    parser.add_argument("--group-size", type=int, default=8, help="rows per problem (the demo's)")
    parser.add_argument("--groups", type=int, default=4000,
                        help="groups scheduled in each simulated run")
    parser.add_argument("--outcomes", default=None,
                        help="JSON file of measured groups: read if it exists, else written")
    args = parser.parse_args(argv)
    if args.problems < 1 or args.group_size < 2 or args.groups < 1 or args.batch < 1:
        parser.error("--problems, --groups and --batch must be >= 1, --group-size >= 2")
    return args


def demo_task_config(args: argparse.Namespace) -> Any:
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

    from decentrl.device import compute_dtype, pick_device
    from decentrl.envs import Environment, make_task_or_environment
    from decentrl.evaluate.suite import load_stages
    from decentrl.model.loading import load_tokenizer, resolve_model
    from decentrl.rollout.chain import LocalChain
    from decentrl.rollout.generate import generate
    from decentrl.rollout.sampling import sampling_config
    from decentrl.swarm.curriculum import bucket_of
    from decentrl.tasks import render_prompt

    if args.threads:
        torch.set_num_threads(args.threads)
    config = demo_task_config(args)
    task = make_task_or_environment(config.task.name, config.task.options)
    assert not isinstance(task, Environment), "the measurement runs a single-turn task"
    problems: dict[str, list[Any]] = {}
    index = 0
    while (len(problems) < 1 or min(len(p) for p in problems.values()) < args.problems) \
            and index < MAX_CANDIDATES_PER_PROBLEM * args.problems:
        problem = task.problem("train", index)
        found = problems.setdefault(bucket_of(problem), [])
        if len(found) < args.problems:
            found.append(problem)
        index += 1
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

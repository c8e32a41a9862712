"""decentrl against TRL's GRPOTrainer at the same budget.

decentrl against TRL's GRPOTrainer: held-out accuracy against training wall-clock, on the same
model, task, prompts and hyperparameters, each side given the same training-time budget.

    decentrl bench vs-trl [--budget 900] [--eval-every 10] [--trl-eval-every N]
                          [--eval-problems 200] [--out runs/vs-trl]

Both sides train with the demo's config (examples/demo.toml): sums of 1-2 digit numbers from the
same seeded stream of train problems, 8 prompts x 8 samples = 64 completions per step (batch),
split into the same minibatches (an optimizer step each) and epochs (TRL's steps_per_generation and
num_iterations), in micro-batches of the same size, the same max new tokens, temperature 1,
learning rate, AdamW betas, clipping range (both sides, TRL's epsilon and epsilon_high) and
gradient clipping, the GRPO loss (each sequence's token mean, then the mean over sequences), no KL
term, bf16 autocast where decentrl's compute dtype is bf16, no vLLM. The recipe's adaptive entropy
bonus is TRL's too (`use_adaptive_entropy`, the same rule); TRL has no Clip-Cov or KL-Cov: where
the recipe uses one, TRL trains without it (and says so as it starts). Both are evaluated by
decentrl's `evaluate` (greedy pass@1 on held-out two-digit sums) every --eval-every steps, and at
the start and the end. Evaluations pause the budget clock: the curves are against training seconds
only. A side does not start a step it could not finish within the budget (judged by its previous
step).

On CPU, each side uses torch's threads its own way: TRL runs one compute thread on all of them,
decentrl's asynchronous run splits them between its learner and rollout worker. On a machine
shared with other work, all-core thread pools can slow down many times over (spin-waiting on
busy cores); run on a quiet machine, or compare with --threads 1 as well.

Differences that remain, by design of each library: decentrl generates asynchronously (a rollout
worker runs ahead of the learner, within the staleness bound) over a 2-stage pipeline with an
untied head; it drops groups whose rewards do not vary and fills each batch with groups that
do (dynamic sampling), and its curriculum passes over problems of the stream unlikely to teach
and hands out again problems whose group varied. TRL takes the stream's problems in order,
generates then trains, in one process, with Hugging Face `generate` and the checkpoint's tied
embedding. The demo's recipe is what is compared, not the loss alone.

TRL is a bench extra (`make bench-trl`, or `pip install -e '.[bench]'`), never a runtime
dependency; this file imports it only when the TRL side runs. Writes vs_trl.json (every point),
vs_trl.png (both curves with 95% bands) and each side's run folder under --out."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from bench.common import (
    GenerationHeldDuringEvaluation,
    machine,
    print_table,
    quiet_transformers,
    save_figure,
)
from decentrl.config import RunConfig, parse_config
from decentrl.coordinator.local_backend import local_run
from decentrl.coordinator.loop import StopTraining, TrainingLoop
from decentrl.coordinator.scheduler import PromptScheduler
from decentrl.demo import demo_config
from decentrl.device import compute_dtype, pick_device
from decentrl.evaluate.runner import EvalResult, evaluate
from decentrl.evaluate.stats import Accuracy
from decentrl.learn.stage_loss import loss_config_from
from decentrl.model.loading import load_model
from decentrl.model.stages import StagePlan, build_stages
from decentrl.observe.metrics import StepRecord, read_metrics
from decentrl.rollout.chain import LocalChain
from decentrl.tasks import make_task

TRL_VERSION = "1.16.0"  # the `bench` extra's pin in pyproject.toml
CHECKPOINT_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
SIDES = ("decentrl", "trl")


class EvalPoint(NamedTuple):  # not a dataclass: `decentrl bench` loads benches outside sys.modules
    seconds: float  # training wall-clock when evaluated, evaluations excluded
    step: int  # optimizer steps done
    pass1: float
    low: float  # 95% CI
    high: float
    label: str  # before / during / after


def at_checkpoints(points: list[EvalPoint], checkpoints: list[float]) -> list[EvalPoint | None]:
    """For each checkpoint time, the last evaluation at or before it (None if none was)."""
    ordered = sorted(points, key=lambda p: (p.seconds, p.step))
    chosen: list[EvalPoint | None] = []
    for limit in checkpoints:
        earlier = [p for p in ordered if p.seconds <= limit]
        chosen.append(earlier[-1] if earlier else None)
    return chosen


class TrainingClock:
    """Wall-clock seconds from `start` to `stop`, less the time spent inside `paused()` between
    them. `paused_s` counts every pause, before `start` too (it is the evaluation time)."""

    def __init__(self) -> None:
        self.started: float | None = None
        self.stopped_at: float | None = None
        self.paused_s = 0.0
        self.paused_before_start = 0.0
        self.paused_since: float | None = None

    def start(self) -> None:
        self.started = time.perf_counter()
        self.paused_before_start = self.paused_s

    def stop(self) -> None:
        """Training is over: what follows (joining threads, tearing down) is not counted."""
        self.stopped_at = self.seconds()

    def seconds(self) -> float:
        if self.started is None:
            return 0.0
        if self.stopped_at is not None:
            return self.stopped_at
        now = self.paused_since if self.paused_since is not None else time.perf_counter()
        return now - self.started - (self.paused_s - self.paused_before_start)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self.paused_since = time.perf_counter()
        try:
            yield
        finally:
            self.paused_s += time.perf_counter() - self.paused_since
            self.paused_since = None


class StepBudget:
    """The budget rule both sides follow: start a step only if, taking as long as the previous
    one, it would end within the budget."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.clock = TrainingClock()
        self.previous_end = 0.0
        self.last_step_s = 0.0
        self.steps: list[dict[str, float]] = []  # {"step", "seconds"} at each step's end

    def step_done(self, step: int) -> None:
        now = self.clock.seconds()
        self.last_step_s, self.previous_end = now - self.previous_end, now
        self.steps.append({"step": step, "seconds": round(now, 3)})

    def room_for_another(self) -> bool:
        """False stops the clock: the caller stops training."""
        if self.clock.seconds() + self.last_step_s <= self.budget_s:
            return True
        self.clock.stop()
        return False


def point(result: EvalResult, seconds: float, step: int, label: str) -> EvalPoint:
    """Greedy pass@1 on both sides: decentrl's own evaluation samples its pass@1 at the rollout's
    temperature (training-shaped) and reports the greedy one beside it (eval.greedy)."""
    greedy = result.pass1 if result.greedy_pass1 is None else result.greedy_pass1
    return EvalPoint(round(seconds, 3), step, greedy.mean, greedy.low, greedy.high, label)


def bench_config(model: str, eval_every: int, eval_problems: int, out: Path,
                 threads: int | None = None) -> RunConfig:
    """The demo's config, evaluated with greedy pass@1 only; the budget is enforced here."""
    data = demo_config("sums")
    data.update(name="decentrl", model=model)
    data["host"].update(run_dir=str(out), threads=threads or 0)
    data["train"].update(time_budget_s=None, checkpoint_every=data["train"]["steps"])
    data["eval"].update(problems=eval_problems, pass_k=1, every=eval_every)
    return parse_config(data)


# ---- decentrl ------------------------------------------------------------------------------


class BudgetHooks(GenerationHeldDuringEvaluation):
    """The bench's clock and stopping rule on the training loop: an evaluation pauses the clock
    and holds new generation (the generation loop finishes the batch it is on and then waits, so
    an evaluation hides at most the rest of one batch); training stops when the budget leaves no
    room for another step, and the loop's final evaluation then measures the last weights."""

    def __init__(self, budget_s: float) -> None:
        super().__init__()
        self.budget = StepBudget(budget_s)
        self.points: list[EvalPoint] = []
        self.pause: contextlib.ExitStack | None = None

    def before_evaluation(self, loop: TrainingLoop, label: str) -> None:
        super().before_evaluation(loop, label)
        self.pause = contextlib.ExitStack()
        self.pause.enter_context(self.budget.clock.paused())

    def after_evaluation(self, loop: TrainingLoop, label: str, result: EvalResult) -> None:
        if self.pause is not None:
            self.pause.close()
        super().after_evaluation(loop, label, result)
        self.points.append(point(result, self.budget.clock.seconds(), loop.step, label))

    def training_started(self, loop: TrainingLoop) -> None:
        self.budget.clock.start()

    def before_step(self, loop: TrainingLoop) -> None:
        if self.budget.steps and not self.budget.room_for_another():
            raise StopTraining(f"the {self.budget.budget_s:.0f}s budget has no room for another "
                               "step")

    def after_step(self, loop: TrainingLoop, record: StepRecord) -> None:
        self.budget.step_done(loop.step)
        if loop.step >= loop.config.train.steps:
            self.budget.clock.stop()


def run_decentrl(config: RunConfig, budget_s: float) -> dict[str, Any]:
    if config.path.exists():
        shutil.rmtree(config.path)  # the loop would resume from an old checkpoint
    threads = torch.get_num_threads()  # an async run splits the cores between its threads
    hooks = BudgetHooks(budget_s)
    run = local_run(config, hooks=[hooks])
    try:
        run.run()
    finally:
        run.close()
        torch.set_num_threads(threads)
    rewards = {r.step: r.reward for r in read_metrics(config.path / "metrics.jsonl").steps}
    steps = [{**s, "reward": rewards.get(int(s["step"]))} for s in hooks.budget.steps]
    return side_result(hooks.points, steps, hooks.budget.clock.paused_s)


def side_result(points: list[EvalPoint], steps: list[dict[str, Any]], eval_s: float
                ) -> dict[str, Any]:
    training_s = steps[-1]["seconds"] if steps else 0.0
    return {"points": [p._asdict() for p in points], "steps": steps,
            "training_s": training_s, "eval_s": round(eval_s, 3),
            "s_per_step": training_s / len(steps) if steps else None}


# ---- TRL -----------------------------------------------------------------------------------


def import_trl() -> None:
    try:
        import trl
    except ImportError:
        raise SystemExit("the vs-trl bench needs TRL, a bench extra: run `make bench-trl`, or "
                         "`.venv/bin/pip install -e '.[bench]'` (or --skip-trl)") from None
    if trl.__version__ != TRL_VERSION:
        print(f"warning: this bench was written against trl {TRL_VERSION}; "
              f"trl {trl.__version__} is installed")


def trl_arguments(config: RunConfig, dtype: torch.dtype, use_cpu: bool,
                  out: Path) -> dict[str, Any]:
    """GRPOConfig's arguments for the recipe in `config`: the same batch, minibatches, epochs,
    sampling, optimizer, loss, clip and adaptive entropy bonus as decentrl's side."""
    rollout, train = config.rollout, config.train
    completions_per_step = rollout.prompts_per_step * rollout.group_size
    micro_batches = completions_per_step // train.micro_batch_size
    if completions_per_step % train.micro_batch_size \
            or micro_batches % train.minibatches_per_batch:
        raise ValueError(f"{completions_per_step} completions per step do not split into "
                         f"{train.minibatches_per_batch} minibatches of micro-batches of "
                         f"{train.micro_batch_size}")
    entropy = train.entropy
    if entropy.method != "none":
        print(f"TRL has no {entropy.method}: its side trains without it", flush=True)
    # TRL's adaptive entropy control is the same rule as decentrl's (Skywork-OR1's): from 0, the
    # coefficient moves by a step per optimizer step, up while the entropy is below the target,
    # down otherwise, and is applied only below it.
    adaptive = {} if entropy.target is None else {
        "use_adaptive_entropy": True, "entropy_coef": 0.0, "entropy_target": entropy.target,
        "entropy_coef_delta": entropy.coef_step, "entropy_coef_max": entropy.max_coef}
    # TRL 1.16 counts per_device_train_batch_size in completions, not prompts. A generation batch
    # of per_device * steps_per_generation completions (decentrl's batch) is reused for
    # num_iterations passes (decentrl's epochs), an optimizer step every
    # gradient_accumulation_steps micro-batches (decentrl's minibatches).
    return dict(
        output_dir=str(out / "trl"), report_to="none", save_strategy="no", logging_steps=1,
        disable_tqdm=True, seed=config.seed, use_cpu=use_cpu,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        activation_checkpointing=False,
        per_device_train_batch_size=train.micro_batch_size,
        gradient_accumulation_steps=micro_batches // train.minibatches_per_batch,
        steps_per_generation=micro_batches, num_iterations=train.epochs_per_batch,
        num_generations=rollout.group_size, max_completion_length=rollout.max_new_tokens,
        temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
        shuffle_dataset=False, max_steps=train.steps * train.optimizer_steps_per_batch,
        learning_rate=train.lr, lr_scheduler_type="constant_with_warmup",
        warmup_steps=train.lr_warmup_steps, adam_beta1=train.betas[0],
        adam_beta2=train.betas[1], weight_decay=train.weight_decay,
        max_grad_norm=train.max_grad_norm or 0.0,
        loss_type=train.loss, beta=train.kl_coef, epsilon=train.clip_low,
        epsilon_high=loss_config_from(train, rollout.max_new_tokens).upper_clip,
        scale_rewards="group" if train.scale_advantages_by_std else "none", **adaptive,
    )


def run_trl(config: RunConfig, budget_s: float, out: Path) -> dict[str, Any]:
    import_trl()
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    # transformers' v6 renames, which TRL still uses; nothing we can act on.
    warnings.filterwarnings("ignore", message=".*deprecated and will be removed in v6",
                            category=FutureWarning)

    torch.manual_seed(config.seed)
    loaded = load_model(config.model)
    device = pick_device(config.host.device)
    dtype = compute_dtype(device, config.host.dtype)
    task = make_task(config.task.name, **config.task.options)
    eval_task = make_task(config.eval.task.name, **config.eval.task.options)
    rollout, train, ev = config.rollout, config.train, config.eval

    # decentrl's scheduler order: the same problems, in the same order, 8 prompts a step.
    indices = PromptScheduler(config.seed).next(train.steps * rollout.prompts_per_step)
    problems = {i: task.problem("train", i) for i in indices}
    dataset = Dataset.from_dict({"prompt": [task.messages(problems[i]) for i in indices],
                                 "problem_index": indices})

    def sums_reward(completions: list[list[dict[str, str]]], problem_index: list[int],
                    **_: Any) -> list[float]:
        return [task.reward(problems[i], c[0]["content"]).total
                for c, i in zip(completions, problem_index)]

    args = GRPOConfig(**trl_arguments(config, dtype, device.type == "cpu", out))
    plan = StagePlan.even(loaded.spec.num_layers, config.num_stages)
    eval_chain = LocalChain(build_stages(loaded.spec, plan, loaded.tensors, device, dtype))
    budget = StepBudget(budget_s)
    points: list[EvalPoint] = []
    rewards: dict[int, float] = {}

    def held_out(model: Any, step: int, label: str) -> None:
        with budget.clock.paused():
            state = model.state_dict()
            for stage in eval_chain.stages:
                stage.load_hf_state_dict(state)
            result = evaluate(eval_chain, eval_task, loaded.tokenizer, ev.problems,
                              ev.max_new_tokens, ev.batch_size, pass_k=1, seed=config.seed)
        points.append(point(result, budget.clock.seconds(), step, label))
        print(f"trl eval ({label}) step {step}: pass@1 {result.pass1.as_percent()}  "
              f"t={budget.clock.seconds():.0f}s", flush=True)

    class HeldOutEval(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            held_out(kwargs["model"], 0, "before")
            budget.clock.start()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            # decentrl counts steps in batches; TRL in optimizer steps, several a batch here.
            if state.global_step % train.optimizer_steps_per_batch:
                return
            batches = state.global_step // train.optimizer_steps_per_batch
            budget.step_done(batches)
            if not budget.room_for_another():
                control.should_training_stop = True
            elif ev.every and batches % ev.every == 0:
                held_out(kwargs["model"], batches, "during")

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            budget.clock.stop()
            held_out(kwargs["model"], state.global_step // train.optimizer_steps_per_batch,
                     "after")

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
                   **kwargs: Any) -> None:
            if logs and "reward" in logs:
                batch = -(-state.global_step // train.optimizer_steps_per_batch)
                rewards[batch] = logs["reward"]
                print(f"trl step {batch:4d}  reward {logs['reward']:.3f}  "
                      f"t={budget.clock.seconds():.0f}s", flush=True)

    model = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=sums_reward, args=args, train_dataset=dataset,
                          processing_class=loaded.tokenizer, callbacks=[HeldOutEval()])
    trainer.remove_callback(PrinterCallback)  # HeldOutEval prints a line per step instead
    trainer.train()
    steps = [{**s, "reward": rewards.get(int(s["step"]))} for s in budget.steps]
    del trainer, model
    gc.collect()
    return side_result(points, steps, budget.clock.paused_s)


# ---- report --------------------------------------------------------------------------------


def as_points(side: dict[str, Any] | None) -> list[EvalPoint]:
    return [EvalPoint(**p) for p in side["points"]] if side else []


def describe(p: EvalPoint | None) -> str:
    if p is None:
        return "-"
    return (f"{Accuracy(p.pass1, p.low, p.high, 0).as_percent()} "
            f"(step {p.step}, {p.seconds:.0f}s)")


def report(results: dict[str, Any], out: Path) -> None:
    budget_s = results["budget_s"]
    checkpoints = [budget_s * f for f in CHECKPOINT_FRACTIONS]
    chosen = {side: at_checkpoints(as_points(results.get(side)), checkpoints) for side in SIDES}
    rows = [[f"{f:.0%} ({t:.0f}s)", *(describe(chosen[side][i]) for side in SIDES)]
            for i, (f, t) in enumerate(zip(CHECKPOINT_FRACTIONS, checkpoints))]
    # A side stops when its next step would likely overrun the budget; a slower last step can
    # still end a little past it, so the final weights get a row of their own.
    last = {side: at_checkpoints(as_points(results.get(side)), [float("inf")])[0] for side in SIDES}
    rows.append(["end of training", *(describe(last[side]) for side in SIDES)])
    print_table(f"held-out pass@1 (greedy, {results['eval_problems']} problems, 95% CI): "
                "the last evaluation at or before each point of the budget",
                ["budget", *SIDES], rows)
    summary, machines = [], set()
    for side in SIDES:
        data = results.get(side)
        if data:
            per_step = data["s_per_step"]
            summary.append([side, len(data["steps"]), f"{data['training_s']:.0f}",
                            "-" if per_step is None else f"{per_step:.2f}",
                            f"{data['eval_s']:.0f}"])
            machines.add(data["machine"])
    print_table("training time", ["side", "steps", "training s", "s/step", "eval s (excluded)"],
                summary, caption="\n".join(sorted(machines)))
    plot(results, out / "vs_trl.png")
    print(f"results: {out / 'vs_trl.json'}  plot: {out / 'vs_trl.png'}")


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for side, color in zip(SIDES, ("tab:blue", "tab:orange")):
        points = sorted(as_points(results.get(side)), key=lambda p: p.seconds)
        if not points:
            continue
        seconds = [p.seconds for p in points]
        axes.plot(seconds, [p.pass1 for p in points], "o-", color=color, label=side)
        axes.fill_between(seconds, [p.low for p in points], [p.high for p in points],
                          color=color, alpha=0.2)
    axes.axvline(results["budget_s"], color="gray", linestyle=":", label="budget")
    axes.set_xlabel("training seconds (evaluations excluded)")
    axes.set_ylabel("held-out pass@1 (greedy, 95% CI)")
    axes.set_ylim(0, 1)
    axes.grid(alpha=0.3)
    axes.legend(loc="best")
    axes.set_title("decentrl vs TRL GRPOTrainer: sums, same budget")
    save_figure(figure, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="decentrl bench vs-trl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=float, default=900, help="training seconds per side")
    parser.add_argument("--eval-every", type=int, default=10, help="steps (batches)")
    parser.add_argument("--trl-eval-every", type=int, default=None,
                        help="steps (batches) between TRL's evaluations (default: --eval-every; "
                             "TRL takes several times longer per step)")
    parser.add_argument("--eval-problems", type=int, default=200)
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="smollm2-135m-instruct or a Hugging Face folder")
    parser.add_argument("--out", type=Path, default=Path("runs/vs-trl"))
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads for both sides (default: all cores)")
    parser.add_argument("--skip-trl", action="store_true",
                        help="keep the TRL results of an earlier run in --out")
    parser.add_argument("--skip-decentrl", action="store_true",
                        help="keep the decentrl results of an earlier run in --out")
    args = parser.parse_args(argv)
    if args.trl_eval_every is None:
        args.trl_eval_every = args.eval_every
    if args.budget <= 0 or min(args.eval_every, args.trl_eval_every, args.eval_problems) < 1 \
            or (args.threads is not None and args.threads < 1):
        parser.error("--budget, --eval-every, --trl-eval-every, --eval-problems and --threads "
                     "must be positive")
    if args.skip_trl and args.skip_decentrl:
        parser.error("--skip-trl and --skip-decentrl together leave nothing to run")
    if not args.skip_trl:
        import_trl()  # fail before spending the decentrl side's budget
    quiet_transformers()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "vs_trl.json"
    config = bench_config(args.model, args.eval_every, args.eval_problems, args.out,
                          args.threads)
    device = pick_device(config.host.device)
    setup = {"budget_s": args.budget, "eval_every": args.eval_every,
             "trl_eval_every": args.trl_eval_every,
             "eval_problems": args.eval_problems, "model": args.model, "threads": args.threads,
             "config": config.model_dump(mode="json")}
    results: dict[str, Any] = {**setup, "compute_dtype": str(compute_dtype(device, config.host.dtype))}
    if path.is_file():
        earlier = json.loads(path.read_text())
        kept = [side for side, skipped in zip(SIDES, (args.skip_decentrl, args.skip_trl))
                if skipped and side in earlier]
        differ = [k for k, v in setup.items() if earlier.get(k) != v]
        if kept and differ:
            raise SystemExit(f"{path} was made with another {', '.join(differ)}; "
                             "rerun both sides")
        results.update({side: earlier[side] for side in kept})
    if not args.skip_trl:
        trl_config = config.model_copy(update={"eval": config.eval.model_copy(
            update={"every": args.trl_eval_every})})
        results["trl"] = {**run_trl(trl_config, args.budget, args.out),
                          "machine": machine(device)}
    if not args.skip_decentrl:
        results["decentrl"] = {**run_decentrl(config, args.budget), "machine": machine(device)}
    path.write_text(json.dumps(results, indent=2))
    report(results, args.out)


if __name__ == "__main__":
    main()

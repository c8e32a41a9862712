"""The commands that look at results: eval, export, report, and bench."""

from __future__ import annotations

import ast
import importlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional, cast

import typer

from decentrl.cli.common import command, console, fail

if TYPE_CHECKING:
    from decentrl.release.export import Weights


def parse_options(items: Sequence[str]) -> dict[str, Any]:
    """--option KEY=VALUE items: the value as JSON where it parses, else as a string."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            fail(f"--option {item!r} must look like KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


@command("eval")
def eval_command(
    model: Annotated[str, typer.Option(
        help="An exported Hugging Face folder, or smollm2-135m-instruct for the base model.")],
    base: Annotated[Optional[str], typer.Option(  # noqa: UP007 - typer needs Optional
        help="The model before post-training: adds the changes against it, and the drift "
             "from it (KL divergence, perplexity) on a general prompt set.")] = None,
    task: Annotated[Optional[str], typer.Option(  # noqa: UP007
        help="Evaluate this task family only, such as sums, rg:chain_sum or an environment "
             "such as agentic-calculator. Without it: the suite of two-digit sums and sums of "
             "three terms and of three digits.")] = None,
    option: Annotated[Optional[list[str]], typer.Option(  # noqa: UP007
        help="An option of --task as KEY=VALUE (the value in JSON), repeatable.")] = None,
    problems: Annotated[Optional[int], typer.Option(  # noqa: UP007
        help="Held-out problems per family (default: 100).")] = None,
    pass_k: Annotated[int, typer.Option(
        help="The k of the sampled pass@k; 1 evaluates greedily only.")] = 4,
    max_new_tokens: Annotated[Optional[int], typer.Option(  # noqa: UP007
        help="The completion budget per problem (default: each family's own).")] = None,
    batch_size: Annotated[int, typer.Option(help="Problems generated at once.")] = 64,
    num_stages: Annotated[int, typer.Option(
        help="Stages to cut the model into (the same answers; for testing the chain).")] = 1,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or mps.")] = "auto",
    dtype: Annotated[str, typer.Option(help="auto, fp32, bf16 or fp16.")] = "auto",
    seed: Annotated[int, typer.Option(help="The seed of the sampled completions.")] = 0,
    output: Annotated[Optional[Path], typer.Option(  # noqa: UP007
        help="Also write the result as JSON to this file.")] = None,
) -> None:
    """Measure held-out accuracy, before and after post-training.

    Greedy pass@1 and sampled pass@k, with 95% confidence intervals, on several task families;
    with --base, the changes and the drift from the base on general text."""
    from decentrl.demo import run_suite, suite_table
    from decentrl.evaluate.suite import DEFAULT_SUITE, Family, with_overrides

    if option and task is None:
        fail("--option needs --task (the default suite's families carry their own options)")
    if output is not None and not output.parent.is_dir():
        fail(f"--output {output}: folder {output.parent} does not exist")
    families = DEFAULT_SUITE if task is None else [Family(task, parse_options(option or []))]
    result = run_suite(console, model, base, with_overrides(families, problems, max_new_tokens),
                       pass_k=pass_k, batch_size=batch_size, num_stages=num_stages,
                       device=device, dtype=dtype, seed=seed)
    console.print(suite_table(result))
    console.print(f"evaluated in {result.seconds:.0f}s")
    if output is not None:
        output.write_text(json.dumps(result.to_json(), indent=2))
        console.print(f"wrote {output}")


@command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="A run folder, such as runs/demo.")],
    out_dir: Annotated[Path, typer.Argument(
        help="A new or empty folder for the Hugging Face model.")],
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16.")] = "float32",
    weights: Annotated[str, typer.Option(
        help="served: the weights the swarm's replicas served (they generated the rollouts and "
             "answered the evaluations); learner: the training peers' own (they differ with "
             "sparse updates).")] = "served",
    force: Annotated[bool, typer.Option(
        "--force",
        help="Replace an earlier export at OUT_DIR. Other files, a run folder or the run "
             "itself are never replaced.")] = False,
) -> None:
    """Export a run's model as a Hugging Face folder.

    Assembles the run's latest checkpoint (every stage's shard) into a folder that
    transformers.AutoModelForCausalLM loads, with a model card and checksums. Nothing is
    deleted, unless --force replaces an earlier export that nobody has added files to."""
    from decentrl.release.export import EXPORT_DTYPES, WEIGHTS, export_run

    chosen = {name: dtype_ for dtype_, name in EXPORT_DTYPES.items()}.get(dtype)
    if chosen is None:
        fail(f"--dtype must be one of {', '.join(EXPORT_DTYPES.values())}, got {dtype!r}")
        return
    if weights not in WEIGHTS:
        fail(f"--weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    folder = export_run(run_dir, out_dir, chosen, cast("Weights", weights), force=force)
    console.print(f"exported {run_dir} to {folder}")


@command()
def report(run_dir: Annotated[Path, typer.Argument(
        help="A run folder, such as runs/demo.")]) -> None:
    """Write a run's report: RUN_DIR/report/report.md with PNG plots.

    The report shows the evaluations before and after, the learning signals, staleness,
    throughput, the swarm's peers and traffic, and the verification events; the command prints
    its path."""
    from decentrl.observe.report import build_report

    typer.echo(build_report(run_dir))  # plain: a script may read the path


# The bench package lives in the source checkout's root, beside src/, and ships in no wheel.
CHECKOUT_DIR = Path(__file__).resolve().parents[3]
BENCH_DIR = CHECKOUT_DIR / "bench"


def benchmarks() -> dict[str, str]:
    """Each benchmark of the source checkout by name, with its docstring's summary line (read
    from the file, so listing them imports none)."""
    found = {}
    for path in sorted(BENCH_DIR.glob("*.py")):
        if path.stem in ("__init__", "common"):
            continue
        docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
        found[path.stem.replace("_", "-")] = docstring.partition("\n")[0]
    return found


def bench_help() -> str:
    if not BENCH_DIR.is_dir():
        return "Run a benchmark of the source checkout (not found here)."
    listing = "\n".join(f"- {name}: {summary}" for name, summary in benchmarks().items())
    return ("Run a benchmark of the source checkout; extra arguments go to it (decentrl bench "
            f"NAME -- --help lists them).\n\nThe benchmarks:\n\n\b\n{listing}")


@command(help=bench_help(),
         context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench(ctx: typer.Context, name: Annotated[str, typer.Argument(
        help="The benchmark, as listed below.")]) -> None:
    if not BENCH_DIR.is_dir():
        fail(f"benchmarks live in the source checkout ({BENCH_DIR} is missing)")
    available = benchmarks()
    if name not in available:
        fail(f"unknown benchmark {name!r}; available: {', '.join(available)} "
             "(decentrl bench --help says what each measures)")
    # The console script's folder heads sys.path, not the checkout's root: put the root there
    # so that `bench` is this checkout's package, as under `python -m bench.NAME` from the root.
    if str(CHECKOUT_DIR) not in sys.path:
        sys.path.insert(0, str(CHECKOUT_DIR))
    module = importlib.import_module(f"bench.{name.replace('-', '_')}")
    module.main(list(ctx.args))

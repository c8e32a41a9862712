"""The per-run report: `report/report.md` with PNG plots beside it, built afterwards from what a
run folder holds (config.json, metrics.jsonl, the evaluations, run.sqlite, the exported model).

Every section degrades to one line when its data is missing (an older run, a local run without a
swarm). Peer names, verification details and model completions are untrusted text: the report
escapes them before they reach Markdown, and keeps math parsing off where they reach a plot."""

from __future__ import annotations

import json
import math
import sqlite3
from collections import Counter
from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from decentrl.config import RunConfig, load_config
from decentrl.evaluate.runner import (
    SAMPLED_INTERVALS_NOTE,
    EvalResult,
    episode_rows,
    has_sampled_rows,
    pass1_label,
)
from decentrl.evaluate.suite import (
    SuiteResult,
    accuracy_row,
    level_rows,
    mean_change,
    pass1_change,
    suite_table_markdown,
)
from decentrl.net.text import peer_text
from decentrl.observe.metrics import (
    PeerSnapshot,
    RunRecords,
    StepRecord,
    SwarmRecord,
    TrustRecord,
    read_metrics,
)

ROLES = ("inference", "training", "both")
OUTCOMES = ("passed", "failed", "proved", "flagged", "malformed")
# The total a trust counter counts from: groups accepted or trained, or peers seen in the swarm.
Total = Literal["accepted", "trained", "peers"]
# What each cumulative counter of trust/gate.py counts, and of which total.
TRUST_COUNTERS: dict[str, tuple[str, Total | None]] = {
    "verified": ("groups whose spot-check passed", "accepted"),
    "verify_failed": ("groups whose spot-check caught a lie (confirmed by a second verifier)",
                      "accepted"),
    "verify_unconfirmed": ("groups dropped on a failed check nobody confirmed (no charge)",
                           "accepted"),
    "verify_opinions": ("re-executions run (a failure, and some passes, get a second opinion; "
                        "a disagreement a third)", "accepted"),
    "verifiers_overruled": ("verifiers charged for an opinion the tribunal rejected", None),
    "verify_no_established": ("checks only verifiers on probation could weigh: skipped, or the "
                              "group dropped, nobody charged", "accepted"),
    "probation_sessions_withheld": ("sessions a replica on probation was drawn for but its "
                                    "stage's probation budget was spent", None),
    "probation_address_limited": ("replicas on probation passed over: past their address's "
                                  "limit (trust.probation_per_address)", None),
    "replicas_not_admitted": ("replicas passed over: not admitted (trust.admit_replicas)", None),
    "verify_skipped": ("spot-checks skipped (backlog full, no other replica to redo the work, "
                       "only newcomers to judge it, or the re-execution failed)", "accepted"),
    "flagged": ("groups with rows the trainer's log-probs flagged (left out of the loss, then "
                "re-checked)", "trained"),
    "banned": ("bans (a peer banned again counts again)", "peers"),
}
# Reward and accuracy closer than this at every step are one series (no format bonus).
SAME_SERIES_TOLERANCE = 1e-6
# Steps per throughput point: one step's interval is noisy (a batch can wait on a slow replica).
THROUGHPUT_WINDOW = 5
SUMMARY_STEPS = 5  # the training table compares the means of the first and the last few steps
EVENTS_LISTED = 50  # non-"passed" verification events in the table; a flood would drown it
DETAIL_CHARS = 160
PLOT_LABEL_CHARS = 24
BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
FIGURE_SIZE = (8.0, 4.0)
DPI = 120
# CommonMark lets a backslash escape any of these; together they rule out tables broken by `|`,
# links, emphasis, code spans, raw HTML and (on GitHub) math.
MARKDOWN_SPECIALS = set("\\`*_[]<>|~&#!$")
PLOT_NAMES = ("reward_accuracy.png", "staleness.png", "throughput.png", "loss.png",
              "grad_norm.png", "kl.png", "entropy.png", "importance_weights.png", "fidelity.png",
              "step_time.png", "bytes_per_peer.png", "peers.png", "verification.png")


# ---------------------------------------------------------------------------------- records

def read_evaluation(path: Path) -> EvalResult | None:
    """eval_before.json or eval_after.json; None when the run has none."""
    if not path.is_file():
        return None
    try:
        return msgspec.json.decode(path.read_bytes(), type=EvalResult)
    except msgspec.DecodeError as error:
        raise ValueError(f"{path}: not an evaluation result: {error}") from None


# ------------------------------------------------------------------------------ derived data


def staleness_counts(steps: Sequence[StepRecord], store: Path) -> dict[int, int]:
    """Groups trained per staleness (in versions). From the step records; runs from before they
    carried the counts fall back on the run store's trained groups."""
    if any(r.staleness_counts is None for r in steps) and store.is_file():
        return stored_staleness_counts(store)
    total: Counter[int] = Counter()
    for record in steps:
        total.update(record.staleness_counts or {})
    return dict(sorted(total.items()))


def query_store(store: Path, sql: str) -> list[tuple[Any, ...]]:
    """Rows of a query on the run store; none when there is no store we can read (the sections
    then say so)."""
    if not store.is_file():
        return []
    # Read-only: the report must never change a run's durable state.
    try:
        # closing(): a connection's own context manager ends a transaction, not the connection.
        with closing(sqlite3.connect(f"{store.resolve().as_uri()}?mode=ro", uri=True)) as db:
            return db.execute(sql).fetchall()
    except sqlite3.Error:
        return []


def stored_staleness_counts(store: Path) -> dict[int, int]:
    rows = query_store(store, "SELECT staleness, COUNT(*) FROM groups WHERE state = 'trained' "
                              "GROUP BY staleness ORDER BY staleness")
    return {int(staleness): int(count) for staleness, count in rows}


@dataclass(frozen=True)
class GroupTotals:
    """Accepted rollout groups by what became of them. Without a run store only the trained ones
    are known (from the step records), so `pending` and `dropped` are None."""

    trained: int
    pending: int | None = None
    dropped: int | None = None

    @property
    def accepted(self) -> int | None:
        if self.pending is None or self.dropped is None:
            return None
        return self.trained + self.pending + self.dropped


def group_totals(steps: Sequence[StepRecord], store: Path) -> GroupTotals:
    states = {str(state): int(count) for state, count in
              query_store(store, "SELECT state, COUNT(*) FROM groups GROUP BY state")}
    if not states:
        return GroupTotals(trained=round(sum(r.groups for r in steps)))
    return GroupTotals(states.get("trained", 0), states.get("pending", 0),
                       states.get("dropped", 0))


def peers_seen(snapshots: Sequence[SwarmRecord]) -> int:
    return len({p.peer_id for s in snapshots for p in s.peers})


def reward_accuracy_series(steps: Sequence[StepRecord]) -> list[tuple[str, list[float]]]:
    """(label, values) of each line to draw: one when reward and accuracy are the same series
    (a task without a format bonus rewards exactly the solved rollouts), else both."""
    rewards, accuracies = [r.reward for r in steps], [r.accuracy for r in steps]
    if all(math.isclose(r, a, rel_tol=0.0, abs_tol=SAME_SERIES_TOLERANCE)
           for r, a in zip(rewards, accuracies)):
        return [("reward = accuracy", rewards)]
    return [("reward", rewards), ("accuracy", accuracies)]


def generated_tokens(record: StepRecord, group_size: int) -> float:
    """Completion tokens of the step's batch; older records only have the mean per rollout."""
    if record.generated_tokens is not None:
        return record.generated_tokens
    return record.completion_tokens_mean * record.groups * group_size


@dataclass(frozen=True)
class ThroughputPoint:
    elapsed_s: float
    tokens_per_s: float
    steps_per_min: float


def throughput(steps: Sequence[StepRecord], group_size: int) -> list[ThroughputPoint]:
    """Generated tokens per second and steps per minute over the last THROUGHPUT_WINDOW steps,
    at each step. The first step has no interval before it (the run started with an evaluation),
    so the series starts at the second."""
    points = []
    for index in range(1, len(steps)):
        start = max(0, index - THROUGHPUT_WINDOW)
        seconds = steps[index].elapsed_s - steps[start].elapsed_s
        if seconds <= 0:
            continue  # a resumed run restarts its clock
        tokens = sum(generated_tokens(r, group_size) for r in steps[start + 1:index + 1])
        points.append(ThroughputPoint(steps[index].elapsed_s, tokens / seconds,
                                      60 * (index - start) / seconds))
    return points


def mean_of(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


# ----------------------------------------------------------------------------- text helpers


def markdown_text(text: str, limit: int = DETAIL_CHARS) -> str:
    """Untrusted text as one line of inert Markdown: whitespace runs as one space, other control
    characters escaped and the text cut as net/text.py does (at most `limit` characters and a
    marker, before the Markdown escapes, so that none is cut in half)."""
    inert = peer_text(" ".join(text.split()), limit)
    return "".join(f"\\{c}" if c in MARKDOWN_SPECIALS else c for c in inert)


def plot_label(text: str) -> str:
    return peer_text(" ".join(text.split()), PLOT_LABEL_CHARS)


def byte_unit(count: float) -> tuple[int, str]:
    """(bytes per unit, its name): the largest binary unit not above `count`."""
    power = 0
    while power < len(BYTE_UNITS) - 1 and abs(count) >= 1024 ** (power + 1):
        power += 1
    return 1024 ** power, BYTE_UNITS[power]


def human_bytes(count: float) -> str:
    scale, unit = byte_unit(count)
    return f"{count:.0f} B" if scale == 1 else f"{count / scale:.1f} {unit}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def peer_name(name: str, peer_id: str) -> str:
    return name or peer_id[-8:]


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def duration(seconds: float) -> str:
    # A short run's seconds would all round to "0.0 min".
    return f"{seconds:.1f} s" if seconds < 120 else minutes(seconds)


def number(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def image(path: Path, alt: str) -> str:
    return f"![{alt}]({path.name})"


# ------------------------------------------------------------------------ before/after table


def held_out_table(before: EvalResult | None, after: EvalResult | None) -> str:
    """pass@1 and pass@k of the run's own held-out evaluation, before and after training."""
    shown = after or before
    if shown is None:
        return "No held-out evaluation was recorded for this run."
    rows = [accuracy_row(pass1_label(shown), before.pass1 if before else None,
                         after.pass1 if after else None, pass1_change)]
    if shown.greedy_pass1 is not None:
        rows.append(accuracy_row("pass@1 (greedy)", before.greedy_pass1 if before else None,
                                 after.greedy_pass1 if after else None, pass1_change))
    if shown.pass_k is not None:
        rows.append(accuracy_row(f"pass@{shown.k} (sampled, T=1)",
                                 before.pass_k if before else None,
                                 after.pass_k if after else None, mean_change))
    rows.append(["mean completion tokens",
                 *(number(r.mean_completion_tokens, 1) if r else "-" for r in (before, after)),
                 "-"])
    rows += [[*row, "-"] for row in episode_rows(before, after)]
    note = f"; {SAMPLED_INTERVALS_NOTE}" if has_sampled_rows(shown) else ""
    text = (f"Held-out `{shown.task}`, {shown.problems} problems, 95% confidence intervals "
            f"(change: after - before{note}).\n\n"
            + table(["", "before", "after", "change"], rows))
    levels = [[markdown_text(level), *cells] for level, *cells in level_rows(before, after)]
    if levels:
        text += ("\n\nPer difficulty level (turns and tool calls per episode; the share of "
                 "episodes whose tool results reached each step of the ideal chain):\n\n"
                 + table(["level", "", "before", "after", "change"], levels))
    return text


def evaluation_section(run_dir: Path, before: EvalResult | None,
                       after: EvalResult | None) -> str:
    # The suite (the base against the exported model, on several task families, and the drift
    # on general text) comes first; the run's own evaluation through the swarm follows.
    suite = run_dir / "evaluation.json"
    own = held_out_table(before, after)
    if not suite.is_file():
        return "## Before and after\n\n" + own
    try:
        result = SuiteResult.from_json(json.loads(suite.read_text()))
    except (json.JSONDecodeError, KeyError, TypeError, msgspec.ValidationError) as error:
        raise ValueError(f"{suite}: not an evaluation suite result: {error!r}") from None
    base = markdown_text(result.base or "")
    note = f" ({SAMPLED_INTERVALS_NOTE})" if result.pass_k > 1 else ""
    return (f"## Before and after\n\nThe exported model against `{base}`, held-out problems, "
            f"95% confidence intervals{note}:\n\n{suite_table_markdown(result)}"
            f"\nThe run's own evaluation, through the swarm's replicas.\n\n{own}")


# ------------------------------------------------------------------------------------- plots

OUTCOME_COLORS = {"passed": "tab:green", "failed": "tab:red", "proved": "darkred",
                  "flagged": "tab:orange", "malformed": "tab:purple"}
ROLE_COLORS = {"inference": "tab:blue", "training": "tab:orange", "both": "tab:green",
               "banned": "tab:red"}


def new_figure(rows: int = 1, height: float = FIGURE_SIZE[1]) -> tuple[Figure, list[Any]]:
    # A Figure made without pyplot is registered nowhere: nothing to close, no global backend.
    figure = Figure(figsize=(FIGURE_SIZE[0], height), layout="constrained")
    axes = list(figure.subplots(rows, 1, sharex=True, squeeze=False)[:, 0])
    for ax in axes:
        ax.grid(alpha=0.3)
    return figure, axes


def error_bars(points: Sequence[tuple[float, float, float]]) -> list[list[float]]:
    """matplotlib's yerr of (mean, low, high) points: never negative, though an interval's
    bound computed in floating point may sit a rounding error inside its mean (Wilson at 100%)."""
    return [[max(0.0, mean - low) for mean, low, _ in points],
            [max(0.0, high - mean) for mean, _, high in points]]


def plot_reward_accuracy(records: RunRecords, path: Path) -> None:
    figure, (ax,) = new_figure()
    elapsed = [r.elapsed_s / 60 for r in records.steps]
    lines = reward_accuracy_series(records.steps)
    for label, values in lines:
        ax.plot(elapsed, values, label=f"{label} (training batch)")
    if records.evals:
        ax.errorbar([e.elapsed_s / 60 for e in records.evals], [e.pass1 for e in records.evals],
                    yerr=error_bars([(e.pass1, e.pass1_low, e.pass1_high)
                                     for e in records.evals]),
                    fmt="o", color="black", capsize=4, label="held-out pass@1 (95% CI)")
        for record in records.evals:
            ax.annotate(plot_label(record.label), (record.elapsed_s / 60, record.pass1),
                        textcoords="offset points", xytext=(6, 6), parse_math=False)
    greedy = [(e.elapsed_s / 60, e.greedy_pass1, e.greedy_pass1_low, e.greedy_pass1_high)
              for e in records.evals if e.greedy_pass1 is not None
              and e.greedy_pass1_low is not None and e.greedy_pass1_high is not None]
    if greedy:
        ax.errorbar([at for at, *_ in greedy], [mean for _, mean, _, _ in greedy],
                    yerr=error_bars([(mean, low, high) for _, mean, low, high in greedy]),
                    fmt="s", color="tab:purple", capsize=4,
                    label="held-out greedy pass@1 (95% CI)")
    ax.set_ylim(bottom=min(0.0, ax.get_ylim()[0]))
    ax.set_xlim(left=0)
    title = "Reward = accuracy" if len(lines) == 1 else "Reward and accuracy"
    ax.set(xlabel="elapsed (minutes)", ylabel="mean per rollout", title=title)
    ax.legend(loc="best")
    figure.savefig(path, dpi=DPI)


def plot_staleness(counts: dict[int, int], path: Path) -> None:
    figure, (ax,) = new_figure()
    bars = ax.bar(list(counts), list(counts.values()), color="tab:blue")
    ax.bar_label(bars)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="staleness (versions behind the learner)", ylabel="groups trained",
           title="Staleness of trained groups")
    figure.savefig(path, dpi=DPI)


def plot_throughput(points: Sequence[ThroughputPoint], path: Path) -> None:
    figure, (tokens_ax, steps_ax) = new_figure(rows=2, height=5.5)
    elapsed = [p.elapsed_s / 60 for p in points]
    tokens_ax.plot(elapsed, [p.tokens_per_s for p in points], color="tab:blue")
    tokens_ax.set(ylabel="generated tokens/s",
                  title=f"Throughput (over the last {THROUGHPUT_WINDOW} steps)")
    steps_ax.plot(elapsed, [p.steps_per_min for p in points], color="tab:orange")
    steps_ax.set(xlabel="elapsed (minutes)", ylabel="training steps/min")
    for ax in (tokens_ax, steps_ax):
        ax.set_ylim(bottom=0)
        ax.set_xlim(left=0)
    figure.savefig(path, dpi=DPI)


@dataclass(frozen=True)
class Panel:
    ylabel: str
    lines: tuple[tuple[str, str], ...]  # (StepRecord field, legend label)


@dataclass(frozen=True)
class StepPlot:
    """A figure of trainer metrics against the training step, one panel per axis."""

    name: str
    title: str
    caption: str  # what the plot shows, the sentence under it in report.md
    panels: tuple[Panel, ...]

    def fields(self) -> list[str]:
        return [field for panel in self.panels for field, _ in panel.lines]


NATS = "nats per token"
STEP_PLOTS = (
    StepPlot("loss.png", "Policy loss",
             "The policy loss the optimizer minimised at each step (the surrogate, before any KL "
             "penalty). Its level moves with the batch's advantages, so its trend and noise say "
             "more than its value.",
             (Panel("loss", (("policy_loss", "policy loss"),)),)),
    StepPlot("grad_norm.png", "Gradient norm",
             "The L2 norm of each step's gradient before clipping (the mean over the step's "
             "optimizer updates): a step above `train.max_grad_norm` had its update scaled down "
             "to it.",
             (Panel("L2 norm", (("grad_norm", "gradient norm"),)),)),
    StepPlot("kl.png", "KL divergence",
             "How off-policy each batch was: KL from the behaviour policy (the replicas' weights "
             "that sampled the batch, maybe versions behind) to the learner's policy at the "
             "start of the update, per generated token (k3 estimate); and KL to the reference "
             "model when the loss has a KL penalty.",
             (Panel(NATS, (("behaviour_kl", "KL(behaviour || learner)"),
                           ("kl", "KL(learner || reference)"))),)),
    StepPlot("entropy.png", "Entropy",
             "The entropy of the learner's next-token distribution (after the sampling "
             "transform), per generated token of the batch: a fall towards zero means the model "
             "stopped exploring.",
             (Panel(NATS, (("entropy", "entropy"),)),)),
    StepPlot("importance_weights.png", "Importance weights",
             "The off-policy correction: the mean over the batch's tokens of the importance "
             "weights (learner / behaviour probability, truncated at `train.tis_cap`), the share "
             "of tokens whose weight was truncated, the share of sequences the sequence-level "
             "mask (`train.mis_low`, `train.mis_high`) left out of the loss, and the share of "
             "tokens M2PO's second-moment mask (`train.m2_threshold`) left out.",
             (Panel("mean weight", (("tis_weight_mean", "mean truncated weight"),)),
              Panel("fraction", (("tis_truncated_fraction", "tokens truncated at the cap"),
                                 ("mis_masked_fraction", "sequences masked"),
                                 ("m2_masked_fraction", "tokens masked (M2PO)"))))),
    StepPlot("fidelity.png", "Replica fidelity",
             "How far what the replicas serve is from the learner's weights, apart from "
             "staleness, as the training peers measured it when they published (a swarm run, "
             "every stage together): the share of the learner's movement since the start (L2) "
             "the replicas do not serve yet, and the fraction of weights whose served bf16 value "
             "differs from the learner's.",
             (Panel("fraction", (("served_gap", "movement not yet served"),
                                 ("served_bf16_differing", "bf16 weights served differently"))),)),
)


def logged(steps: Sequence[StepRecord], field: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that logged `field`."""
    found = [(r.step, value) for r in steps if (value := getattr(r, field)) is not None]
    return [step for step, _ in found], [value for _, value in found]


def plot_step_metrics(plot: StepPlot, steps: Sequence[StepRecord], path: Path) -> None:
    figure, axes = new_figure(rows=len(plot.panels), height=1.0 + 2.2 * len(plot.panels))
    for ax, panel in zip(axes, plot.panels):
        drawn = False
        for field, label in panel.lines:
            x, y = logged(steps, field)
            if x:
                ax.plot(x, y, marker="o", markersize=2.5, linewidth=1.2, label=label)
                drawn = True
        if drawn:
            ax.legend(loc="best", fontsize="small")
        else:
            ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center")
        ax.set(ylabel=panel.ylabel)
    axes[0].set_title(plot.title)
    axes[-1].set_xlabel("training step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    figure.savefig(path, dpi=DPI)


def timed_steps(steps: Sequence[StepRecord]) -> list[tuple[int, float, float]]:
    """(step, seconds waiting for rollouts, seconds training) of the records that logged both."""
    return [(r.step, r.wait_s, r.train_s) for r in steps
            if r.wait_s is not None and r.train_s is not None]


def plot_step_time(timed: Sequence[tuple[int, float, float]], path: Path) -> None:
    figure, (ax,) = new_figure(height=3.2)
    numbers = [step for step, _, _ in timed]
    waits = [wait for _, wait, _ in timed]
    ax.bar(numbers, waits, width=0.8, linewidth=0, color="tab:gray",
           label="waiting for rollout groups")
    ax.bar(numbers, [train for _, _, train in timed], width=0.8, bottom=waits, linewidth=0,
           color="tab:blue", label="training")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="training step", ylabel="seconds", title="Where each step's time went")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    figure.savefig(path, dpi=DPI)


def bytes_sent_by_peer(snapshot: SwarmRecord) -> list[tuple[str, float]]:
    """(label, bytes uploaded so far) of every peer in a snapshot, the most first."""
    sent = [(f"{plot_label(peer_name(p.name, p.peer_id))} (stage {p.stage})", float(p.bytes_sent))
            for p in snapshot.peers]
    return sorted(sent, key=lambda item: -item[1])


def plot_bytes_per_peer(snapshot: SwarmRecord, wire_bytes: float | None, path: Path) -> None:
    bars = [(label, sent, "tab:blue") for label, sent in bytes_sent_by_peer(snapshot)]
    if wire_bytes is not None:
        bars.append(("coordinator (sent + received)", wire_bytes, "tab:gray"))
    figure, (ax,) = new_figure(height=max(3.0, 1.2 + 0.35 * len(bars)))
    positions = range(len(bars))
    # One unit for the axis (the largest bar's), so its ticks fall on round numbers.
    scale, unit = byte_unit(max((b[1] for b in bars), default=0.0))
    drawn = ax.barh(positions, [b[1] / scale for b in bars], color=[b[2] for b in bars])
    ax.bar_label(drawn, labels=[human_bytes(b[1]) for b in bars], padding=3)
    # Peer names are chosen by peers: no mathtext, so "$" cannot break or restyle the plot.
    ax.set_yticks(list(positions), labels=[b[0] for b in bars], parse_math=False)
    ax.invert_yaxis()
    ax.margins(x=0.15)
    ax.set(xlabel=unit, title=f"Bytes sent per peer (at {minutes(snapshot.elapsed_s)})")
    figure.savefig(path, dpi=DPI)


def role_counts(snapshot: SwarmRecord, stage: int) -> dict[str, int]:
    """Peers of one stage by role; a banned peer counts as banned whatever its role."""
    found = Counter("banned" if p.banned else p.role for p in snapshot.peers if p.stage == stage)
    return {role: found[role] for role in (*ROLES, "banned")}


def plot_peers(snapshots: Sequence[SwarmRecord], path: Path) -> None:
    stages = sorted({p.stage for s in snapshots for p in s.peers})
    figure, axes = new_figure(rows=len(stages), height=1.2 + 2.0 * len(stages))
    elapsed = [s.elapsed_s / 60 for s in snapshots]
    for ax, stage in zip(axes, stages):
        series = [role_counts(s, stage) for s in snapshots]
        floor = [0] * len(series)
        for role, color in ROLE_COLORS.items():  # stacked: the top edge is the stage's peers
            top = [below + counts[role] for below, counts in zip(floor, series)]
            if top != floor:
                ax.fill_between(elapsed, floor, top, step="post", color=color, alpha=0.75,
                                linewidth=0, label=role)
            floor = top
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(bottom=0)
        ax.set_xlim(left=0)
        ax.set(ylabel="peers", title=f"stage {stage}")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    axes[-1].set_xlabel("elapsed (minutes)")
    figure.suptitle("Peers per stage by role")
    figure.savefig(path, dpi=DPI)


def outcome_order(events: Sequence[TrustRecord]) -> list[str]:
    present = {e.outcome for e in events}
    return [o for o in OUTCOMES if o in present] + sorted(present - set(OUTCOMES))


def plot_verification(events: Sequence[TrustRecord], path: Path) -> None:
    outcomes = outcome_order(events)
    figure, (ax,) = new_figure(height=max(2.5, 1.2 + 0.5 * len(outcomes)))
    times = [[e.elapsed_s / 60 for e in events if e.outcome == o] for o in outcomes]
    ax.eventplot(times, lineoffsets=list(range(len(outcomes))), linelengths=0.7,
                 colors=[OUTCOME_COLORS.get(o, "tab:gray") for o in outcomes])
    ax.set_yticks(range(len(outcomes)),
                  labels=[f"{plot_label(o)} ({len(t)})" for o, t in zip(outcomes, times)],
                  parse_math=False)
    ax.invert_yaxis()
    ax.set_xlim(left=0)
    ax.set(xlabel="elapsed (minutes)",
           title="Verification events by outcome (per peer and stage, not per group)")
    figure.savefig(path, dpi=DPI)


# ---------------------------------------------------------------------------------- sections


def header(config: RunConfig, records: RunRecords) -> str:
    steps = records.steps
    trained = (f"{len(steps)} steps to weight version {steps[-1].version}" if steps
               else "no training steps")
    if records.supervised:
        trained = f"{len(records.supervised)} supervised warm-up steps, then {trained}"
    return (f"# Run report: {config.name}\n\n`{config.model}` post-trained on "
            f"`{config.task.name}` ({config.train.mode}, {config.num_stages} stages): {trained}, "
            f"wall time {minutes(records.wall_s)}.")


def warmup_section(run_dir: Path, records: RunRecords, before: EvalResult | None) -> str:
    """The supervised warm-up: its steps' loss on the demonstrations and the run's own held-out
    evaluation before and after it; "" for a run without one."""
    steps = records.supervised
    if not steps:
        return ""
    shown = sorted({0, len(steps) // 2, len(steps) - 1})
    rows = [[str(steps[i].step), str(steps[i].rows), str(steps[i].tokens),
             number(steps[i].sft_nll), number(steps[i].sft_token_accuracy),
             number(steps[i].train_s, 1)] for i in shown]
    text = ("## Supervised warm-up\n\nDemonstrations of train problems, through the same "
            "training chain as RL (loss: the assistant tokens' mean negative "
            "log-likelihood).\n\n"
            + table(["step", "rows", "assistant tokens", "nll per token", "token accuracy",
                     "train s"], rows))
    warmed = read_evaluation(run_dir / "eval_warmup.json")
    if warmed is not None:
        text += "\n\nBefore -> after the warm-up. " + held_out_table(before, warmed)
    return text


def training_table(steps: Sequence[StepRecord], points: Sequence[ThroughputPoint]) -> str:
    series = [*reward_accuracy_series(steps),
              ("staleness (versions)", [r.staleness_mean for r in steps])]
    rows = [[label, number(mean_of(values[:SUMMARY_STEPS])),
             number(mean_of(values[-SUMMARY_STEPS:]))] for label, values in series]
    rates = [p.tokens_per_s for p in points]
    rows.append(["generated tokens/s", number(mean_of(rates[:SUMMARY_STEPS]), 1),
                 number(mean_of(rates[-SUMMARY_STEPS:]), 1)])
    shown = min(SUMMARY_STEPS, len(steps))
    return table(["mean over", f"first {shown} steps", f"last {shown} steps"], rows)


def spread_parts(steps: Sequence[StepRecord]) -> list[str]:
    """The share of trained groups without reward spread, and the curriculum's last estimates
    per difficulty bucket (swarm/curriculum.py)."""
    groups = sum(r.groups for r in steps)
    if not groups:
        return []
    flat = sum(r.zero_variance_groups for r in steps)
    parts = [f"Groups without reward spread (all rows rewarded alike: no advantage, dropped): "
             f"{flat:.0f} of the {groups:.0f} groups of the training batches "
             f"({100 * flat / groups:.0f}%)."]
    last = steps[-1]
    if last.bucket_pass_rates and last.bucket_spread_chances:
        rows = [[markdown_text(bucket), f"{rate:.2f}",
                 f"{last.bucket_spread_chances.get(bucket, float('nan')):.2f}"]
                for bucket, rate in last.bucket_pass_rates.items()]
        parts += ["The coordinator's estimates per difficulty bucket at the last step:",
                  table(["bucket", "pass rate", "chance of spread"], rows)]
    return parts


def reward_caption(config: RunConfig, steps: Sequence[StepRecord]) -> str:
    if len(reward_accuracy_series(steps)) == 1:
        lead = ("Reward and accuracy are one series in this run (a rollout's reward is 1 when "
                "it solves its problem, else 0), drawn once")
    else:
        lead = "Reward and accuracy (the share of rollouts that solved their problem)"
    return (f"{lead}: the mean per rollout of each step's training batch "
            f"({config.rollout.prompts_per_step} groups of {config.rollout.group_size} "
            "rollouts), and the held-out pass@1 evaluations with their 95% intervals.")


def step_time_caption(timed: Sequence[tuple[int, float, float]]) -> str:
    waiting = sum(wait for _, wait, _ in timed)
    training = sum(train for _, _, train in timed)
    total = waiting + training
    share = f" ({100 * waiting / total:.0f}% of the step time)" if total > 0 else ""
    return ("Each step's seconds waiting for its rollout groups (generation on the replicas) "
            "and training on them (the update through the pipeline's stages). Over "
            f"{len(timed)} steps: {duration(waiting)} waiting{share} and {duration(training)} "
            "training.")


def trainer_parts(steps: Sequence[StepRecord], folder: Path) -> list[str]:
    parts = ["### The learner"]
    for plot in STEP_PLOTS:
        if any(getattr(r, field) is not None for r in steps for field in plot.fields()):
            plot_step_metrics(plot, steps, folder / plot.name)
            parts += [image(folder / plot.name, plot.title), plot.caption]
        else:
            parts.append(f"{plot.title}: not in the step records (an older run, or no batch "
                         "carried a learning signal).")
    timed = timed_steps(steps)
    if timed:
        plot_step_time(timed, folder / "step_time.png")
        parts += [image(folder / "step_time.png", "step time"), step_time_caption(timed)]
    else:
        parts.append("No step times were recorded.")
    return parts


def training_section(run_dir: Path, config: RunConfig, records: RunRecords, folder: Path) -> str:
    if not records.steps:
        return "## Training\n\nNo training steps were recorded."
    parts = ["## Training"]
    plot_reward_accuracy(records, folder / "reward_accuracy.png")
    points = throughput(records.steps, config.rollout.group_size)
    parts += [image(folder / "reward_accuracy.png", "reward and accuracy"),
              reward_caption(config, records.steps), training_table(records.steps, points),
              *spread_parts(records.steps)]
    counts = staleness_counts(records.steps, run_dir / "run.sqlite")
    if counts:
        plot_staleness(counts, folder / "staleness.png")
        parts += [image(folder / "staleness.png", "staleness histogram"),
                  (f"The {sum(counts.values())} groups trained, by staleness: how many versions "
                   "the learner had moved on between the weights that sampled a group and the "
                   "step that trained it.")]
    else:
        parts.append("No staleness counts were recorded.")
    if points:
        plot_throughput(points, folder / "throughput.png")
        parts += [image(folder / "throughput.png", "throughput"),
                  (f"Completion tokens the replicas generated per second, and training steps "
                   f"per minute, each over the last {THROUGHPUT_WINDOW} steps.")]
    else:
        parts.append("Too few steps to measure throughput.")
    parts += trainer_parts(records.steps, folder)
    return "\n\n".join(parts)


def peers_table(snapshot: SwarmRecord) -> str:
    rows = [[markdown_text(peer_name(p.name, p.peer_id)), str(p.stage), markdown_text(p.role),
             str(p.version), f"{p.tokens_per_s:.1f}", str(p.sessions),
             human_bytes(p.bytes_sent), human_bytes(p.bytes_relayed), f"{p.reputation:.2f}",
             "yes" if p.banned else "no"]
            for p in snapshot.peers]
    return table(["peer", "stage", "role", "version", "tok/s", "sessions", "bytes sent",
                  "through relays", "reputation", "banned"], rows)


# ComputeTime's kinds of work, as the compute table's columns.
COMPUTE_KINDS = (("generation_s", "generation"), ("training_s", "training"),
                 ("verification_s", "spot-checks"), ("weights_s", "weight updates"))


def compute_table(snapshots: Sequence[SwarmRecord]) -> str:
    """What each peer's compute thread did between its first and its last snapshot, as shares
    of that time (the rest idle: waiting for work)."""
    first: dict[str, PeerSnapshot] = {}
    last: dict[str, PeerSnapshot] = {}
    for snapshot in snapshots:
        for peer in snapshot.peers:
            if peer.compute is not None:
                first.setdefault(peer.peer_id, peer)
                last[peer.peer_id] = peer
    rows = []
    for peer_id, end in last.items():
        start = first[peer_id]
        assert start.compute is not None and end.compute is not None
        alive = end.compute.alive_s - start.compute.alive_s
        if alive <= 0:  # one snapshot only, or the peer restarted under the same id
            continue
        shares = [(getattr(end.compute, kind) - getattr(start.compute, kind)) / alive
                  for kind, _ in COMPUTE_KINDS]
        rows.append([markdown_text(peer_name(end.name, peer_id)), str(end.stage),
                     markdown_text(end.role), *(f"{100 * share:.0f}%" for share in shares),
                     f"{100 * max(0.0, 1 - sum(shares)):.0f}%", f"{end.rows_per_tick:.1f}",
                     minutes(alive)])
    if not rows:
        return "No peer reported what its compute thread did."
    return "\n\n".join([
        "What each peer's compute thread did, as shares of the time between its first and last "
        "snapshot (idle: no work waiting), and the rows its batched generation forwards took "
        "on average:",
        table(["peer", "stage", "role", *(label for _, label in COMPUTE_KINDS), "idle",
               "rows/tick", "over"], rows)])


def swarm_section(records: RunRecords, folder: Path) -> str:
    if not any(s.peers for s in records.snapshots):
        return ("## Swarm\n\nNo swarm snapshots with peers were recorded (a local run, or one "
                "from before the swarm logged them).")
    last = records.snapshots[-1]
    wire_bytes = records.steps[-1].wire_bytes if records.steps else None
    plot_bytes_per_peer(last, wire_bytes, folder / "bytes_per_peer.png")
    plot_peers(records.snapshots, folder / "peers.png")
    return "\n\n".join([
        "## Swarm",
        (f"The {len(last.peers)} peers at the last snapshot ({minutes(last.elapsed_s)}, step "
         f"{last.step}, learner version {last.version}; {peers_seen(records.snapshots)} peers "
         "were seen during the run):"),
        peers_table(last),
        compute_table(records.snapshots),
        image(folder / "bytes_per_peer.png", "bytes sent per peer"),
        "Bytes each of those peers has uploaded since it started, and the coordinator's own "
        "traffic (sent and received).",
        relayed_line(last),
        image(folder / "peers.png", "peers per stage over time"),
        "Peers of each stage over time by role, stacked: the top edge is the stage's peers.",
    ])


def relayed_line(snapshot: SwarmRecord) -> str:
    sent = sum(p.bytes_sent for p in snapshot.peers)
    relayed = sum(p.bytes_relayed for p in snapshot.peers)
    if not relayed:
        return "No peer sent anything through a relay."
    return (f"Through relays: {human_bytes(relayed)} of the {human_bytes(sent)} those peers sent "
            f"({100 * relayed / max(sent, 1):.1f}%): peers that nobody could dial directly, "
            "reached through a relay's circuit (their own replies included).")


def groups_line(totals: GroupTotals) -> str:
    if totals.accepted is None:
        return (f"{totals.trained} rollout groups trained (from the step records: without a run "
                "store the groups accepted are unknown).")
    return (f"{totals.accepted} rollout groups accepted: {totals.trained} trained, "
            f"{totals.dropped} dropped, {totals.pending} still pending at the end.")


def out_of(count: int | None, kind: Total | None, totals: GroupTotals, peers: int) -> str:
    """The total a trust counter counts from, with the counter's share of it."""
    if kind is None:
        return "-"
    if kind == "peers":
        return f"{peers} peers seen"
    total = totals.accepted if kind == "accepted" else totals.trained
    if total is None:
        return f"groups {kind}: unknown"
    share = f" ({100 * count / total:.1f}%)" if count is not None and total > 0 else ""
    return f"{total} groups {kind}{share}"


def counters_table(step: StepRecord, totals: GroupTotals, peers: int) -> str | None:
    counts = {name: getattr(step, name) for name in TRUST_COUNTERS}
    if all(value is None for value in counts.values()):
        return None
    rows = [[name, "-" if count is None else str(count), TRUST_COUNTERS[name][0],
             out_of(count, TRUST_COUNTERS[name][1], totals, peers)]
            for name, count in counts.items()]
    return table(["counter", "count", "what it counts", "out of"], rows)


def events_caption(events: Sequence[TrustRecord], num_stages: int, verified: int | None) -> str:
    passed = sum(e.outcome == "passed" for e in events)
    groups = "the groups verified" if verified is None else f"the {verified} groups verified"
    return (f"The {len(events)} verification events, one mark each. They count peers' work at "
            "one stage, not groups: a spot-check adds a `passed` event for each stage another "
            "replica re-executed, one per peer that served it (so up to "
            f"{num_stages} per group in this run): the {passed} `passed` events come from "
            f"{groups} and from the stages checked before a failure. `failed` and `proved` "
            "blame one peer at one stage, `flagged` is one per last-stage replica of a flagged "
            "group that could not be checked, `malformed` one per malformed message.")


def events_table(events: Sequence[TrustRecord]) -> str:
    notable = [e for e in events if e.outcome != "passed"]
    if not notable:
        return "Every verification passed."
    rows = [[minutes(e.elapsed_s), markdown_text(peer_name(e.name, e.peer)),
             "-" if e.stage is None else str(e.stage), markdown_text(e.outcome),
             markdown_text(e.detail)] for e in notable[:EVENTS_LISTED]]
    text = (f"The {len(notable)} events other than `passed`:\n\n"
            + table(["time", "peer", "stage", "outcome", "detail"], rows))
    if len(notable) > EVENTS_LISTED:
        text += f"\n\n… and {len(notable) - EVENTS_LISTED} more (metrics.jsonl has them all)."
    return text


def verification_section(run_dir: Path, config: RunConfig, records: RunRecords,
                         folder: Path) -> str:
    totals = group_totals(records.steps, run_dir / "run.sqlite")
    counters = (counters_table(records.steps[-1], totals, peers_seen(records.snapshots))
                if records.steps else None)
    if counters is None and not records.trust:
        return "## Verification\n\nNo verification counters or events were recorded."
    parts = ["## Verification"]
    if counters is not None:
        parts += [groups_line(totals),
                  "The trust counters at the last step, each out of the total it counts from:",
                  counters]
    if records.trust:
        plot_verification(records.trust, folder / "verification.png")
        parts += [image(folder / "verification.png", "verification events"),
                  events_caption(records.trust, config.num_stages,
                                 records.steps[-1].verified if records.steps else None),
                  events_table(records.trust)]
    else:
        parts.append("No verification events were recorded.")
    return "\n\n".join(parts)


def samples_section(after: EvalResult | None) -> str:
    if after is None or not after.samples:
        return "## Sample completions\n\nNo evaluation samples were recorded."
    rows = [[markdown_text(str(s.get("question", ""))), markdown_text(str(s.get("completion", ""))),
             "yes" if s.get("correct") else "no"] for s in after.samples]
    return (f"## Sample completions\n\nGreedy completions of the final evaluation, "
            f"{len(after.samples)} of its {after.problems} problems:\n\n"
            + table(["question", "completion", "correct"], rows))


def model_section(run_dir: Path) -> str:
    # model/: the swarm demo's export; final/: the model a local run saves.
    folders = [name for name in ("model", "final") if (run_dir / name).is_dir()]
    if not folders:
        return ("## Exported model\n\nNo exported model folder (`decentrl export RUN_DIR OUT_DIR` "
                "makes one).")
    lines = []
    for folder in folders:
        links = [f"[{name}](../{folder}/{name})" for name in ("README.md", "SHA256SUMS")
                 if (run_dir / folder / name).is_file()]
        extra = f" ({', '.join(links)})" if links else ""
        lines.append(f"- Hugging Face folder: [{folder}/](../{folder}/){extra}")
    return "## Exported model\n\n" + "\n".join(lines)


def build_report(run_dir: Path) -> Path:
    """Write `run_dir/report/report.md` and its PNG plots; returns the path of report.md.
    Raises FileNotFoundError for a folder that is not a run, ValueError for a malformed file."""
    config_path = run_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run folder: it has no config.json")
    config = load_config(config_path)
    records = read_metrics(run_dir / "metrics.jsonl")
    before = read_evaluation(run_dir / "eval_before.json")
    after = read_evaluation(run_dir / "eval_after.json")
    folder = run_dir / "report"
    folder.mkdir(exist_ok=True)
    for name in PLOT_NAMES:  # a rebuild must not show plots whose data is gone
        (folder / name).unlink(missing_ok=True)
    sections = [header(config, records), evaluation_section(run_dir, before, after),
                warmup_section(run_dir, records, before),
                training_section(run_dir, config, records, folder),
                swarm_section(records, folder),
                verification_section(run_dir, config, records, folder),
                samples_section(after), model_section(run_dir)]
    path = folder / "report.md"
    path.write_text("\n\n".join(section for section in sections if section) + "\n")
    return path

"""The run report's PNG plots (observe/report.py): reward and accuracy, staleness, throughput, the
learner's metrics, step times, bytes per peer, peers per stage, verification events. Peer names
and outcomes are untrusted text: a plot shows them cut short and with math parsing off."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from decentrl.net.text import peer_text
from decentrl.observe.markdown import byte_unit, human_bytes, minutes, peer_name
from decentrl.observe.metrics import RunRecords, StepRecord, SwarmRecord, TrustRecord
from decentrl.observe.report_data import THROUGHPUT_WINDOW, ThroughputPoint, reward_accuracy_series

ROLES = ("inference", "training", "both")
OUTCOMES = ("passed", "failed", "proved", "flagged", "malformed")
PLOT_LABEL_CHARS = 24
FIGURE_SIZE = (8.0, 4.0)
DPI = 120
PLOT_NAMES = ("reward_accuracy.png", "staleness.png", "throughput.png", "loss.png",
              "grad_norm.png", "kl.png", "entropy.png", "importance_weights.png", "fidelity.png",
              "step_time.png", "bytes_per_peer.png", "peers.png", "verification.png")
OUTCOME_COLORS = {"passed": "tab:green", "failed": "tab:red", "proved": "darkred",
                  "flagged": "tab:orange", "malformed": "tab:purple"}
ROLE_COLORS = {"inference": "tab:blue", "training": "tab:orange", "both": "tab:green",
               "banned": "tab:red"}


def plot_label(text: str) -> str:
    return peer_text(" ".join(text.split()), PLOT_LABEL_CHARS)


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

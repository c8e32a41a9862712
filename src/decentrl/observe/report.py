"""The per-run report: `report/report.md` with PNG plots beside it, built afterwards from what a
run folder holds (config.json, metrics.jsonl, the evaluations, run.sqlite, the exported model).
This module writes its sections; observe/report_data.py reads and derives the figures,
observe/report_plots.py draws the plots, observe/markdown.py formats text and tables.

Every section degrades to one line when its data is missing (an older run, a local run without a
swarm). Peer names, verification details and model completions are untrusted text: the report
escapes them before they reach Markdown, and keeps math parsing off where they reach a plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import msgspec

from decentrl.config import RUN_MODEL_DIR, RunConfig, load_config
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
from decentrl.observe.markdown import (
    duration,
    human_bytes,
    image,
    markdown_text,
    minutes,
    number,
    peer_name,
    table,
)
from decentrl.observe.metrics import (
    PeerSnapshot,
    RunRecords,
    StepRecord,
    SwarmRecord,
    TrustRecord,
    read_metrics,
)
from decentrl.observe.report_data import (
    THROUGHPUT_WINDOW,
    GroupTotals,
    ThroughputPoint,
    group_totals,
    mean_of,
    peers_seen,
    read_evaluation,
    reward_accuracy_series,
    staleness_counts,
    throughput,
    timed_steps,
)
from decentrl.observe.report_plots import (
    PLOT_NAMES,
    STEP_PLOTS,
    plot_bytes_per_peer,
    plot_peers,
    plot_reward_accuracy,
    plot_staleness,
    plot_step_metrics,
    plot_step_time,
    plot_throughput,
    plot_verification,
)

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
SUMMARY_STEPS = 5  # the training table compares the means of the first and the last few steps
EVENTS_LISTED = 50  # non-"passed" verification events in the table; a flood would drown it


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
    per difficulty bucket (coordinator/curriculum.py)."""
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
    # A local run saves its model there at its end; a swarm run's release exports it there.
    folder = RUN_MODEL_DIR
    if not (run_dir / folder).is_dir():
        return ("## Exported model\n\nNo exported model folder (`decentrl export RUN_DIR OUT_DIR` "
                "makes one).")
    links = [f"[{name}](../{folder}/{name})" for name in ("README.md", "SHA256SUMS")
             if (run_dir / folder / name).is_file()]
    extra = f" ({', '.join(links)})" if links else ""
    return f"## Exported model\n\n- Hugging Face folder: [{folder}/](../{folder}/){extra}"


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

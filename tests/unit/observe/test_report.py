"""The per-run report: report.md with the before/after table first and PNG plots beside it, built
from a synthetic run folder; sections without data degrade to a line; bad input is refused."""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from typer.testing import CliRunner

from decentrl.cli import app
from decentrl.config import parse_config
from decentrl.evaluate.divergence import GeneralResult, Interval
from decentrl.evaluate.runner import SAMPLED_INTERVALS_NOTE, EvalResult
from decentrl.evaluate.stats import Accuracy, difference_interval
from decentrl.evaluate.suite import (
    Family,
    FamilyResult,
    SuiteResult,
    pass1_change,
    suite_table_markdown,
)
from decentrl.observe.markdown import human_bytes
from decentrl.observe.metrics import StepRecord, read_metrics
from decentrl.observe.report import build_report
from decentrl.observe.report_data import reward_accuracy_series, staleness_counts
from decentrl.observe.report_plots import PLOT_NAMES, STEP_PLOTS, bytes_sent_by_peer, error_bars

STEPS = 30
BEFORE = Accuracy.from_counts(29, 200)  # 14.5% [10.3, 20.0]
AFTER = Accuracy.from_counts(136, 200)  # 68.0% [61.2, 74.1]
FAILURE_DETAIL = "forged log-probs | row 3\nsecond line"
MALLORY = "mallory|$x$"  # a hostile peer's name: a column break and GitHub math
MALLORY_ESCAPED = "mallory\\|\\$x\\$"
# Even steps train groups of staleness 0, 1 and 2; odd steps of 0 and 1.
EVEN_COUNTS, ODD_COUNTS = {"0": 2, "1": 5, "2": 1}, {"0": 3, "1": 5}
EXPECTED_STALENESS = {0: 15 * 2 + 15 * 3, 1: 15 * 5 + 15 * 5, 2: 15 * 1}
# The run store's groups: 8 a step trained, some dropped, the last few still pending.
TRAINED, DROPPED, PENDING = 8 * STEPS, 4, 8
ACCEPTED = TRAINED + DROPPED + PENDING
NO_SIGNAL_STEP = 7  # its batch had no learning signal: the trainer logged nothing
TRAINER_KEYS = ("policy_loss", "entropy", "grad_norm", "behaviour_kl", "tis_weight_mean",
                "tis_truncated_fraction", "mis_masked_fraction")


def step_record(step: int) -> dict[str, Any]:
    accuracy = 0.1 + 0.02 * step  # rising
    record: dict[str, Any] = {
        "event": "step", "elapsed_s": 60.0 + 20 * step, "step": step, "version": step,
        "wait_s": 10.0 + step % 3, "train_s": 8.0, "sequences": 24, "reward": accuracy,
        "accuracy": accuracy, "staleness_mean": 0.8, "staleness_max": 2.0,
        "completion_tokens_mean": 12.0, "finished_fraction": 1.0, "groups": 8.0,
        "zero_variance_groups": 2.0, "stale_dropped": 0, "rejected": 0, "failovers": 0,
        "wire_bytes": 1_000_000 * step, "verified": 4 * step, "verify_failed": 1,
        "verify_skipped": 0, "flagged": 1, "banned": 1,
        "staleness_counts": EVEN_COUNTS if step % 2 == 0 else ODD_COUNTS,
        "generated_tokens": 768.0, "served_gap": 0.5 - 0.01 * step,
        "served_bf16_differing": 0.002, "served_gap_by_stage": {"0": 0.4, "1": 0.6},
        "served_bf16_differing_by_stage": {"0": 0.001, "1": 0.003},
        # The curriculum's estimates: the hard bucket's chance of spread grows as it learns.
        "bucket_pass_rates": {"sums 1+1 digits, 0 carries": 0.95,
                              "sums 2+2 digits, 2 carries|x": 0.01 * step},
        "bucket_spread_chances": {"sums 1+1 digits, 0 carries": 0.2,
                                  "sums 2+2 digits, 2 carries|x": 0.02 * step}}
    if step != NO_SIGNAL_STEP:
        record.update({"policy_loss": -0.01 * (step % 4), "entropy": 1.0 - 0.01 * step,
                       "grad_norm": 2.0 + step % 5, "behaviour_kl": 0.001 * (step % 6),
                       "tis_weight_mean": 1.0 - 0.002 * step,
                       "tis_truncated_fraction": 0.001 * step, "mis_masked_fraction": 0.0})
    return record


def peer(peer_id: str, name: str, stage: int, role: str, elapsed_s: float,
         megabytes_per_s: float, banned: bool = False, relayed: float = 0.0) -> dict[str, Any]:
    # Bytes grow with time, so only the last snapshot has the final count.
    sent = int(elapsed_s * megabytes_per_s * 1_000_000)
    # Its compute thread's seconds by kind of work: fixed shares of the time it has been up.
    shares = COMPUTE_SHARES[role]
    compute = {f"{kind}_s": share * elapsed_s for kind, share in shares.items()}
    return {"peer_id": peer_id, "name": name, "stage": stage, "role": role, "version": 3,
            "tokens_per_s": 42.5, "bytes_sent": sent, "bytes_relayed": int(relayed * sent),
            "sessions": int(elapsed_s / 60) if role != "training" else 0,
            "reputation": 0.2 if banned else 0.95, "banned": banned,
            "compute": {**compute, "alive_s": elapsed_s},
            "rows_per_tick": 24.0 if role != "training" else 0.0}


COMPUTE_SHARES = {"inference": {"generation": 0.6, "verification": 0.1, "weights": 0.05},
                  "training": {"training": 0.7},
                  "both": {"training": 0.5, "generation": 0.3, "weights": 0.02}}


def swarm_record(elapsed_s: float) -> dict[str, Any]:
    """Peers join (infer-b at 5 minutes) and leave (infer-c after 7); mallory gets banned."""
    peers = [peer("id-infer-a", "infer-a", 0, "inference", elapsed_s, 1.0),
             peer("id-train-0", "train-0", 0, "training", elapsed_s, 3.0),
             peer("id-train-1", "train-1", 1, "both", elapsed_s, 2.5),
             peer("id-mallory", MALLORY, 1, "inference", elapsed_s, 0.2,
                  banned=elapsed_s >= 400)]
    if elapsed_s >= 300:
        # Behind NAT: half of what it sends goes through a relay.
        peers.append(peer("id-infer-b", "infer-b", 0, "inference", elapsed_s, 1.5,
                          relayed=0.5))
    if elapsed_s < 420:
        peers.append(peer("id-infer-c", "infer-c", 1, "inference", elapsed_s, 1.0))
    return {"event": "swarm", "elapsed_s": elapsed_s, "step": int(elapsed_s // 20),
            "version": int(elapsed_s // 20), "peers": peers}


def trust_record(elapsed_s: float, outcome: str, detail: str = "",
                 stage: int | None = 1) -> dict[str, Any]:
    return {"event": "trust", "elapsed_s": elapsed_s, "time": 1.7e9 + elapsed_s,
            "peer": "id-mallory", "name": MALLORY, "stage": stage, "outcome": outcome,
            "detail": detail}


def eval_record(label: str, elapsed_s: float, step: int, accuracy: Accuracy) -> dict[str, Any]:
    return {"event": "eval", "elapsed_s": elapsed_s, "label": label, "step": step,
            "version": step, "task": "sums", "problems": 200, "pass1": accuracy.mean,
            "pass1_low": accuracy.low, "pass1_high": accuracy.high, "pass_k": None, "k": 4}


def evaluation(pass1: Accuracy, pass_k: Accuracy) -> str:
    samples = [{"question": "What is 2 + 2?", "completion": "2 + 2 = 4", "correct": True}]
    return json.dumps(EvalResult(task="sums", split="heldout", problems=200, pass1=pass1,
                                 pass_k=pass_k, k=4, mean_completion_tokens=11.5,
                                 samples=samples).to_json())


def write_lines(path: Path, records: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def write_config(run_dir: Path) -> None:
    config = parse_config({"name": run_dir.name, "host": {"run_dir": str(run_dir.parent)},
                           "rollout": {"group_size": 8, "prompts_per_step": 8}})
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(config.model_dump_json(indent=2))


def write_store(path: Path, states: list[tuple[int, str]]) -> None:
    """A run store with just what the report reads of it: each group's staleness and state."""
    with closing(sqlite3.connect(path)) as db, db:
        db.execute("CREATE TABLE groups (staleness INTEGER, state TEXT)")
        db.executemany("INSERT INTO groups VALUES (?, ?)", states)


def write_run(run_dir: Path) -> Path:
    write_config(run_dir)
    records = [eval_record("before", 50.0, 0, BEFORE)]
    records += [step_record(step) for step in range(1, STEPS + 1)]
    records += [swarm_record(float(t)) for t in range(60, 60 + 20 * STEPS + 1, 60)]
    records += [trust_record(100.0 + 10 * i, "passed") for i in range(20)]
    records += [trust_record(250.0, "failed", FAILURE_DETAIL, stage=0),
                trust_record(380.0, "flagged", "row 5 off by 3 nats"),
                trust_record(400.0, "proved", "signed claim contradicts delivery"),
                trust_record(410.0, "malformed", "x" * 500, stage=None)]
    records.append(eval_record("after", 60.0 + 20 * STEPS + 30, STEPS, AFTER))
    write_lines(run_dir / "metrics.jsonl", records)
    write_store(run_dir / "run.sqlite", [(1, "trained")] * TRAINED + [(3, "dropped")] * DROPPED
                + [(0, "pending")] * PENDING)
    (run_dir / "eval_before.json").write_text(evaluation(BEFORE, Accuracy(0.115, 0.07, 0.16, 200)))
    (run_dir / "eval_after.json").write_text(evaluation(AFTER, Accuracy(0.78, 0.72, 0.84, 200)))
    (run_dir / "model").mkdir()
    (run_dir / "model" / "README.md").write_text("# card\n")
    return run_dir


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    run_dir = write_run(tmp_path_factory.mktemp("runs") / "synthetic")
    path = build_report(run_dir)
    return run_dir, path.read_text()


def test_the_before_after_table_comes_first_with_the_evaluations_numbers(
        built: tuple[Path, str]) -> None:
    run_dir, text = built
    assert (run_dir / "report" / "report.md").is_file()
    sections = [line for line in text.splitlines() if line.startswith("## ")]
    assert sections[0] == "## Before and after"
    assert sections[1:] == ["## Training", "## Swarm", "## Verification", "## Sample completions",
                            "## Exported model"]
    low, high = difference_interval(136, 200, 29, 200)
    assert (f"| pass@1 (greedy) | 14.5% [10.3, 20.0] | 68.0% [61.2, 74.1] | +53.5 pts "
            f"[{100 * low:+.1f}, {100 * high:+.1f}] |") in text
    assert "| pass@4 (sampled, T=1) | 11.5% [7.0, 16.0] | 78.0% [72.0, 84.0] |" in text
    # The sampled row's interval says what it is.
    assert f"(change: after - before; {SAMPLED_INTERVALS_NOTE})" in text
    assert f"{STEPS} steps to weight version {STEPS}" in text
    assert "[model/](../model/) ([README.md](../model/README.md))" in text


def test_every_plot_is_a_real_image(built: tuple[Path, str]) -> None:
    run_dir, text = built
    # Every plot drawn is one a rebuild knows to remove.
    assert sorted(p.name for p in (run_dir / "report").glob("*.png")) == sorted(PLOT_NAMES)
    for name in PLOT_NAMES:
        path = run_dir / "report" / name
        assert f"]({name})" in text
        assert path.stat().st_size > 10_000, name
        with Image.open(path) as image:
            assert image.format == "PNG" and image.width >= 600 and image.height >= 250, name


def test_each_learner_plot_says_what_it_shows(built: tuple[Path, str]) -> None:
    run_dir, text = built
    # A step whose batch had no signal reads without the trainer's metrics: a gap in the plots.
    steps = read_metrics(run_dir / "metrics.jsonl").steps
    assert [r.step for r in steps if r.policy_loss is None] == [NO_SIGNAL_STEP]
    for plot in STEP_PLOTS:
        assert f"]({plot.name})\n\n{plot.caption}\n" in text
    # Steps wait 10, 11 or 12 s (10 of each) and train 8 s: 330 s waiting of 570.
    assert ("](step_time.png)\n\nEach step's seconds waiting for its rollout groups" in text
            and f"Over {STEPS} steps: 5.5 min waiting (58% of the step time) and 4.0 min "
            "training." in text)


def test_reward_and_accuracy_are_drawn_once_when_they_are_one_series() -> None:
    def steps(pairs: list[tuple[float, float]]) -> list[StepRecord]:
        return [StepRecord(elapsed_s=10.0 * i, step=i, version=i, reward=reward,
                           accuracy=accuracy, staleness_mean=0.0)
                for i, (reward, accuracy) in enumerate(pairs, start=1)]

    same = steps([(0.25, 0.25), (0.5, 0.5 + 1e-12)])  # rounding noise is the same series
    assert reward_accuracy_series(same) == [("reward = accuracy", [0.25, 0.5])]
    bonus = steps([(0.3, 0.25), (0.5, 0.5)])  # a format bonus lifts the reward at one step
    assert reward_accuracy_series(bonus) == [("reward", [0.3, 0.5]), ("accuracy", [0.25, 0.5])]


def test_the_report_draws_one_reward_line_here(built: tuple[Path, str]) -> None:
    _, text = built
    assert "Reward and accuracy are one series in this run" in text
    assert "(8 groups of 8 rollouts)" in text
    assert "| reward = accuracy | 0.160 | 0.660 |" in text
    assert "| accuracy |" not in text


def test_staleness_counts_sum_the_steps_or_fall_back_on_the_store(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run")
    steps = read_metrics(run_dir / "metrics.jsonl").steps
    assert staleness_counts(steps, run_dir / "run.sqlite") == EXPECTED_STALENESS

    # An older run's steps lack the counts: its store's trained groups have them.
    store = tmp_path / "older.sqlite"
    write_store(store, [(0, "trained")] * 3 + [(2, "trained")] * 4 + [(1, "dropped")] * 9)
    for record in steps:
        record.staleness_counts = None
    assert staleness_counts(steps, store) == {0: 3, 2: 4}
    assert staleness_counts(steps, tmp_path / "absent.sqlite") == {}


def test_the_groups_without_spread_and_the_last_estimates_per_bucket(
        built: tuple[Path, str]) -> None:
    _, text = built
    assert f"{2 * STEPS} of the {8 * STEPS} groups of the training batches (25%)" in text
    assert "| sums 1+1 digits, 0 carries | 0.95 | 0.20 |" in text
    # The last step's, and a bucket name is escaped in Markdown like any text.
    assert f"| sums 2+2 digits, 2 carries\\|x | {0.01 * STEPS:.2f} | {0.02 * STEPS:.2f} |" \
        in text


def test_bytes_per_peer_come_from_the_last_snapshot(built: tuple[Path, str]) -> None:
    run_dir, text = built
    last = read_metrics(run_dir / "metrics.jsonl").snapshots[-1]
    assert last.elapsed_s == 660
    assert bytes_sent_by_peer(last) == [
        ("train-0 (stage 0)", 1980e6), ("train-1 (stage 1)", 1650e6),
        ("infer-b (stage 0)", 990e6), ("infer-a (stage 0)", 660e6),
        (f"{MALLORY} (stage 1)", 132e6)]
    # The table lists the last snapshot's peers: infer-c had left by then.
    # sessions: the coordinator's count, one a minute in this synthetic run.
    assert f"| infer-a | 0 | inference | 3 | 42.5 | 11 | {human_bytes(660e6)} | 0 B | 0.95 | no |" \
        in text
    assert f"| infer-b | 0 | inference | 3 | 42.5 | 11 | {human_bytes(990e6)} | " \
        f"{human_bytes(495e6)} | 0.95 | no |" in text
    assert f"| {MALLORY_ESCAPED} | 1 | inference | 3 | 42.5 | 11 | {human_bytes(132e6)} | 0 B | " \
        "0.20 | yes |" in text
    assert f"Through relays: {human_bytes(495e6)} of the {human_bytes(5412e6)} those peers " \
        "sent (9.1%)" in text
    assert "| infer-c | 1 | inference | 3 |" not in text


def test_what_each_peers_compute_thread_did_is_a_share_of_its_time(
        built: tuple[Path, str]) -> None:
    _, text = built
    header = ("| peer | stage | role | generation | training | spot-checks | weight updates | "
              "idle | rows/tick | over |")
    assert header in text
    # Between each peer's first and last snapshot (infer-a: 1 to 11 minutes).
    assert "| infer-a | 0 | inference | 60% | 0% | 10% | 5% | 25% | 24.0 | 10.0 min |" in text
    assert "| train-0 | 0 | training | 0% | 70% | 0% | 0% | 30% | 0.0 | 10.0 min |" in text
    assert "| train-1 | 1 | both | 30% | 50% | 0% | 2% | 18% | 24.0 | 10.0 min |" in text
    # infer-c left before 7 minutes: its shares cover its snapshots, from 1 to 6 minutes.
    assert "| infer-c | 1 | inference | 60% | 0% | 10% | 5% | 25% | 24.0 | 5.0 min |" in text


def test_trust_counts_say_what_they_count_and_out_of_how_many(
        built: tuple[Path, str]) -> None:
    _, text = built
    assert (f"{ACCEPTED} rollout groups accepted: {TRAINED} trained, {DROPPED} dropped, "
            f"{PENDING} still pending at the end.") in text
    assert (f"| verified | 120 | groups whose spot-check passed | {ACCEPTED} groups accepted "
            "(47.6%) |") in text
    assert "| verify_failed | 1 | groups whose spot-check caught a lie (confirmed by a second " \
        f"verifier) | {ACCEPTED} groups accepted (0.4%) |" in text
    assert "| flagged | 1 | groups with rows the trainer's log-probs flagged (left out of the " \
        f"loss, then re-checked) | {TRAINED} groups trained (0.4%) |" in text
    assert "| banned | 1 | bans (a peer banned again counts again) | 6 peers seen |" in text
    # Events count stage checks, not groups: the text says so, with the numbers of this run.
    assert "The 24 verification events, one mark each." in text
    assert ("up to 2 per group in this run): the 20 `passed` events come from the 120 groups "
            "verified") in text
    assert "The 4 events other than `passed`:" in text
    assert f"The {TRAINED} groups trained, by staleness" in text
    assert "The 5 peers at the last snapshot" in text and "6 peers were seen" in text
    assert "Greedy completions of the final evaluation, 1 of its 200 problems:" in text


def test_without_a_run_store_the_groups_accepted_are_unknown(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run")
    (run_dir / "run.sqlite").unlink()
    text = build_report(run_dir).read_text()
    assert f"{TRAINED} rollout groups trained (from the step records" in text
    assert "| verified | 120 | groups whose spot-check passed | groups accepted: unknown |" in text
    assert f"| {TRAINED} groups trained (0.4%) |" in text


def test_verification_events_are_listed_escaped(built: tuple[Path, str]) -> None:
    _, text = built
    assert (f"| 4.2 min | {MALLORY_ESCAPED} | 0 | failed | forged log-probs \\| row 3 second line |"
            in text)
    assert f"| 6.8 min | {MALLORY_ESCAPED} | - | malformed | " + "x" * 160 + "…(+340 chars) |" in text
    assert "| passed |" not in text  # passes are counted in the plot, not listed


def test_missing_data_degrades_to_a_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "local"
    write_config(run_dir)
    record = step_record(1)
    for key in ("staleness_counts", "generated_tokens", "wire_bytes", "verified",
                "verify_failed", "verify_skipped", "flagged", "banned",
                "wait_s", "train_s", "served_gap", "served_bf16_differing", *TRAINER_KEYS):
        del record[key]
    write_lines(run_dir / "metrics.jsonl", [record])
    text = build_report(run_dir).read_text()
    for line in ("No held-out evaluation was recorded for this run.",
                 "No staleness counts were recorded.", "Too few steps to measure throughput.",
                 *(f"{plot.title}: not in the step records" for plot in STEP_PLOTS),
                 "No step times were recorded.",
                 "No swarm snapshots with peers were recorded",
                 "No verification counters or events were recorded.",
                 "No evaluation samples were recorded.", "No exported model folder"):
        assert line in text
    assert sorted(p.name for p in (run_dir / "report").iterdir()) == ["report.md",
                                                                     "reward_accuracy.png"]


def test_the_evaluation_suite_supplies_the_table_when_the_run_has_one(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run")
    before, after = (EvalResult(task="sums", split="heldout", problems=200, pass1=accuracy,
                                pass_k=None, k=1, mean_completion_tokens=11.5, samples=[])
                     for accuracy in (BEFORE, AFTER))
    family = FamilyResult(Family("sums", {"min_digits": 2}), model=after, base=before,
                          pass1_change=pass1_change(AFTER, BEFORE), pass_k_change=None)
    suite = SuiteResult(model="runs/run/model", base="smollm2-135m-instruct", pass_k=1, seed=0,
                        families=[family], general=GeneralResult(12, 900, 5.1, 5.0,
                                                                 Interval(0.02, 0.01, 0.03)),
                        seconds=60.0)
    (run_dir / "evaluation.json").write_text(json.dumps(suite.to_json()))
    text = build_report(run_dir).read_text()
    top = text.index("## Before and after")
    # The comparison with the base first, then the run's own evaluation through the swarm.
    assert top < text.index(suite_table_markdown(suite)) < text.index("Held-out `sums`") \
        < text.index("## Training")
    # Greedy pass@1 only (k = 1): no sampled interval to explain above the suite's table.
    assert "held-out problems, 95% confidence intervals:\n" in text

    (run_dir / "evaluation.json").write_text('{"model": "m"}')
    with pytest.raises(ValueError, match="evaluation.json: not an evaluation suite result"):
        build_report(run_dir)


def test_a_sampled_evaluation_shows_its_greedy_pass1_beside_it(tmp_path: Path) -> None:
    """A run's own evaluation (training-shaped: pass@1 sampled) with eval.greedy: a greedy row
    in the table, with the change's interval, and greedy points in the accuracy plot."""
    run_dir = write_run(tmp_path / "run")
    for name, greedy in (("eval_before.json", BEFORE), ("eval_after.json", AFTER)):
        result = EvalResult(task="sums", split="heldout", problems=200,
                            pass1=Accuracy(0.1, 0.08, 0.12, 200), pass_k=None, k=1,
                            mean_completion_tokens=11.5, samples=[], pass1_temperature=1.0,
                            greedy_pass1=greedy)
        (run_dir / name).write_text(json.dumps(result.to_json()))
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    for record in records:
        if record["event"] == "eval":
            greedy = BEFORE if record["label"] == "before" else AFTER
            record.update(greedy_pass1=greedy.mean, greedy_pass1_low=greedy.low,
                          greedy_pass1_high=greedy.high)
    write_lines(metrics, records)
    text = build_report(run_dir).read_text()
    low, high = difference_interval(136, 200, 29, 200)
    assert "| pass@1 (sampled at T=1) | 10.0% [8.0, 12.0] | 10.0% [8.0, 12.0] |" in text
    assert (f"| pass@1 (greedy) | 14.5% [10.3, 20.0] | 68.0% [61.2, 74.1] | +53.5 pts "
            f"[{100 * low:+.1f}, {100 * high:+.1f}] |") in text
    with Image.open(run_dir / "report" / "reward_accuracy.png") as plot:
        assert plot.size[0] > 100


@pytest.mark.parametrize("line, problem", [
    ("{not json", "malformed metrics record"),
    ('{"event": "step", "elapsed_s": "soon", "step": 3}', "elapsed_s"),
    ('["event", "step"]', "Expected `object`, got `array`"),
    ('{"elapsed_s": 1.0, "step": 3}', "missing required field `event`"),
])
def test_a_malformed_metrics_line_is_named(tmp_path: Path, line: str, problem: str) -> None:
    run_dir = tmp_path / "run"
    write_config(run_dir)
    records = [json.dumps(step_record(step)) for step in (1, 2)]
    (run_dir / "metrics.jsonl").write_text("\n".join([*records, line]) + "\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl, line 3: .*" + problem):
        build_report(run_dir)


def test_the_report_command(built: tuple[Path, str], tmp_path: Path) -> None:
    run_dir, _ = built
    result = CliRunner().invoke(app, ["report", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(run_dir / "report" / "report.md")

    refused = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert refused.exit_code == 2
    assert "is not a run folder: it has no config.json" in " ".join(refused.output.split())


def test_error_bars_are_never_negative() -> None:
    # A Wilson bound computed a rounding error inside its mean of 100% once crashed the plot.
    below, above = error_bars([(1.0, 0.8, 1.0 - 1e-16), (0.5, 0.4, 0.7)])
    assert below == pytest.approx([0.2, 0.1]) and above == pytest.approx([0.0, 0.2])
    assert min(above) == 0.0

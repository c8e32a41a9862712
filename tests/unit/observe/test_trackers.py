"""host.report_to: the records metrics.jsonl holds reach TensorBoard, W&B (offline) and trackio
with their values, read back through each one's own reader; unknown trackers and missing packages
are refused before a run starts, and a tracker that fails mid-run is dropped, not the run."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest
import wandb
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from decentrl.config import ConfigError, parse_config
from decentrl.observe.metrics import (
    EvalRecord,
    MetricsLog,
    Record,
    StepRecord,
    SupervisedRecord,
    SwarmRecord,
    TrustRecord,
)
from decentrl.observe.trackers import (
    PROJECT,
    TensorBoardTracker,
    Trackers,
    WandbTracker,
    scalars_of,
    wandb_mode,
)

Series = dict[str, list[tuple[int, float]]]


@pytest.fixture
def offline_trackers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """W&B as on a machine without credentials, its own files under `tmp_path`; trackio in the
    run folder of the first run that imports it in this process (trackio.utils.TRACKIO_DIR), never
    in the home folder: no test imports trackio before a tracker has."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT", "TRACKIO_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))


def tensorboard_series(directory: Path) -> Series:
    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def wandb_series(run_dir: Path) -> Series:
    """The history of the W&B offline run under `run_dir`, read by W&B's own inspector."""
    found = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json",
                            str(run_dir)], capture_output=True, text=True, check=True)
    series: Series = defaultdict(list)
    for line in found.stdout.splitlines():
        entry = json.loads(line)
        if entry["type"] == "history":
            history = entry["history"]
            for key, value in history["item"].items():
                if not key.startswith("_"):  # W&B's own: _step, _runtime, _timestamp
                    series[key].append((int(history["step"]["num"]), value))
    return dict(series)


def trackio_series(run_name: str) -> Series:
    """The logs of trackio's run `run_name`, read by trackio, from wherever this process's trackio
    stores them (a tracker has imported it)."""
    from trackio.sqlite_storage import SQLiteStorage

    series: Series = defaultdict(list)
    for row in SQLiteStorage.get_logs(PROJECT, run_name):
        for key, value in row.items():
            if key not in ("step", "timestamp"):
                series[key].append((row["step"], value))
    return dict(series)


def expected_series(records: list[Record]) -> Series:
    series: Series = defaultdict(list)
    for record in records:
        scalars = scalars_of(record)
        if scalars is not None:
            step, values = scalars
            for key, value in values.items():
                series[key].append((step, value))
    return dict(series)


def assert_same_series(found: Series, expected: Series) -> None:
    assert set(found) == set(expected)
    for key, points in expected.items():
        assert [step for step, _ in found[key]] == [step for step, _ in points], key
        # TensorBoard keeps float32.
        assert [value for _, value in found[key]] == pytest.approx(
            [value for _, value in points], rel=1e-6), key


def run_records() -> list[Record]:
    """A short run's records in the order a run writes them: an evaluation, a supervised step,
    training steps and the evaluation after, with a verification event no tracker takes."""
    steps = [StepRecord(step=number, version=number, reward=number / 8, accuracy=number / 10,
                        staleness_mean=0.5, sequences=8 * number, grad_norm=1.5 + number,
                        bucket_pass_rates={"1": 0.25 * number, "2": 0.125},
                        staleness_counts={0: 3, 1: number}) for number in (2, 3, 4)]
    return [EvalRecord(label="before", step=0, pass1=0.125, pass1_low=0.05, pass1_high=0.25),
            SupervisedRecord(step=1, version=1, rows=4, tokens=60, sft_nll=2.5,
                             sft_token_accuracy=0.4, grad_norm=3.0, train_s=0.2),
            *steps, TrustRecord(peer="p", stage=0, outcome="verified"),
            EvalRecord(label="after", step=4, pass1=0.375, pass1_low=0.25, pass1_high=0.5)]


def test_records_become_scalars_under_their_kind() -> None:
    before, supervised, step, *_, trust, after = run_records()
    assert scalars_of(trust) is None
    assert scalars_of(SwarmRecord(step=2, version=2, peers=[])) is None
    number, values = scalars_of(step)
    assert number == 2 and values["train/reward"] == 0.25 and values["train/version"] == 2
    assert values["train/bucket_pass_rates/1"] == 0.5 and values["train/staleness_counts/1"] == 2
    assert "train/step" not in values and "train/policy_loss" not in values  # None: not logged
    number, values = scalars_of(after)
    assert number == 4 and values["eval/pass1"] == 0.375 and "eval/label" not in values
    assert scalars_of(supervised)[1]["supervised/sft_nll"] == 2.5


def test_every_tracker_reads_back_the_records_of_the_metrics_log(tmp_path: Path,
                                                                  offline_trackers: None) -> None:
    run_name = f"unit-{tmp_path.name}"
    trackers = Trackers.open(["tensorboard", "wandb", "trackio"], tmp_path, run_name,
                             {"seed": 0})
    metrics = MetricsLog(tmp_path / "metrics.jsonl", 0.0, trackers)
    records = [metrics.write(record) for record in run_records()]
    metrics.close()
    assert trackers.trackers == []  # closed
    expected = expected_series(records)
    assert expected["train/reward"] == [(2, 0.25), (3, 0.375), (4, 0.5)]
    assert expected["eval/pass1"] == [(0, 0.125), (4, 0.375)]
    assert_same_series(tensorboard_series(tmp_path / "tensorboard"), expected)
    assert_same_series(wandb_series(tmp_path / "wandb"), expected)
    assert_same_series(trackio_series(run_name), expected)


def test_trackio_stores_in_the_run_folder(tmp_path: Path, offline_trackers: None) -> None:
    # trackio fixes its folder when first imported: a process of its own shows where a run's
    # first import puts it.
    script = textwrap.dedent(f"""
        import json, os
        from pathlib import Path
        from decentrl.observe.metrics import MetricsLog, StepRecord
        from decentrl.observe.trackers import PROJECT, Trackers
        run = Path({str(tmp_path)!r})
        metrics = MetricsLog(run / "metrics.jsonl", 0.0, Trackers.open(["trackio"], run, "own", {{}}))
        metrics.write(StepRecord(step=1, version=1, reward=0.75, accuracy=0.5, staleness_mean=0))
        metrics.close()
        from trackio.sqlite_storage import SQLiteStorage
        (run / "found.json").write_text(json.dumps({{
            "inherited": "TRACKIO_DIR" in os.environ,
            "database": str(SQLiteStorage.get_project_db_path(PROJECT)),
            "logs": SQLiteStorage.get_logs(PROJECT, "own")}}))
    """)
    subprocess.run([sys.executable, "-c", script], capture_output=True, check=True)
    found = json.loads((tmp_path / "found.json").read_text())
    assert found["database"] == str(tmp_path / "trackio" / f"{PROJECT}.db")
    assert not found["inherited"]  # set for trackio's import only
    assert [(row["step"], row["train/reward"]) for row in found["logs"]] == [(1, 0.75)]


def test_report_to_takes_known_trackers_once() -> None:
    assert parse_config({"host": {"report_to": "wandb"}}).host.report_to == ("wandb",)
    assert parse_config({}).host.report_to == ()
    with pytest.raises(ConfigError, match=r"host.report_to.1: Input should be 'tensorboard', "
                                          r"'wandb' or 'trackio'"):
        parse_config({"host": {"report_to": ["tensorboard", "mlflow"]}})
    with pytest.raises(ConfigError, match="names wandb more than once"):
        parse_config({"host": {"report_to": ["wandb", "trackio", "wandb"]}})


def test_a_missing_package_is_refused_before_any_tracker_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"host.report_to: wandb not installed here; "
                                          r"pip install 'decentrl\[trackers\]'"):
        Trackers.open(["tensorboard", "wandb"], tmp_path, "missing", {})
    assert not (tmp_path / "tensorboard").exists()


class BrokenTracker:
    name = "broken"

    def __init__(self) -> None:
        self.calls = 0

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.calls += 1
        raise OSError("No space left on device")

    def close(self) -> None:
        raise AssertionError("a dropped tracker is not closed")


def test_a_tracker_failing_mid_run_is_dropped_with_one_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    broken = BrokenTracker()
    trackers = Trackers([broken, TensorBoardTracker(tmp_path)])
    metrics = MetricsLog(tmp_path / "metrics.jsonl", 0.0, trackers)
    with caplog.at_level(logging.WARNING, logger="decentrl.observe.trackers"):
        records = [metrics.write(record) for record in run_records()]
        metrics.close()
    assert broken.calls == 1
    assert [r.message for r in caplog.records] == [
        "tracker broken failed (OSError: No space left on device); the run goes on without it"]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == len(records)
    assert_same_series(tensorboard_series(tmp_path / "tensorboard"), expected_series(records))


def test_wandb_is_offline_unless_the_user_chose() -> None:
    assert wandb_mode({}) == "offline"
    assert wandb_mode({"WANDB_API_KEY": "key"}) is None
    assert wandb_mode({"WANDB_MODE": "online"}) is None


def test_wandb_logs_offline_when_it_cannot_start_online(
        tmp_path: Path, offline_trackers: None, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    init = wandb.init

    def no_network(mode: str | None = None, **options: object) -> object:
        if mode != "offline":
            raise wandb.errors.CommError("network unreachable")
        return init(mode=mode, **options)

    monkeypatch.setattr(wandb, "init", no_network)
    with caplog.at_level(logging.WARNING, logger="decentrl.observe.trackers"):
        tracker = WandbTracker(tmp_path, "fallback", {})
    tracker.log({"train/reward": 0.5}, step=1)
    tracker.close()
    assert "W&B could not start online (network unreachable)" in caplog.text
    assert tracker.directory.name.startswith("offline-run-")
    assert wandb_series(tmp_path / "wandb") == {"train/reward": [(1, 0.5)]}

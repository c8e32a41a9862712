"""The learning-curve bench on a hand-written run folder, and vs-trl's choice of the evaluation to
report at each budget checkpoint (neither needs TRL or a model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import learning_curve, vs_trl
from decentrl.evaluate.runner import EvalResult
from decentrl.evaluate.stats import Accuracy


def eval_event(label: str, step: int, elapsed: float, pass1: float) -> dict:
    return {"event": "eval", "elapsed_s": elapsed, "label": label, "step": step,
            "task": "sums", "problems": 200, "pass1": pass1, "pass1_low": pass1 - 0.05,
            "pass1_high": pass1 + 0.05}


def test_learning_curve_prints_tables_and_writes_plot(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    records = [eval_event("before", 0, 5.0, 0.30)]
    for step in range(1, 21):
        records.append({"event": "step", "elapsed_s": 5.0 + 2 * step, "step": step,
                        "version": step, "reward": 0.1 + step / 40, "accuracy": step / 40,
                        "staleness_mean": 1.0})
    records.append(eval_event("after", 20, 60.0, 0.55))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    learning_curve.main(["--run", str(tmp_path), "--every", "10"])

    out = capsys.readouterr().out
    assert "before" in out and "after" in out
    assert "30.0% [25.0, 35.0]" in out and "55.0% [50.0, 60.0]" in out
    assert "1-10" in out and "11-20" in out
    assert (tmp_path / "learning_curve.png").read_bytes().startswith(b"\x89PNG")


def test_learning_curve_without_metrics_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--train"):
        learning_curve.main(["--run", str(tmp_path)])


def test_moving_average_is_trailing() -> None:
    assert learning_curve.moving_average([0.0, 1.0, 2.0, 3.0], 2) == [0.0, 0.5, 1.5, 2.5]


def test_at_checkpoints_takes_the_last_eval_at_or_before_each_time() -> None:
    point = vs_trl.EvalPoint
    before = point(0.0, 0, 0.2, 0.1, 0.3, "before")
    early = point(40.0, 10, 0.3, 0.2, 0.4, "during")
    late = point(80.0, 20, 0.5, 0.4, 0.6, "during")
    end = point(98.5, 24, 0.6, 0.5, 0.7, "end")
    # Out of order on purpose: the choice is by time, not by position in the list.
    chosen = vs_trl.at_checkpoints([late, before, end, early], [0.0, 25.0, 40.0, 75.0, 100.0])
    assert chosen == [before, before, early, early, end]
    assert vs_trl.at_checkpoints([early], [10.0]) == [None]


def test_vs_trl_compares_greedy_pass1_on_both_sides() -> None:
    """decentrl's own evaluation samples pass@1 (training-shaped) and reports greedy beside it;
    TRL's is greedy: a point takes the greedy one wherever there is one."""
    sampled, greedy = Accuracy.from_counts(30, 100), Accuracy.from_counts(60, 100)
    own = EvalResult(task="sums", split="heldout", problems=100, pass1=sampled, pass_k=None, k=1,
                     mean_completion_tokens=9.0, samples=[], pass1_temperature=1.0,
                     greedy_pass1=greedy)
    trl = EvalResult(task="sums", split="heldout", problems=100, pass1=greedy, pass_k=None, k=1,
                     mean_completion_tokens=9.0, samples=[])
    for result in (own, trl):
        assert vs_trl.point(result, 12.0, 3, "during") == vs_trl.EvalPoint(
            12.0, 3, greedy.mean, greedy.low, greedy.high, "during")


def test_training_clock_excludes_pauses_after_start_only(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    monkeypatch.setattr(vs_trl.time, "perf_counter", lambda: now[0])
    clock = vs_trl.TrainingClock()
    with clock.paused():  # the evaluation before training: not training time, never subtracted
        now[0] = 30.0
    clock.start()
    now[0] = 40.0
    with clock.paused():
        now[0] = 45.0
        assert clock.seconds() == 10.0  # frozen while paused
        now[0] = 60.0
    now[0] = 70.0
    assert clock.seconds() == 20.0
    clock.stop()
    now[0] = 100.0
    assert clock.seconds() == 20.0
    assert clock.paused_s == 50.0

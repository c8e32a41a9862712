"""The small pieces of the operator's view: JSON-lines logs, and the throughput the dashboard
derives from step records."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from decentrl.observe.live import dashboard_steps
from decentrl.observe.logs import configure_logging
from decentrl.observe.metrics import EvalRecord, MetricsLog, StepRecord, read_metrics


def test_logs_are_json_lines_with_their_extra_fields(tmp_path: Path,
                                                     restored_logging: None) -> None:
    path = tmp_path / "logs" / "coordinator.jsonl"
    configure_logging("coordinator", json_file=path)
    logging.getLogger("decentrl.swarm").info("step done", extra={"step": 3, "version": 3})
    logging.getLogger("somebody.else").info("chatter nobody asked for")
    try:
        raise ValueError("bad tensor")
    except ValueError:
        logging.getLogger("decentrl.net").exception("request refused")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["message"] for line in lines] == ["step done", "request refused"]
    first, second = lines
    assert first["level"] == "info" and first["logger"] == "decentrl.swarm"
    assert first["process"] == "coordinator" and (first["step"], first["version"]) == (3, 3)
    assert first["time"].endswith("+00:00")
    assert second["level"] == "error" and "ValueError: bad tensor" in second["exception"]


def step(number: int, elapsed_s: float, generated_tokens: float | None) -> StepRecord:
    return StepRecord(step=number, version=number, reward=0.5, accuracy=0.5, staleness_mean=0.0,
                      elapsed_s=elapsed_s, generated_tokens=generated_tokens)


def test_throughput_is_tokens_over_the_time_since_the_step_before() -> None:
    steps = [step(1, 100.0, 500.0), step(2, 110.0, 400.0),
             step(3, 130.0, None),  # an older record: no generated_tokens
             step(4, 5.0, 300.0)]  # a restarted clock
    out = dashboard_steps(steps)
    assert "tokens_per_s" not in out[0]  # its interval holds the evaluation before training
    assert out[1]["tokens_per_s"] == 40.0
    assert "tokens_per_s" not in out[2] and "tokens_per_s" not in out[3]
    assert [row["step"] for row in out] == [1, 2, 3, 4]
    assert "generated_tokens" not in out[1]  # the dashboard draws only STEP_KEYS


def test_an_eval_record_reads_back_with_or_without_greedy_pass1(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, started=0.0)
    greedy = log.write(EvalRecord(label="after", step=3, pass1=0.4, pass1_low=0.3,
                                  pass1_high=0.5, greedy_pass1=0.6, greedy_pass1_low=0.45,
                                  greedy_pass1_high=0.73))
    # A line written before greedy pass@1 existed.
    with path.open("a") as f:
        f.write(json.dumps({"event": "eval", "elapsed_s": 1.0, "label": "before", "step": 0,
                            "pass1": 0.1, "pass1_low": 0.05, "pass1_high": 0.2}) + "\n")
    read, older = read_metrics(path).evals
    assert read == greedy
    assert (read.greedy_pass1, read.greedy_pass1_low, read.greedy_pass1_high) == (0.6, 0.45, 0.73)
    assert older.pass1 == 0.1
    assert (older.greedy_pass1, older.greedy_pass1_low, older.greedy_pass1_high) == (None,) * 3

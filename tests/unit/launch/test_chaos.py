"""`decentrl demo --chaos`: the kill-and-restart loop (launch/local_swarm.py `LocalSwarm.chaos`)
and its report (demo.py `chaos_reporter`): each kill and its end on the terminal and as a
"chaos" record in metrics.jsonl, which the simulator replays (sim/calibration.py)."""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path

from rich.console import Console

from decentrl.demo import chaos_reporter
from decentrl.launch.local_swarm import LocalSwarm
from decentrl.observe.metrics import MetricsLog, read_metrics


class RestartsTwice:
    """A swarm whose second restart times out and whose third is the last before the stop."""

    def __init__(self, stop: threading.Event) -> None:
        self.children = {"infer0.0": None, "infer1.0": None, "train0": None}
        self.stop, self.restarted = stop, list[str]()

    def restart(self, name: str) -> None:
        self.restarted.append(name)
        if len(self.restarted) == 2:
            raise TimeoutError(f"{name} was not ready in 300 s")
        if len(self.restarted) == 3:
            self.stop.set()


def test_chaos_reports_each_kill_and_its_end_on_the_terminal_and_in_the_metrics(
        tmp_path: Path) -> None:
    stop = threading.Event()
    swarm = RestartsTwice(stop)
    metrics = MetricsLog(tmp_path / "metrics.jsonl", time.time())
    screen = io.StringIO()
    LocalSwarm.chaos(swarm, stop, 0.0, 7,  # type: ignore[arg-type]
                     chaos_reporter(Console(file=screen, width=200), metrics))
    records = read_metrics(tmp_path / "metrics.jsonl").chaos
    first, second, third = swarm.restarted
    assert [(r.peer, r.action) for r in records] == [
        (first, "killed"), (first, "back"), (second, "killed"), (second, "not back"),
        (third, "killed"), (third, "back")]
    assert records[3].detail == f"{second} was not ready in 300 s"
    assert f"chaos: {second} did not come back: {second} was not ready in 300 s" \
        in screen.getvalue()
    # A seed kills the same peers in the same order.
    again = RestartsTwice(threading.Event())
    LocalSwarm.chaos(again, again.stop, 0.0, 7,  # type: ignore[arg-type]
                     lambda peer, action, detail: None)
    assert again.restarted == swarm.restarted

"""The coordinator's dashboard: its HTTP endpoints, and the page as Debian's headless Chromium
renders it (the DOM it builds from a run's state, and a screenshot whose charts hold real data)."""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest
from browser import chromium, read_page
from PIL import Image

from decentrl.observe.dashboard import DashboardServer

STEPS = 20
INJECTED = '<script>window.injected = 1</script><img src="x" onerror="window.injected = 2">'
PEER_NAMES = [f"s{stage}-{role}" for stage in range(2)
              for role in ("infer-0", "infer-1", "learner")]


def peer_id(name: str) -> str:
    """A libp2p-looking id: the shared "12D3KooW" prefix, then characters particular to the peer."""
    return "12D3KooW" + hashlib.sha256(name.encode()).hexdigest()[:44]


def accuracy_at(step: int) -> float:
    return round(0.06 + 0.03 * step, 3)


def run_state() -> dict[str, Any]:
    """A run 20 steps in: accuracy rising from 0.09 to 0.66, two stages of three peers, a held-out
    evaluation before and after, and a verification failure whose detail carries markup."""
    steps = [{"step": step, "elapsed_s": 140.0 + 15.0 * step, "version": step,
              "reward": round(accuracy_at(step) + 0.08, 3), "accuracy": accuracy_at(step),
              "staleness_mean": 0.5 if step % 3 == 0 else 0.25,
              "completion_tokens_mean": 16.9, "train_s": 7.7, "wait_s": 4.8, "sequences": 24,
              "tokens_per_s": 40.0 + step}
             for step in range(1, STEPS + 1)]
    evals = [{"label": "before", "step": 0, "elapsed_s": 124.7, "task": "sums", "problems": 200,
              "pass1": 0.145, "pass1_low": 0.10, "pass1_high": 0.20, "pass_k": 0.115, "k": 4},
             {"label": "after", "step": STEPS, "elapsed_s": 455.0, "task": "sums", "problems": 200,
              "pass1": 0.62, "pass1_low": 0.55, "pass1_high": 0.68, "pass_k": 0.71, "k": 4}]
    stages = [{"stage": stage, "layers": [16 * stage, 16 * stage + 15],
               "peers": [{"peer_id": peer_id(name), "name": name,
                          "role": "learner" if name.endswith("learner") else "inference",
                          "version": STEPS - (1 if name == "s1-infer-1" else 0),
                          "tokens_per_s": 85.0, "bytes_sent": 123_456_789,
                          "reputation": 0.2 if name == "s1-infer-1" else 1.0,
                          "banned": name == "s1-infer-1"}
                         for name in PEER_NAMES if name.startswith(f"s{stage}-")]}
              for stage in range(2)]
    updates = [{"stage": stage, "learner_version": STEPS, "replicas": 2, "replicas_current": 1,
                "oldest_replica_version": STEPS - 1} for stage in range(2)]
    events = [{"time": 1764770000.0 + 30 * i, "elapsed_s": 200.0 + 30 * i,
               "peer": peer_id("s0-infer-0"), "name": "s0-infer-0", "stage": 0,
               "outcome": "passed", "detail": "spot check matched"} for i in range(3)]
    events.append({"time": 1764770100.0, "elapsed_s": 300.1, "peer": peer_id("s1-infer-1"),
                   "name": "s1-infer-1", "stage": 1, "outcome": "failed",
                   "detail": f"activations differ at layer 20 {INJECTED}"})
    return {"run": "demo", "phase": "training", "elapsed_s": 460.0, "training_s": 330.0,
            "step": STEPS,
            "version": STEPS, "max_steps": 1000, "time_budget_s": 720, "steps": steps,
            "evals": evals, "stages": stages, "updates": updates,
            "trust": {"verified": 3, "verify_failed": 1, "verify_skipped": 0, "flagged": 1,
                      "banned": 1},
            "trust_events": events}


@pytest.fixture(scope="module")
def dashboard() -> Iterator[DashboardServer]:
    with DashboardServer(run_state) as server:
        yield server


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_state_endpoint_answers_the_state_as_json(dashboard: DashboardServer) -> None:
    status, body = get(dashboard.url + "api/state")
    assert status == 200
    assert json.loads(body) == run_state()


def test_page_and_unknown_paths(dashboard: DashboardServer) -> None:
    status, body = get(dashboard.url)
    assert status == 200 and b"<canvas" in body
    assert get(dashboard.url + "api/other")[0] == 404
    assert get(dashboard.url + "index.html")[0] == 404


def test_a_failing_state_answers_500_and_the_server_goes_on() -> None:
    calls = 0

    def flaky_state() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("coordinator busy")
        return {"run": "demo", "reward": float("nan")}

    with DashboardServer(flaky_state) as server:
        status, body = get(server.url + "api/state")
        assert status == 500 and "coordinator busy" in json.loads(body)["error"]
        status, body = get(server.url + "api/state")
        # NaN is no JSON number: the browser would reject the whole document over it.
        assert status == 200 and json.loads(body) == {"run": "demo", "reward": None}


def test_only_loopback_hosts_are_served() -> None:
    for host in ("0.0.0.0", "", "192.168.1.10", "example.com", "::"):
        with pytest.raises(ValueError, match="loopback"):
            DashboardServer(run_state, host=host)
    with DashboardServer(run_state, host="localhost") as server:
        assert get(server.url + "api/state")[0] == 200


def test_a_request_naming_another_host_is_refused(dashboard: DashboardServer) -> None:
    # What a DNS-rebinding page sends: our address, but its own name in the Host header.
    request = urllib.request.Request(dashboard.url + "api/state",
                                     headers={"Host": "attacker.example:80"})
    with pytest.raises(urllib.error.HTTPError, match="HTTP Error 421") as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 421


def test_a_stalled_client_holds_up_neither_others_nor_close() -> None:
    # The stalled client is never timed out here, so a close() that waited for it would never
    # return: returning at all is the proof, with no time measured.
    server = DashboardServer(run_state, client_timeout_s=None)
    server.start()
    host, port = urlsplit(server.url).hostname, urlsplit(server.url).port
    with socket.create_connection((host, port)) as stalled:
        stalled.sendall(b"GET /api/state HTTP/1.1\r\n")  # and never finishes its request
        assert get(server.url + "api/state")[0] == 200
        closed = threading.Event()

        def close() -> None:
            server.close()
            closed.set()
        closer = threading.Thread(target=close, name="close-dashboard")
        closer.start()
        # A deadlock guard, not a measurement: close() takes milliseconds unless it waits for
        # the stalled client, which then never comes. Leaving the `with` frees it either way.
        assert closed.wait(timeout=120), "close() waited for the stalled client"
        # close() returned while the stalled client's request is still unanswered and open.
        stalled.setblocking(False)
        with pytest.raises(BlockingIOError, match="Resource temporarily unavailable"):
            stalled.recv(1)
    closer.join()


def test_close_is_idempotent_and_stops_serving() -> None:
    server = DashboardServer(run_state)
    server.start()
    url = server.url
    server.close()
    server.close()
    with pytest.raises(urllib.error.URLError, match="Connection refused"):
        urllib.request.urlopen(url + "api/state", timeout=5)


def test_the_page_renders_the_runs_state_in_chromium(dashboard: DashboardServer,
                                                     tmp_path: Path) -> None:
    dom = chromium(dashboard.url, tmp_path / "profile", "--dump-dom")
    text, tags = read_page(dom)

    assert "live · updated" in text, text[:500]
    for name in PEER_NAMES:
        assert name in text
    assert "Stage 1 · layers 16–31 · 3 peers" in text
    assert f"step {STEPS} of 1000" in text
    assert "trained 5m 30s of 12m 00s" in text  # the budget counts from the start of training
    assert f"{accuracy_at(STEPS):.3f}" in text  # the latest accuracy
    assert "…" + peer_id("s0-learner")[-8:] in text
    assert "117.7 MiB" in text  # bytes sent, in human units
    assert "19 (−1)" in text  # the banned peer's version, one behind the learner
    assert "failed activations differ at layer 20" in text
    # The peer's markup is shown as text, and became no element.
    assert INJECTED in text
    assert tags.count("script") == 1 and "img" not in tags
    assert 'class="failure"' in dom


def test_the_page_renders_a_run_that_has_barely_started(tmp_path: Path) -> None:
    early = {"run": "early", "phase": "waiting", "steps": [], "stages": [{"stage": 0}],
             "trust": None, "trust_events": [{}]}
    with DashboardServer(lambda: early) as server:
        text, _ = read_page(chromium(server.url, tmp_path / "profile", "--dump-dom"))
    assert "live · updated" in text and "could not draw" not in text, text
    assert "Stage 0 · 0 peers no peers" in text
    assert "no updates in flight" in text and "no evaluation yet" in text


def test_the_page_says_when_the_connection_is_lost(tmp_path: Path) -> None:
    server = DashboardServer(lambda: served_once())

    def served_once() -> dict[str, Any]:
        # Stops listening before this first answer is even sent: every later poll is refused.
        server.close()
        return run_state()

    server.start()
    try:
        dom = chromium(server.url, tmp_path / "profile", "--dump-dom")
    finally:
        server.close()
    text, _ = read_page(dom)
    assert "connection lost · retrying every 2 s" in text
    assert "s1-infer-1" in text  # the last state it had stays on the page, dimmed
    assert '<body class="stale">' in dom


def test_the_screenshot_shows_the_curves(dashboard: DashboardServer, tmp_path: Path) -> None:
    screenshot = tmp_path / "dashboard.png"
    chromium(dashboard.url, tmp_path / "profile", f"--screenshot={screenshot}",
             "--window-size=1400,1000", "--hide-scrollbars")
    image = np.asarray(Image.open(screenshot).convert("RGB"), dtype=np.int16)
    assert image.shape == (1000, 1400, 3)

    def pixels_near(color: str) -> tuple[np.ndarray, np.ndarray]:
        """The (y, x) of the pixels within antialiasing distance of `color`."""
        target = np.array([int(color[i:i + 2], 16) for i in (1, 3, 5)], dtype=np.int16)
        ys, xs = np.nonzero((np.abs(image - target) <= 30).all(axis=2))
        return ys, xs

    accuracy_y, accuracy_x = pixels_near("#16a34a")
    # A line across a chart is hundreds of pixels; a legend swatch is a few dozen.
    assert accuracy_x.size > 400
    assert pixels_near("#2563eb")[0].size > 200  # reward
    assert pixels_near("#7c3aed")[0].size > 200  # throughput
    assert pixels_near("#ea580c")[0].size > 40  # the two evaluations and their error bars
    # Accuracy rises over the run: its line sits higher (smaller y) on the right than on the left.
    left, right = np.quantile(accuracy_x, [0.25, 0.75])
    assert accuracy_y[accuracy_x >= right].mean() < accuracy_y[accuracy_x <= left].mean() - 50

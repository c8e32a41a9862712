"""What a user who mistypes sees: one line that names the problem, exit code 2, no traceback, and
nothing deleted; waits that say what they wait for and stop on Ctrl-C; help that reads as
sentences. Commands run through typer's runner, or as real processes where signals and the p2p
daemon are part of what is tested."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from helpers import unanswered_peer_address
from swarm_helpers import tiny_run_config
from typer.testing import CliRunner, Result

from decentrl import cli, demo
from decentrl.cli import app, print_join_event
from decentrl.config import RunConfig
from decentrl.coordinator.stage_wait import stages_lacking
from decentrl.envs import AGENTIC_ENVIRONMENTS, make_task_or_environment
from decentrl.net.directory import Directory
from decentrl.net.link import LinkProfile
from decentrl.net.node import SwarmNode
from decentrl.net.protocol import PeerRecord, Role, stage_key
from decentrl.net.wire import TensorLimits, encode_struct

UNUSED_PEER_ID = "12D3KooWJGBqqn7rRqELaz3AxHTAUHtWH1Dj2L9H5nryw5SeGVx6"


def invoke(*args: str) -> Result:
    return CliRunner().invoke(app, list(args))


def assert_refused(result: Result, *fragments: str) -> None:
    """Exit code 2, one `error:` line (wrapped or not) that holds every fragment, no traceback."""
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output, result.output
    text = " ".join(result.output.split())
    assert text.startswith("error:"), result.output
    for fragment in fragments:
        assert fragment in text, (fragment, result.output)


def run_cli(*args: str, timeout: float = 120, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "decentrl.cli", *args], capture_output=True,
                          text=True, timeout=timeout, **kwargs)


def assert_one_line_failure(done: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert done.returncode == 2, (done.stdout, done.stderr)
    for stream in (done.stdout, done.stderr):
        assert "Traceback" not in stream and "Task exception" not in stream, stream
    error = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1, done.stderr
    for fragment in fragments:
        assert fragment in error[0], (fragment, done.stderr)


@pytest.fixture
def bootstrap() -> Any:
    node = SwarmNode.start("bootstrap", [], LinkProfile(), TensorLimits())
    try:
        yield node
    finally:
        node.shutdown()


# ---- join -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("address", "fragment"), [
    ("garbage", "peer address 'garbage' is not a multiaddr"),
    ("/ip4/127.0.0.1/tcp/4001", "lacks its /p2p/<peer id> part"),
    ("/ip4/1.2.3/tcp/4001/p2p/" + UNUSED_PEER_ID, "is not a multiaddr"),
])
def test_join_refuses_a_bad_address_before_the_daemon_starts(address: str, fragment: str,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    def no_daemon(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the daemon started")

    monkeypatch.setattr(SwarmNode, "start", no_daemon)
    assert_refused(invoke("join", "--initial-peers", address, "--run", "demo", "--owner",
                          UNUSED_PEER_ID), fragment, "use the address the peer printed")


def test_join_refuses_an_owner_that_is_not_a_peer_id(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_daemon(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the daemon started")

    monkeypatch.setattr(SwarmNode, "start", no_daemon)
    assert_refused(invoke("join", "--initial-peers", f"/ip4/127.0.0.1/tcp/1/p2p/{UNUSED_PEER_ID}",
                          "--run", "demo", "--owner", "0"), "--owner: '0' is not a peer id")


def test_a_training_peer_needs_a_key_file_to_be_admitted(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.setattr(SwarmNode, "start", lambda *args, **kwargs: None)
    assert_refused(invoke("join", "--initial-peers", f"/ip4/127.0.0.1/tcp/1/p2p/{UNUSED_PEER_ID}",
                          "--run", "demo", "--owner", UNUSED_PEER_ID, "--role", "training"),
                   "a training peer needs --identity FILE")


@pytest.mark.network
def test_join_says_when_no_initial_peer_answers() -> None:
    with unanswered_peer_address(UNUSED_PEER_ID) as address:
        assert_refused(invoke("join", "--initial-peers", address, "--run", "demo", "--owner",
                              UNUSED_PEER_ID),
                       f"none of the initial peers answered ({address})",
                       "check that the peer is running")


@pytest.mark.network
def test_join_with_a_mistyped_run_waits_as_told_then_says_what_to_check(
        bootstrap: SwarmNode) -> None:
    done = run_cli("join", "--initial-peers", bootstrap.addresses()[0], "--run", "typo",
                   "--owner", bootstrap.peer_id, "--wait", "3")
    owner = bootstrap.peer_id[-8:]
    assert f"waiting for the owner {owner} of run 'typo' to announce it (up to 3s)" in done.stderr
    assert_one_line_failure(done, f"the owner {owner} of run 'typo' announced nothing within 3s",
                            "check the run name")


@pytest.mark.network
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_the_wait_for_a_config_stops_on_ctrl_c_and_sigterm(bootstrap: SwarmNode,
                                                           signum: int) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "decentrl.cli", "join", "--initial-peers",
         bootstrap.addresses()[0], "--run", "typo", "--owner", bootstrap.peer_id],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert process.stderr is not None
        # The handlers are installed before this line is printed: the signal lands in the wait.
        assert "waiting for the owner" in process.stderr.readline()
        process.send_signal(signum)
        # A process that ignored the signal would wait out its 300 s and time out here.
        stdout, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0, stderr
    assert "stopped before the run's owner announced it" in stderr
    assert "Traceback" not in stderr + stdout and "Task exception" not in stderr


def test_a_joined_peer_says_in_words_what_it_serves(capsys: pytest.CaptureFixture[str]) -> None:
    address = f"/ip4/127.0.0.1/tcp/4001/p2p/{UNUSED_PEER_ID}"
    print_join_event({"sockets": ["/tmp/x.sock"]})  # for launchers only
    print_join_event({"ready": "DECENTRL-READY", "name": "laptop", "peer_id": UNUSED_PEER_ID,
                      "run": "demo", "addresses": [address], "stage": 1, "num_stages": 2,
                      "layers": "15-29", "role": "inference"})
    out = capsys.readouterr().out
    assert "x.sock" not in out and "{" not in out
    assert "joined run demo as laptop: stage 1 of 2, layers 15-29, inference" in out
    assert f"listening on {address} (reachable from this machine only)" in out


# ---- coordinate -----------------------------------------------------------------------------

@pytest.mark.network
def test_coordinate_checks_the_config_against_the_model_before_it_announces(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    config = tiny_run_config(tiny_model_dir, 5, host={"run_dir": str(tmp_path / "runs"), "threads": 1})
    path = tmp_path / "run.json"
    path.write_text(config.model_dump_json())
    done = run_cli("coordinate", "--config", str(path), "--wait", "5")
    assert_one_line_failure(done, "num_stages must be in [1, 4] for a 4-layer model, got 5")
    assert "peers join" not in done.stdout
    assert not (config.path / "join.txt").exists()


@pytest.mark.network
def test_coordinate_prints_the_join_command_on_one_line_and_says_what_it_waited_for(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    config = tiny_run_config(tiny_model_dir, 2, host={"run_dir": str(tmp_path / "runs"), "threads": 1})
    path = tmp_path / "run.json"
    path.write_text(config.model_dump_json())
    done = run_cli("coordinate", "--config", str(path), "--wait", "2")
    saved = (config.path / "join.txt").read_text().strip()
    assert saved.startswith(f"decentrl join --run {config.name} --owner 12D3KooW") \
        and " --stage auto --initial-peers /ip4/127.0.0.1/tcp/" in saved \
        and "/p2p/12D3KooW" in saved
    assert saved in done.stdout.splitlines()  # one line, however narrow the terminal
    assert_one_line_failure(done, "after 2s of waiting, stage 0 has no inference replica and no "
                                  "admitted training peer ready; stage 1 has")


def test_the_coordinator_says_what_each_stage_lacks() -> None:
    def record(stage: int, role: Role, ready: bool = False) -> PeerRecord:
        return PeerRecord(name="p", stage=stage, layers=(0, 2), role=role, version=0,
                          tokens_per_s=0.0, free_sessions=4, training_ready=ready)

    admitted = {"trainer0", "trainer1", "loading"}.__contains__
    assert stages_lacking([[("i", record(0, "inference")),
                            ("trainer0", record(0, "training", ready=True))],
                           [("trainer1", record(1, "both", ready=True))]], admitted) == []
    assert stages_lacking([[("loading", record(0, "training")),
                            ("12D3KooWstranger", record(0, "training", ready=True))], []],
                          admitted) == [
        "stage 0 has no inference replica and no admitted training peer ready (1 loading; not "
        "admitted: stranger)",
        "stage 1 has no inference replica and no admitted training peer ready"]


class DictNode:
    """The two calls Directory.refresh makes of a node, over a dict of DHT entries."""

    def __init__(self) -> None:
        self.entries: dict[str, dict[str, bytes]] = {}

    async def lookup(self, key: str) -> dict[str, bytes]:
        return dict(self.entries.get(key, {}))

    def run(self, coroutine: Any, timeout: float) -> Any:
        import asyncio

        return asyncio.run(coroutine)


def test_the_directory_tells_of_each_peer_that_joins_or_leaves(tiny_model_dir: Path) -> None:
    config = tiny_run_config(tiny_model_dir, 2)
    node = DictNode()
    changes: list[tuple[str, str, bool]] = []
    directory = Directory(node, config.name, 2, config.swarm,  # type: ignore[arg-type]
                          on_change=lambda peer, record, joined: changes.append(
                              (peer, record.name, joined)))
    record = PeerRecord(name="a", stage=1, layers=(2, 4), role="inference", version=0,
                        tokens_per_s=0.0, free_sessions=4, training_ready=False)
    node.entries[stage_key(config.name, 1)] = {"peerA": encode_struct(record)}
    directory.refresh()
    directory.refresh()  # a renewed announcement is not a new peer
    assert changes == [("peerA", "a", True)]
    node.entries.clear()
    directory.refresh()
    assert changes == [("peerA", "a", True), ("peerA", "a", False)]


# ---- train, eval, demo ----------------------------------------------------------------------

def test_train_says_a_folder_is_not_a_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert_refused(invoke("train", "--config", str(tmp_path)), "is a folder, not a file",
                   f"the config of the run in it is {tmp_path / 'config.json'}")


def test_an_unknown_task_lists_the_environments_too() -> None:
    with pytest.raises(ValueError, match="unknown task 'sumz'") as refused:
        make_task_or_environment("sumz", {})
    assert all(name in str(refused.value) for name in ("sums", *AGENTIC_ENVIRONMENTS))


def test_the_demo_deletes_an_earlier_run_only(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    notes = tmp_path / "runs" / "mine" / "notes.txt"
    notes.parent.mkdir(parents=True)
    notes.write_text("keep me")
    assert_refused(invoke("demo", "--name", "mine"), "runs/mine exists and does not hold a run",
                   "choose another --name")
    assert notes.read_text() == "keep me"


def test_the_netns_demo_refuses_without_privileges_or_with_local(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from decentrl.net import netns

    monkeypatch.chdir(tmp_path)
    assert_refused(invoke("demo", "--local", "--netns"), "--local runs every stage in one "
                   "process; --netns needs a swarm")
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert_refused(invoke("demo", "--netns"), "--netns: building network namespaces needs root")
    assert not (tmp_path / "runs").exists()  # refused before anything was made


def test_the_adversarial_demo_runs_one_honest_replica_per_stage_unless_told(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    seen: list[tuple[int, bool]] = []

    def record(config: RunConfig, console: object, chaos_every: object, adversaries: bool,
               netns: bool) -> None:
        seen.append((config.swarm.inference_replicas, adversaries))
    monkeypatch.setattr(demo, "run_swarm_demo", record)
    for args in (("demo",), ("demo", "--adversaries"),
                 ("demo", "--adversaries", "--set", "swarm.inference_replicas=2")):
        assert invoke(*args).exit_code == 0
    assert seen == [(2, False), (1, True), (2, True)]


def test_bad_network_options_of_join_and_relay_are_refused() -> None:
    peer = "/ip4/203.0.113.5/tcp/31337/p2p/12D3KooWRUJjzVFzWkuVW3D1X9XUA2tfMHW6a76CUQrd4di1jsYk"
    owner = peer.rsplit("/", 1)[1]
    join = ("join", "--run", "r", "--owner", owner, "--initial-peers", peer)
    assert_refused(invoke(*join, "--reachability", "sometimes"),
                   "--reachability must be one of loopback, auto, direct, relayed")
    assert_refused(invoke(*join, "--relay", "/ip4/203.0.113.6/tcp/1"),
                   "lacks its /p2p/<peer id> part")
    assert_refused(invoke(*join, "--announce", "/ip4/203.0.113.7/tcp/0"),
                   "needs an explicit port")
    assert_refused(invoke("relay", "--listen", "/ip4/127.0.0.1/tcp/0", "--initial-peers", peer),
                   "a relay listens on an address other peers can dial")


def test_debug_shows_the_traceback_and_a_bug_is_one_line_with_exit_code_1(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    debugged = invoke("--debug", "train", "--config", str(tmp_path))
    assert isinstance(debugged.exception, ValueError) and debugged.exit_code == 1
    config = tmp_path / "run.toml"
    config.write_text('name = "x"\n')

    def broken(config: object, console: object) -> None:
        raise KeyError("stage")

    monkeypatch.setattr(demo, "run_local", broken)
    bug = invoke("train", "--config", str(config))
    assert bug.exit_code == 1 and "Traceback" not in bug.output
    assert "unexpected KeyError: 'stage' (a bug; `decentrl --debug` shows where)" in \
        " ".join(bug.output.split())


# ---- help -----------------------------------------------------------------------------------

def test_help_reads_as_sentences_and_names_every_benchmark() -> None:
    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    assert len(commands) == 10
    for name, command in commands.items():
        paragraphs = (command.help or "").split("\n\n")
        assert paragraphs[0] and paragraphs[0].endswith("."), name
        assert all("\n" not in p for p in paragraphs if not p.startswith("\b")), name
        texts = [command.help or "", *(getattr(p, "help", "") or "" for p in command.params)]
        assert not any("issue" in text.lower() or "milestone" in text.lower()
                       for text in texts), name
    bench_help = invoke("bench", "--help")
    listed = " ".join(bench_help.output.split())
    for path in Path(cli.BENCH_DIR).glob("*.py"):
        if path.stem not in ("__init__", "common"):
            assert f"- {path.stem.replace('_', '-')}: " in listed, path.stem
    assert_refused(invoke("bench", "nope"), "unknown benchmark 'nope'", "trust")


def test_every_command_lists_its_own_help() -> None:
    for name in ("demo", "train", "coordinate", "join", "eval", "export", "report", "bench"):
        result = invoke(name, "--help")
        assert result.exit_code == 0 and "Usage:" in result.output, name


def test_eval_points_from_a_run_folder_to_its_model(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "demo"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    assert_refused(invoke("eval", "--model", str(run)), "is a run folder, not a model",
                   f"decentrl export {run} {run / 'model'}")
    (run / "model").mkdir()
    (run / "model" / "config.json").write_text("{}")
    assert_refused(invoke("eval", "--model", str(run)), f"pass {run / 'model'}, its exported")

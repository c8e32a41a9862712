"""README's "Running a swarm across machines", followed as an operator would: every role a separate
`decentrl` process on a host of its own (net/netns.py). The coordinator and a relay run on the
public segment with the README's `--listen/--announce`; every stage peer sits behind one of two home
NATs and joins with the command the coordinator printed, run as it is (a training peer adds `--role
training --identity --checkpoint-dir --relay`, and the operator admits the id it prints by a line in
`admitted.txt`). The run trains, ends, its peers stop on the coordinator's RunEnded record, and the
release is exported from the run folder alone, with the shards the coordinator fetched from the
training peers' own folders, as their signed hashes say."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

import decentrl
from decentrl.coordinator.manifest import owner_identity
from decentrl.learn.checkpoints import CheckpointLayout
from decentrl.model.loading import file_sha256
from decentrl.net.netns import HomeSpec, Internet
from decentrl.release.shards import read_manifest
from tests.netns.test_netns import netns_or_skip

NUM_STAGES = 4
STEPS = 4
COORDINATOR_PORT = 31337
RELAY_PORT = 31338
PEER_READY_S = 120.0
RUN_S = 300.0
# Peers check for the RunEnded record every 10 s (launch/join.py RUN_END_CHECK_S).
PEERS_STOP_S = 60.0


# Each peer's own machine settings, which the run's config (taken from its owner) leaves out.
PEER_HOST_SETTINGS = ("--set", "host.device=cpu", "--set", "host.dtype=fp32", "--set",
                      "host.threads=1")


def run_toml(model_dir: Path, run_dir: Path, num_stages: int) -> str:
    """A short run over a tiny model: what an operator writes, in TOML."""
    return f"""
name = "operator{num_stages}"
model = "{model_dir}"
num_stages = {num_stages}

[rollout]
group_size = 4
prompts_per_step = 4
max_new_tokens = 6

[train]
steps = {STEPS}
lr = 1e-2
micro_batch_size = 8
zero_variance_groups = "keep"  # a tiny random model's rewards are all 0: train on them anyway

[eval]
problems = 8
pass_k = 1
max_new_tokens = 6
batch_size = 8

[swarm]
request_timeout_s = 20

[host]
run_dir = "{run_dir}"
device = "cpu"
dtype = "fp32"
threads = 1
"""


@dataclass
class Process:
    """A `decentrl` process on one host, its output in files of its own folder (its cwd)."""

    name: str
    folder: Path
    popen: subprocess.Popen[bytes]
    started: float

    def said(self) -> str:
        return "".join((self.folder / f).read_text(errors="replace")
                       for f in ("stdout", "stderr"))

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = re.search(pattern, self.said())
            if found:
                return found
            if self.popen.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"{self.name} did not print {pattern!r} (exit code "
                             f"{self.popen.poll()}):\n{self.said()[-3000:]}")


class Operator:
    """Starts `decentrl` commands on the internet's hosts and stops what is left at the end."""

    def __init__(self, internet: Internet, folder: Path) -> None:
        self.internet, self.folder = internet, folder
        self.processes: dict[str, Process] = {}

    def start(self, name: str, host: str, argv: list[str]) -> Process:
        """`argv` as typed (`decentrl ...`), run on `host` from a folder of its own."""
        assert argv[0] == "decentrl", argv
        folder = self.folder / name
        folder.mkdir(parents=True)
        command = self.internet.command(host, [sys.executable, "-m", "decentrl.cli", *argv[1:]])
        # The code under test, from any cwd (a relative PYTHONPATH would not reach it).
        source = str(Path(decentrl.__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [source, *filter(None, [os.environ.get("PYTHONPATH")])])}
        with (folder / "stdout").open("wb") as out, (folder / "stderr").open("wb") as err:
            popen = subprocess.Popen(command, cwd=folder, stdout=out, stderr=err, env=env,
                                     start_new_session=True)
        process = Process(name, folder, popen, time.monotonic())
        self.processes[name] = process
        return process

    def stop_all(self) -> None:
        for process in self.processes.values():
            if process.popen.poll() is None:
                os.killpg(process.popen.pid, signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.popen.pid, signal.SIGKILL)
                process.popen.wait()


def joined_after(peers: list[Process]) -> dict[str, float]:
    """Seconds from each peer's start to its "joined run" line (it serves from then on)."""
    joined: dict[str, float] = {}
    deadline = time.monotonic() + PEER_READY_S
    while len(joined) < len(peers) and time.monotonic() < deadline:
        for peer in peers:
            if peer.name not in joined and "joined run " in peer.said():
                joined[peer.name] = time.monotonic() - peer.started
            elif peer.popen.poll() is not None:
                raise AssertionError(f"{peer.name} exited:\n{peer.said()[-3000:]}")
        time.sleep(0.2)
    assert len(joined) == len(peers), [p.said()[-1000:] for p in peers if p.name not in joined]
    return joined


@contextmanager
def operator(folder: Path, num_stages: int) -> Iterator[Operator]:
    """Two homes behind NAT, a host in each for every stage's training peer and replica."""
    homes = [HomeSpec([f"home{k}-{j}" for j in range(num_stages)], uplink_mbit=50)
             for k in (1, 2)]
    with Internet.start(["coordinator", "relay"], homes) as internet:
        walk = Operator(internet, folder)
        try:
            yield walk
        finally:
            walk.stop_all()


@dataclass
class Walk:
    run_dir: Path
    steps: int
    ready_s: dict[str, float]  # each stage peer: from its start to its "joined run" line
    run_s: float  # from the coordinator's start to its exit


def walk_the_readme(model_dir: Path, folder: Path, num_stages: int) -> Walk:
    """The README's commands, in order, asserting what each says; returns what was measured."""
    config = folder / "run.toml"
    run_dir = folder / "runs" / f"operator{num_stages}"
    config.write_text(run_toml(model_dir, folder / "runs", num_stages))
    with operator(folder / "hosts", num_stages) as walk:
        public = walk.internet.hosts["coordinator"].address
        coordinator = walk.start("coordinator", "coordinator", [
            "decentrl", "coordinate", "--config", str(config),
            "--listen", f"/ip4/0.0.0.0/tcp/{COORDINATOR_PORT}",
            "--announce", f"/ip4/{public}/tcp/{COORDINATOR_PORT}"])
        coordinator.wait_for(r"peers join with this command", PEER_READY_S)
        join = shlex.split((run_dir / "join.txt").read_text())
        assert join[:2] == ["decentrl", "join"] and "--stage" in join, join
        coordinator_address = join[join.index("--initial-peers") + 1]
        assert coordinator_address.startswith(f"/ip4/{public}/tcp/{COORDINATOR_PORT}/p2p/")

        relay_host = walk.internet.hosts["relay"].address
        relay = walk.start("relay", "relay", [
            "decentrl", "relay", "--listen", f"/ip4/0.0.0.0/tcp/{RELAY_PORT}",
            "--announce", f"/ip4/{relay_host}/tcp/{RELAY_PORT}",
            "--initial-peers", coordinator_address])
        relay_address = relay.wait_for(r"relaying at (\S+)", PEER_READY_S)[1]
        assert relay_address.startswith(f"/ip4/{relay_host}/tcp/{RELAY_PORT}/p2p/")

        # Training peers: one per stage, at home 1 for even stages, home 2 for odd ones.
        trainers = [walk.start(f"train{stage}", f"home{1 + stage % 2}-{stage // 2}", [
            *join, "--stage", str(stage), "--role", "training", "--identity", "train.key",
            "--checkpoint-dir", "ckpt", "--relay", relay_address, "--name", f"train{stage}",
            *PEER_HOST_SETTINGS])
            for stage in range(num_stages)]
        ready_s = joined_after(trainers)
        for trainer in trainers:
            peer_id = trainer.wait_for(r"this training peer's id is (\S+):", PEER_READY_S)[1]
            with (run_dir / "admitted.txt").open("a") as admitted:  # README: echo ID >> ...
                admitted.write(peer_id + "\n")
        # Replicas: the printed command as it is (--stage auto), one after another as the
        # README says, alternating homes; each takes a stage nobody serves yet.
        replicas = []
        for index in range(num_stages):
            host = f"home{2 - index % 2}-{num_stages - 1 - index // 2}"
            replicas.append(walk.start(f"infer{index}", host, [*join, "--name", f"infer{index}",
                                                               *PEER_HOST_SETTINGS]))
            ready_s |= joined_after(replicas[-1:])
        peers = [*trainers, *replicas]
        for peer in peers:
            assert "reachable through relay" in peer.said(), peer.said()[-2000:]
        served = sorted(int(re.search(r"stage (\d+) of", r.said())[1]) for r in replicas)
        assert served == list(range(num_stages)), served

        coordinator.popen.wait(timeout=RUN_S)
        run_s = time.monotonic() - coordinator.started
        said = coordinator.said()
        assert coordinator.popen.returncode == 0, said[-3000:]
        steps = int(re.search(r"(\d+) steps; after: pass@1", said)[1])
        for peer in peers:
            peer.popen.wait(timeout=PEERS_STOP_S)
            assert peer.popen.returncode == 0, (peer.name, peer.said()[-2000:])
            assert f"run 'operator{num_stages}' ended after {steps} steps; stopping" in \
                peer.said()
        relay.popen.send_signal(signal.SIGINT)
        relay.popen.wait(timeout=30)
        return Walk(run_dir, steps, ready_s, run_s)


@pytest.mark.network
@pytest.mark.slow
def test_the_readme_swarm_trains_behind_nat_ends_and_releases_from_the_run_folder(
        tiny_sharp_dir: Path, tmp_path: Path) -> None:
    netns_or_skip()
    walk = walk_the_readme(tiny_sharp_dir, tmp_path, NUM_STAGES)
    assert walk.steps == STEPS
    # The release: every shard in the run folder is the one the owner signed, fetched from the
    # training peer that wrote it into its own --checkpoint-dir.
    layout = CheckpointLayout(walk.run_dir / "checkpoints")
    version = layout.latest_version()
    assert version == STEPS  # a training step makes a version; the last one is checkpointed
    manifest = read_manifest(layout, version, owner_identity(walk.run_dir).peer_id)
    assert manifest is not None and sorted(r.stage for r in manifest.shards) == \
        list(range(NUM_STAGES))
    for record in manifest.shards:
        assert file_sha256(layout.stage_file(version, record.stage)) == record.sha256
        own = CheckpointLayout(tmp_path / "hosts" / f"train{record.stage}" / "ckpt")
        assert file_sha256(own.stage_file(version, record.stage)) == record.sha256
    assert (walk.run_dir / "model" / "model.safetensors").is_file()
    assert (walk.run_dir / "model" / "SHA256SUMS").is_file()
    print(f"ready after (s): {walk.ready_s}; coordinator ran {walk.run_s:.0f}s")

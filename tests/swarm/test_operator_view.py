"""A swarm run seen from the outside, end to end on loopback with every peer a separate process:
the coordinator's dashboard shows the live run in headless Chromium, metrics.jsonl records the
swarm as it changes, the per-run report is built from it, and the exported model is the swarm's
model: transformers generates, greedily, exactly the tokens the swarm's replicas generate (with
sparse updates, so the weights the replicas serve are not the learner's)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from browser import chromium, read_page
from helpers import chat_prompts
from rich.console import Console
from swarm_helpers import launched_swarm, tiny_run_config

from decentrl.coordinator.loop import TrainingLoop
from decentrl.coordinator.swarm_backend import swarm_run
from decentrl.model.loading import load_model
from decentrl.observe.report import build_report
from decentrl.release.export import export_run
from decentrl.rollout.generate import generate
from decentrl.rollout.sampling import SamplingConfig
from decentrl.tasks import Problem, Reward, SumsTask

# The test runs a swarm of peer processes, each with its own p2p daemon.
pytestmark = pytest.mark.network

STEPS = 4
QUESTIONS = ["What is 12 + 30?", "Name a colour.", "Say hello.", "Count to three."]


class DigitsTask(SumsTask):
    """Sums rewarded by the share of digits in the completion: a tiny random model earns some,
    unevenly within a group, so the learner's weights move (with the sums' reward they never
    would: every group earns 0)."""

    def reward(self, problem: Problem, completion: str) -> Reward:
        digits = sum(c.isdigit() for c in completion)
        return Reward(correct=digits / max(1, len(completion)), format=0.0)


def fetch_state(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "api/state", timeout=10) as response:
        return json.load(response)


@pytest.mark.slow  # half a minute of daemons: make test-slow (CI runs it)
def test_a_swarm_run_is_watched_reported_and_released(tiny_sharp_dir: Path,
                                                      tmp_path: Path) -> None:
    config = tiny_run_config(
        tiny_sharp_dir, 2, host={"run_dir": str(tmp_path / "runs"), "dashboard_port": 0},
        rollout={"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 6},
        train={"steps": STEPS, "micro_batch_size": 8, "checkpoint_every": 2,
               "zero_variance_groups": "keep", "max_staleness": 4},
        eval={"problems": 8, "pass_k": 2, "max_new_tokens": 6, "batch_size": 8},
        swarm={"announce_every_s": 1.0, "snapshot_every_s": 1.0, "sessions_in_flight": 2})
    with launched_swarm(config, replicas=2) as local:
        coordinator = swarm_run(config, local.bootstrap, Console(quiet=True))
        coordinator.ingestion.task = DigitsTask()  # the coordinator scores; peers never do
        live: list[dict[str, Any]] = []

        def watch() -> None:  # what an operator sees mid-run
            while coordinator.backend.dashboard is None and not coordinator.stop.is_set():
                time.sleep(0.1)
            while not coordinator.stop.is_set():
                state = fetch_state(coordinator.backend.dashboard.url)
                # The first step has no throughput (its interval holds the evaluation).
                if state["phase"] == "training" and len(state["steps"]) >= 2:
                    live.append(state)
                    # Peers announce their traffic every second and the coordinator reads the
                    # announcements every second: under load the first snapshots of a fast run
                    # can predate any peer's first reply.
                    if any(p["bytes_sent"] > 0 for s in state["stages"] for p in s["peers"]):
                        return
                time.sleep(0.2)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            summary = coordinator.run(wait_s=120)
            watcher.join(timeout=10)
            assert summary.steps == STEPS
            check_live_state(live, config.num_stages)
            check_dashboard_page(coordinator, tmp_path)
            check_export_matches_the_swarm(coordinator, config.path, config.path / "model")
        finally:
            coordinator.close()
    check_metrics_and_report(config.path)


def check_live_state(live: list[dict[str, Any]], num_stages: int) -> None:
    assert live, "the dashboard never showed the run training"
    state = live[-1]
    assert [s["stage"] for s in state["stages"]] == list(range(num_stages))
    for stage in state["stages"]:
        # A peer whose announcement lapsed under load drops out of one snapshot: not all three
        # need be there, but both kinds of peer must.
        assert {p["role"] for p in stage["peers"]} == {"inference", "training"}, stage
        assert all(0 <= p["reputation"] <= 1 and not p["banned"] for p in stage["peers"])
    assert any(p["bytes_sent"] > 0 for s in state["stages"] for p in s["peers"])
    assert [u["stage"] for u in state["updates"]] == list(range(num_stages))
    assert all(1 <= u["replicas"] <= 2 for u in state["updates"])
    assert state["evals"][0]["label"] == "before"
    last = state["steps"][-1]
    # The step counter moves just before the step's metrics line is written: a snapshot taken
    # between the two shows the table one step behind.
    assert state["step"] - 1 <= last["step"] <= state["step"] and 0 <= last["accuracy"] <= 1
    assert last["tokens_per_s"] > 0


def check_dashboard_page(coordinator: TrainingLoop, tmp_path: Path) -> None:
    assert coordinator.backend.dashboard is not None
    url = coordinator.backend.dashboard.url
    text, _ = read_page(chromium(url, tmp_path / "profile", "--dump-dom"))
    state = fetch_state(url)
    assert state["phase"] == "finished"
    for stage in state["stages"]:
        for peer in stage["peers"]:
            assert peer["name"] in text
    assert f"{STEPS} of {coordinator.config.train.steps}" in " ".join(text.split())


def check_export_matches_the_swarm(coordinator: TrainingLoop, run_dir: Path,
                                   out: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = export_run(run_dir, out)  # the served weights
    learner = load_model(str(export_run(run_dir, out.with_name("learner"), weights="learner")))
    exported = load_model(str(folder))
    # Sparse updates: the replicas' weights lag the learner's; the release is what they served.
    assert exported.tensors.keys() == learner.tensors.keys()
    assert any(not torch.equal(exported.tensors[k], learner.tensors[k]) for k in learner.tensors)
    assert "as the swarm's inference replicas served it" in (folder / "README.md").read_text()
    prompts = chat_prompts(exported, QUESTIONS)
    eos, pad = exported.tokenizer.eos_token_id, exported.tokenizer.pad_token_id
    # Every replica at the last version, not only the newest of each stage (a loaded machine
    # can leave one a round behind, and the rows of a batch go to both).
    directory = coordinator.backend.chain.directory
    deadline = time.monotonic() + 60
    while {r.version for stage in directory.stage_summary() for r in stage
           if r.role == "inference"} != {STEPS} and time.monotonic() < deadline:
        time.sleep(0.5)
        directory.refresh()
    assert coordinator.backend.chain.versions() == (STEPS,) * coordinator.config.num_stages
    replicas = {(index, r.name): r.version for index, stage in enumerate(directory.stage_summary())
                for r in stage if r.role == "inference"}
    assert set(replicas.values()) == {STEPS}, replicas
    swarm = generate(coordinator.backend.chain, prompts, 12, SamplingConfig(temperature=0.0),
                     {eos}, pad)
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    for prompt, generation in zip(prompts, swarm):
        with torch.no_grad():
            out_ids = hf.generate(input_ids=torch.tensor([prompt]), max_new_tokens=12,
                                  do_sample=False)[0, len(prompt):].tolist()
        cut = out_ids.index(eos) + 1 if eos in out_ids else len(out_ids)
        assert generation.tokens == out_ids[:cut]
    assert len({tuple(g.tokens) for g in swarm}) > 1  # not one token repeated by every row


def check_metrics_and_report(run_dir: Path) -> None:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    snapshots = [r for r in records if r["event"] == "swarm"]
    assert len(snapshots) >= 2
    assert max(len(s["peers"]) for s in snapshots) == 6
    assert max(p["bytes_sent"] for p in snapshots[-1]["peers"]) > 0
    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for record in steps:
        assert sum(record["staleness_counts"].values()) == record["groups"]
    report = build_report(run_dir)
    text = report.read_text()
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings[0] == "## Before and after"
    assert "(../model/README.md)" in text  # the export, with its model card
    for image in ("reward_accuracy.png", "staleness.png", "throughput.png", "bytes_per_peer.png",
                  "peers.png"):
        assert (report.parent / image).stat().st_size > 1000, image

"""Every registered family's tiny model (its conformance case, tests/unit/model/families/cases.py)
trained for two steps through a local swarm: a training peer and an inference replica per stage,
each with its own p2p daemon in this process, driven by the coordinator over loopback (about 3 s
a family on 2 cores)."""

from __future__ import annotations

from pathlib import Path

import pytest
from swarm_helpers import start_swarm, tiny_run_config

from decentrl.model.tiny import make_tiny_model
from tests.swarm.test_adversaries import coordinated
from tests.unit.model.families.cases import family_cases
from tests.unit.model.families.conformance import FamilyCase

pytestmark = pytest.mark.network

LAYOUT = [(0, "training"), (1, "training"), (0, "inference"), (1, "inference")]


@pytest.mark.parametrize("case", family_cases(), ids=str)
def test_two_steps_of_every_family_through_a_swarm(case: FamilyCase, tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model", seed=1, model_type=case.model_type,
                            **case.config)
    config = tiny_run_config(
        model, 2, host={"run_dir": str(tmp_path / "runs")},
        rollout={"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 4},
        train={"steps": 2, "micro_batch_size": 4, "zero_variance_groups": "keep",
               "max_staleness": 2},
        eval={"problems": 2, "pass_k": 1, "max_new_tokens": 4, "batch_size": 2,
              "greedy": False},
        swarm={"announce_every_s": 1.0, "avoid_failed_peer_s": 2.0})
    with start_swarm(config, LAYOUT) as swarm, coordinated(config, swarm) as coordinator:
        summary = coordinator.run(wait_s=60)
    assert summary.steps == 2
    assert summary.banned == {}

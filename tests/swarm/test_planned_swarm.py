"""A swarm whose stages are planned from its training peers' offers (coordinator/planning.py):
separate peer processes under their own memory caps offer them with a measured speed, the
owner plans from the admitted peers' offers, and each peer takes the stage planned for it and
the planned layers; generation goes through the planned chain."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from swarm_helpers import tiny_run_config

from decentrl.client.sessions import RemoteChain
from decentrl.launch.local_swarm import LocalSwarm
from decentrl.model.loading import model_spec
from decentrl.net.directory import Directory
from decentrl.rollout.generate import generate
from decentrl.rollout.sampling import SamplingConfig

pytestmark = pytest.mark.network


def test_peers_take_the_stages_planned_from_their_offers(tiny_sharp_dir: Path,
                                                          tmp_path: Path) -> None:
    config = tiny_run_config(tiny_sharp_dir, 2, host={"run_dir": str(tmp_path / "runs")},
                             swarm={"announce_every_s": 1.0})
    config.path.mkdir(parents=True)
    config_path = config.path / "swarm-config.json"
    config_path.write_text(config.model_dump_json())
    # train1 has the larger cap: it is planned for stage 0 (the largest offers take the ends,
    # the largest of all the first).
    local = LocalSwarm(config, config_path, replicas=0, training_role="both",
                       memory_limits_mb={"train0": 1024, "train1": 1536},
                       plan_from_offers=True)
    try:
        local.start()
        assert local.planned is not None and local.bootstrap is not None
        ids = {name: child.info["peer_id"] for name, child in local.children.items()}
        assert local.planned.peers == (ids["train1"], ids["train0"])
        assert [offer.memory_mb for offer in local.planned.offers] == [1536, 1024]
        assert all(offer.speed > 0 for offer in local.planned.offers)
        assert {name: child.info["stage"] for name, child in local.children.items()} == \
            {"train1": 0, "train0": 1}
        # The planned config is the run's now, its file too, and the peers serve its layers.
        planned = local.planned.choice.plan
        assert local.config.stage_layers == planned.stage_layers
        assert tuple(json.loads(config_path.read_text())["stage_layers"]) == \
            planned.stage_layers
        for name, stage in (("train1", 0), ("train0", 1)):
            span = planned.layers(stage)
            assert local.children[name].info["layers"] == f"{span.start}-{span.stop - 1}"
        spec = model_spec(tiny_sharp_dir)
        directory = Directory(local.bootstrap, config.name, config.num_stages, config.swarm)
        chain = RemoteChain(local.bootstrap, directory, config.swarm, config.trust, spec,
                            stage_layers=local.config.stage_layers)
        [out] = generate(chain, [[3, 4, 5]], 4, SamplingConfig(temperature=0.0), set(), 0, 0)
        assert len(out.tokens) == 4
    finally:
        local.shutdown()
    assert not local.sockets, f"leftover p2pd sockets: {local.sockets}"

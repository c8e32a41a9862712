"""The simulated links (sim/network.py): messages sharing a pipe take turns frame by frame."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import simpy

from decentrl.sim.network import Endpoint, Network
from decentrl.sim.scenario import LinkSpec


def test_a_small_message_is_not_stuck_behind_a_keyframe_on_the_same_uplink() -> None:
    env = simpy.Environment()
    network = Network(env, LinkSpec({("eu", "eu"): 20.0}), seed=0)
    home = network.endpoint("home", "eu", False, uplink_mbps=8.0, downlink_mbps=100.0)
    first, second = (network.endpoint(name, "eu", False, 100.0, 100.0) for name in "ab")
    delivered: dict[str, float] = {}

    def send(name: str, target: Endpoint, nbytes: int) -> Generator[Any, Any, None]:
        yield from network.send(home, target, nbytes)
        delivered[name] = env.now

    env.process(send("keyframe", first, 100_000_000))  # 100 s at 1 MB/s
    env.process(send("activations", second, 100_000))
    env.run()
    assert delivered["keyframe"] > 100.0
    assert delivered["activations"] < 2.5  # a frame of the keyframe, then its own bytes
    assert home.sent == first.received + second.received == 100_100_000
    assert home.busy_up_s == 100_100_000 * 8 / 8e6

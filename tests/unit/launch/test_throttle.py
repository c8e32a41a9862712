"""The netns demo's mid-run fault (launch/throttle.py): a home's uplink capped halfway through
training and restored at its end, and the share of new sessions each replica got before and
after."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, ClassVar, cast

import pytest
from rich.console import Console

from decentrl.launch.throttle import ThrottleHalfway
from decentrl.net.protocol import PeerRecord
from decentrl.observe.metrics import StepRecord


class Uplinks:
    routers: ClassVar[dict[int, str]] = {1: "router1", 2: "router2"}

    def __init__(self) -> None:
        self.calls: list[tuple[int, float]] = []

    def throttle(self, home: int, mbit: float) -> None:
        self.calls.append((home, mbit))


class Sessions:
    def __init__(self) -> None:
        self.opened = {"fast": 0, "slow": 0, "other": 0}

    def sessions_opened(self) -> dict[str, int]:
        return dict(self.opened)

    def records(self) -> dict[str, PeerRecord]:
        def record(name: str, stage: int) -> PeerRecord:
            return PeerRecord(name=name, stage=stage, layers=(0, 1), role="inference", version=1,
                              tokens_per_s=1.0, free_sessions=4, training_ready=False)
        return {"fast": record("fast", 0), "slow": record("slow", 0),
                "other": record("other", 1)}


def step(number: int) -> StepRecord:
    return StepRecord(step=number, version=number, reward=0.0, accuracy=0.0, staleness_mean=0.0)


def test_the_uplink_is_capped_halfway_and_restored_and_the_shares_are_split_there() -> None:
    uplinks, sessions = Uplinks(), Sessions()
    hook = ThrottleHalfway(cast(Any, uplinks), 2, 0.5, 50.0, cast(Any, sessions), {"slow"})
    loop = cast(Any, SimpleNamespace(config=SimpleNamespace(train=SimpleNamespace(
        time_budget_s=None, steps=10)), console=Console(quiet=True)))
    hook.training_started(loop)
    sessions.opened.update(fast=5, slow=5, other=10)
    hook.after_step(loop, step(4))
    assert uplinks.calls == [] and hook.throttled_at_step is None
    hook.after_step(loop, step(5))
    assert uplinks.calls == [(2, 0.5)] and hook.throttled_at_step == 5
    sessions.opened.update(fast=14, slow=6, other=20)
    hook.after_step(loop, step(6))  # once only
    hook.training_ended(loop)
    assert uplinks.calls == [(2, 0.5), (2, 50.0)]
    shares = {s.name: s for s in hook.shares()}
    assert (shares["slow"].before, shares["slow"].after) == (5, 1)
    assert shares["slow"].throttled and not shares["fast"].throttled
    assert shares["slow"].share_before == pytest.approx(0.5)
    assert shares["slow"].share_after == pytest.approx(0.1)
    assert shares["other"].share_after == pytest.approx(1.0)  # alone at its stage


def test_a_home_that_does_not_exist_is_refused() -> None:
    with pytest.raises(ValueError, match="no home 3 on this internet"):
        ThrottleHalfway(cast(Any, Uplinks()), 3, 0.5, 50.0, cast(Any, Sessions()), set())

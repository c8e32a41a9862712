"""The coordinator's rows in flight (coordinator/inflight.py): sized from measured round trips and
throughput, within every bound, on a simulated swarm with an injected clock; and the session
slots the generation loops take."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from swarm_helpers import tiny_run_config

from decentrl.config import ConfigError, RunConfig
from decentrl.coordinator.inflight import (
    FLOOR_WINDOW,
    HEADROOM,
    RATE_WINDOW,
    UPDATE_EVERY_S,
    RowsInFlight,
    SessionSlots,
    SlottedChain,
    groups_in_flight,
    groups_per_session,
)
from decentrl.rollout.chain import StepResult
from decentrl.rollout.sampling import SamplingConfig

GROUP = 8


def config(**swarm: Any) -> RunConfig:
    """16 groups of 8 rows per step, two steps' worth in flight at most (256 rows)."""
    return tiny_run_config(Path("unused"), 2,
                           rollout={"group_size": GROUP, "prompts_per_step": 16,
                                    "max_new_tokens": 24},
                           train={"max_staleness": 2}, swarm={"groups_per_session": 2, **swarm})


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SimulatedSwarm:
    """Peers that step at most `capacity` rows per second, with a round trip of `floor_s` when
    nothing queues: with N rows in flight a decoding step takes max(floor, N / capacity). The
    allowed rows decode a `duty` share of the time (prefills and session turnover the rest)."""

    def __init__(self, controller: RowsInFlight, clock: Clock, capacity: float,
                 floor_s: float, session_length: int = 64, duty: float = 1.0) -> None:
        self.controller, self.clock = controller, clock
        self.capacity, self.floor_s, self.session_length = capacity, floor_s, session_length
        self.duty = duty

    def interval(self) -> None:
        """One update interval of decoding steps at the rows in flight the controller allows."""
        rows = self.controller.slots.limit * self.controller.session_rows
        round_trip = max(self.floor_s, rows / self.capacity)
        # A little over an interval, so that its last step closes it.
        seconds = 1.01 * UPDATE_EVERY_S
        steps = max(8, round(rows / round_trip * seconds * self.duty
                             / self.controller.session_rows))
        began = self.clock.now
        for index in range(steps):
            self.clock.now = began + seconds * (index + 1) / steps
            self.controller.observe(self.controller.session_rows, 1, self.session_length,
                                    round_trip)

    def run(self, intervals: int) -> list[int]:
        """The rows in flight after each interval."""
        seen = []
        for _ in range(intervals):
            self.interval()
            seen.append(self.controller.state.rows)
        return seen


def controller(config: RunConfig, replicas: list[int] | None = None
               ) -> tuple[RowsInFlight, Clock]:
    clock = Clock()
    return RowsInFlight(config, lambda: replicas or [2, 2], clock), clock


@pytest.mark.parametrize("duty", [1.0, 0.5])
def test_rows_in_flight_grow_while_latency_dominates(duty: float) -> None:
    """`duty`: half the time, the allowed sessions prefill or wait for the next to start; the
    rows in flight grow all the same."""
    control, clock = controller(config())
    # One session of two groups to start with; at most two steps' worth (32 groups).
    assert control.state.limited_by == "start" and control.state.rows == 2 * GROUP
    assert control.session_rows == 2 * GROUP and control.max_sessions == 16
    # Peers far faster than the network: every step takes the 100 ms floor, so throughput is
    # rows in flight / 100 ms and the target grows by HEADROOM each interval, to the most a step
    # can use before it goes stale.
    seen = SimulatedSwarm(control, clock, capacity=1e9, floor_s=0.1, duty=duty).run(6)
    assert seen == [32, 64, 128, 256, 256, 256]
    assert control.state.limited_by == "staleness"
    assert control.state.round_trip_s == pytest.approx(0.1)
    assert control.state.rows_per_s == pytest.approx(duty * 256 / 0.1, rel=0.05)


def test_rows_in_flight_settle_between_the_bandwidth_delay_product_and_headroom_times_it() -> None:
    control, clock = controller(config(), replicas=[4, 4])
    swarm = SimulatedSwarm(control, clock, capacity=400.0, floor_s=0.1)
    assert swarm.run(2) == [32, 64]  # latency-bound at first
    # The swarm steps 400 rows/s with a 100 ms floor: 40 rows fill it. The rows in flight stop
    # between that and HEADROOM x 40, with the peers full, and hold there long after the
    # floor's window has passed (the floor measured under load does not raise them).
    settled = swarm.run(FLOOR_WINDOW + 10)
    bandwidth_delay = 400.0 * 0.1
    assert bandwidth_delay <= settled[-1] <= HEADROOM * bandwidth_delay
    assert set(settled) == {settled[-1]}
    assert control.state.rows_per_s == pytest.approx(400.0, rel=0.05)
    assert control.state.limited_by in ("measured", "throughput flat")


def test_rows_in_flight_shrink_when_the_swarm_loses_throughput() -> None:
    control, clock = controller(config(), replicas=[4, 4])
    swarm = SimulatedSwarm(control, clock, capacity=400.0, floor_s=0.1)
    swarm.run(FLOOR_WINDOW)
    before = control.state.rows
    swarm.capacity = 100.0  # a replica left
    after = swarm.run(RATE_WINDOW + 2)[-1]
    assert after < before
    assert after == 2 * control.session_rows >= HEADROOM * 100.0 * 0.1


def test_rows_in_flight_grow_again_after_the_swarm_recovers() -> None:
    """Generation alone fills the staleness bound; training then takes the CPU (the swarm steps
    far fewer rows) and the rows shrink; once it eases, they grow again: the throughput of the
    first growth, which the swarm no longer reaches, does not hold them down."""
    control, clock = controller(config(), replicas=[4, 4])
    swarm = SimulatedSwarm(control, clock, capacity=1e9, floor_s=0.1)
    assert swarm.run(5)[-1] == 256
    swarm.capacity = 100.0
    shrunk = swarm.run(RATE_WINDOW + 2)[-1]
    assert shrunk <= 2 * control.session_rows
    swarm.capacity = 1000.0
    recovered = swarm.run(10)[-1]
    assert recovered >= 1000.0 * 0.1  # at least the bandwidth-delay product again


def test_rows_in_flight_respect_every_bound() -> None:
    # Sessions per replica: one replica at stage 1 takes 14 sessions of 16 rows.
    many = config(max_sessions_per_peer=100)
    control, clock = controller(config(max_sessions_per_sender=16), replicas=[3, 1])
    SimulatedSwarm(control, clock, capacity=1e9, floor_s=0.1).run(4)
    assert control.state.rows == 14 * control.session_rows
    assert control.state.limited_by == "sessions per replica"
    # The KV budget: 4096 cached tokens per sender and sessions of 512 positions leave room for
    # 8 rows per replica, less than a session: one session at a time.
    control, clock = controller(config(max_cached_tokens_per_sender=4096,
                                       max_session_tokens=4096), replicas=[1, 1])
    SimulatedSwarm(control, clock, capacity=1e9, floor_s=0.1, session_length=512).run(3)
    assert control.state.sessions == 1 and control.state.limited_by == "KV budget per replica"
    # Steps a hundred times slower than the floor measured before: never fewer than one session.
    control, clock = controller(many)
    swarm = SimulatedSwarm(control, clock, capacity=1e9, floor_s=0.01)
    assert swarm.run(1) == [2 * control.session_rows]
    swarm.floor_s = 1.0
    swarm.run(RATE_WINDOW + 1)
    assert control.state.limited_by == "measured" and control.state.round_trip_s == 0.01
    assert control.state.sessions == 1 and control.slots.limit == 1
    # A fixed count is kept whatever the measurements say, and they are still reported.
    control, clock = controller(config(sessions_in_flight=3))
    SimulatedSwarm(control, clock, capacity=1e9, floor_s=0.1).run(3)
    assert (control.state.sessions, control.state.limited_by) == (3, "fixed")
    assert control.max_sessions == 3 and control.state.round_trip_s == pytest.approx(0.1)


def test_only_decoding_steps_are_timed() -> None:
    control, clock = controller(config())
    for _ in range(20):
        clock.now += 1.0
        control.observe(16, 40, 64, 5.0)  # prefills: no round trip of a decoding step
    assert control.state.round_trip_s is None and control.state.limited_by == "start"
    assert control.session_length == 64  # but the session's length counts for the KV bound


def test_groups_per_session_fit_a_steps_rows_into_a_replicas_room() -> None:
    # 32 groups in flight at most, 14 sessions per replica (16 per sender, 2 left to checks):
    # three groups per session.
    assert groups_per_session(config(groups_per_session=None)) == 3
    assert groups_per_session(config(groups_per_session=None, max_sessions_per_sender=100,
                                     max_sessions_per_peer=100)) == 1
    # Sessions of 8 rows x (24 + 512) positions: 4288 tokens; 8192 allow one group only.
    assert groups_per_session(config(groups_per_session=None, max_session_tokens=8192,
                                     max_cached_tokens_per_sender=8192)) == 1
    assert groups_per_session(config(groups_per_session=3)) == 3
    with pytest.raises(ConfigError, match="groups_per_session"):
        config(groups_per_session=400)


def test_session_slots_hold_sessions_to_the_limit() -> None:
    slots = SessionSlots(2)
    stop = threading.Event()
    assert slots.acquire(stop) and slots.acquire(stop)
    started = threading.Event()
    admitted: list[bool] = []

    def third() -> None:
        started.set()
        admitted.append(slots.acquire(stop))
    waiter = threading.Thread(target=third)
    waiter.start()
    started.wait()
    assert slots.running == 2 and not admitted
    slots.set_limit(3)  # the controller raised it: the waiting loop starts its session
    waiter.join(timeout=5)
    assert admitted == [True] and slots.running == 3
    slots.set_limit(1)  # lowered: running sessions finish, no new one starts
    for _ in range(3):
        slots.release()
    stop.set()
    assert slots.acquire(stop)  # one free slot: taken even though stop is set
    assert not slots.acquire(stop)  # none free and stop set: the loop ends
    with pytest.raises(ValueError, match="at least 1"):
        slots.set_limit(0)


class CountingChain:
    """A chain whose sessions do nothing; it counts how many are open at once."""

    def __init__(self) -> None:
        self.open = self.most = 0
        self.lock = threading.Lock()

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def versions(self) -> tuple[int, ...]:
        return (0,)

    def open_session(self, batch: int, max_length: int) -> CountingChain:
        with self.lock:
            self.open += 1
            self.most = max(self.most, self.open)
        return self

    def step(self, *args: Any) -> StepResult:
        time.sleep(0.01)
        return StepResult(torch.zeros(1), torch.zeros(1), (0,))

    def close(self) -> None:
        with self.lock:
            self.open -= 1


def test_evaluation_sessions_take_session_slots_too() -> None:
    slots = SessionSlots(3)
    stop = threading.Event()
    assert slots.acquire(stop)  # a generation loop's session
    inner = CountingChain()
    chain = SlottedChain(inner, slots)

    def session() -> None:
        opened = chain.open_session(1, 8)
        opened.step(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), SamplingConfig(),
                    None)
        opened.close()
        opened.close()  # a second close frees nothing more
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda _: session(), range(16)))
    assert inner.most == 2 and inner.open == 0  # the third slot was the generation loop's
    assert slots.running == 1


@pytest.mark.parametrize(("staleness", "train", "steps"), [
    (8, {}, 8),  # a step is one version: eight steps' worth
    (8, {"minibatches_per_batch": 2, "epochs_per_batch": 2}, 2),  # four versions a step
    (2, {"minibatches_per_batch": 4}, 1),  # less than a step's versions: one step's worth
])
def test_the_groups_worth_generating_count_the_versions_of_a_step(
        staleness: int, train: dict[str, int], steps: int) -> None:
    """The staleness bound is in versions: a step of several optimizer steps moves the learner
    several versions, so fewer steps' worth of groups in flight stay trainable."""
    config = tiny_run_config(Path("unused"), 2, rollout={"prompts_per_step": 4},
                             train={"max_staleness": staleness, **train},
                             trust={"history_versions": staleness})
    assert groups_in_flight(config) == 4 * steps

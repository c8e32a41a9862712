"""The WAN link emulator. A recording clock stands in for the event loop's: the tests check the
exact delays a link asks for, and the order in which concurrent waits begin and end, without
sleeping or timing anything."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Coroutine, Iterable
from typing import Any

import pytest

from decentrl.net.link import (
    Link,
    LinkEmulator,
    LinkProfile,
    LinkStats,
    MessageLost,
    Uplink,
)

TimelineEntry = tuple[str, str, float]  # (task name, "begin" or "end", seconds asked for)


class RecordingClock:
    """A LinkClock that takes no time: it records each delay asked for (`delays`) and when each
    sleep began and ended among all of them (`timeline`). A sleep yields to the event loop once,
    as the start of any real wait does, so concurrent sends interleave as they would. While
    `hold()` is in force, sleeps wait for `release()`: a test can act while a message is on the
    wire."""

    def __init__(self) -> None:
        self.delays: list[float] = []
        self.timeline: list[TimelineEntry] = []
        self._released: asyncio.Event | None = None

    def hold(self) -> None:
        self._released = asyncio.Event()

    def release(self) -> None:
        assert self._released is not None, "release() without hold()"
        self._released.set()

    async def sleep(self, seconds: float) -> None:
        task = asyncio.current_task()
        name = task.get_name() if task is not None else "?"
        self.delays.append(seconds)
        self.timeline.append((name, "begin", seconds))
        await asyncio.sleep(0)
        if self._released is not None:
            await self._released.wait()
        self.timeline.append((name, "end", seconds))

    def interval(self, task: str, seconds: float) -> tuple[int, int]:
        """Where `task`'s sleep of `seconds` began and ended in the timeline."""
        begin = self.timeline.index((task, "begin", seconds))
        return begin, self.timeline.index((task, "end", seconds), begin)


def overlap(first: tuple[int, int], second: tuple[int, int]) -> bool:
    return first[0] < second[1] and second[0] < first[1]


async def named(**coroutines: Coroutine[Any, Any, None]) -> None:
    """Run the coroutines concurrently as tasks named by their keywords, started in that order."""
    await asyncio.gather(*(asyncio.create_task(coroutine, name=name)
                           for name, coroutine in coroutines.items()))


async def send_each(link: Link, sizes: Iterable[int], direction: str = "out") -> None:
    """One message after the other, so their delays are drawn in order."""
    for size in sizes:
        await link.send(size, direction)


async def let_ready_tasks_run() -> None:
    """Yield until every task that is not waiting on something has run as far as it can. The
    code under test never waits on time here (the clock is the only thing that could make it),
    so a bounded number of event-loop turns is enough."""
    for _ in range(50):
        await asyncio.sleep(0)


def test_one_way_delay_is_half_the_rtt() -> None:
    clock = RecordingClock()
    link = Link("a", "b", LinkProfile(rtt_ms=(40.0, 40.0)), clock)
    assert link.rtt_s == pytest.approx(0.040)
    asyncio.run(send_each(link, [100], "out"))
    asyncio.run(send_each(link, [100], "in"))
    assert clock.delays == pytest.approx([0.020, 0.020])


def test_rtt_drawn_in_range_and_deterministic() -> None:
    profile = LinkProfile(rtt_ms=(50.0, 250.0), seed=7)
    rtts = {remote: profile.rtt_seconds("local", remote) for remote in "bcdefghijk"}
    assert all(0.050 <= rtt <= 0.250 for rtt in rtts.values())
    assert len(set(rtts.values())) == len(rtts)  # different pairs, different links
    # The same from either side, and on a second emulator (another process would agree too).
    assert profile.rtt_seconds("c", "local") == rtts["c"]
    assert LinkEmulator("local", profile).link("c").rtt_s == rtts["c"]
    assert LinkEmulator("c", profile).link("local").rtt_s == rtts["c"]
    other_seed = LinkProfile(rtt_ms=(50.0, 250.0), seed=8)
    assert any(other_seed.rtt_seconds("local", r) != rtts[r] for r in rtts)


def jitter_delays(seed: int, sends: int = 200) -> list[float]:
    clock = RecordingClock()
    link = Link("a", "b", LinkProfile(rtt_ms=(40.0, 40.0), jitter_ms=20.0, seed=seed), clock)
    asyncio.run(send_each(link, [10] * (sends // 2), "out"))
    asyncio.run(send_each(link, [10] * (sends // 2), "in"))
    assert len(clock.delays) == sends
    return clock.delays


def test_jitter_adds_fresh_uniform_noise_to_every_one_way_trip() -> None:
    delays = jitter_delays(seed=3)
    noise_ms = [(delay - 0.020) * 1000.0 for delay in delays]
    # Half the RTT, plus noise in [0, jitter_ms] (the float sum may round up a hair past 20).
    assert all(0.0 <= noise <= 20.0 + 1e-9 for noise in noise_ms)
    # Each trip draws its own noise, in both directions: none repeats, none is left at zero.
    assert len(set(noise_ms)) == len(noise_ms)
    assert min(noise_ms[:100]) < 2.0 and min(noise_ms[100:]) < 2.0
    # Spread over the whole range, centred on its middle. The draws are seeded, so these hold
    # for this seed every run (for 200 fresh uniform draws each fails with probability < 1e-8).
    assert max(noise_ms[:100]) > 18.0 and max(noise_ms[100:]) > 18.0
    assert statistics.mean(noise_ms) == pytest.approx(10.0, abs=1.0)
    assert statistics.pstdev(noise_ms) == pytest.approx(20.0 / 12**0.5, abs=1.0)
    # The same seed and peers draw the same noise; another seed draws other noise.
    assert jitter_delays(seed=3) == delays
    assert jitter_delays(seed=4) != delays


def test_bandwidth_adds_transmission_time() -> None:
    clock = RecordingClock()
    link = Link("a", "b", LinkProfile(bandwidth_mbps=10.0), clock)
    asyncio.run(send_each(link, [125_000]))  # 1 Mbit at 10 Mbit/s
    asyncio.run(send_each(link, [0]))  # nothing to transmit, no propagation delay: no wait
    assert clock.delays == pytest.approx([0.1])


def test_bandwidth_serializes_concurrent_sends() -> None:
    clock = RecordingClock()
    link = Link("a", "b", LinkProfile(rtt_ms=(40.0, 40.0), bandwidth_mbps=10.0), clock)
    asyncio.run(named(first=link.send(125_000), second=link.send(125_000)))
    # 0.1 s each on the wire, then 20 ms of propagation each.
    assert sorted(clock.delays) == pytest.approx([0.020, 0.020, 0.1, 0.1])
    first_on_wire, second_on_wire = clock.interval("first", 0.1), clock.interval("second", 0.1)
    # One message on the wire at a time: the second is transmitted after the first.
    assert first_on_wire[1] < second_on_wire[0]
    # Propagation does not hold the wire: the second is transmitted while the first propagates.
    assert overlap(clock.interval("first", 0.020), second_on_wire)


def test_directions_transmit_independently() -> None:
    clock = RecordingClock()
    link = Link("a", "b", LinkProfile(bandwidth_mbps=10.0), clock)
    asyncio.run(named(up=link.send(125_000, "out"), down=link.send(125_000, "in")))
    assert clock.delays == pytest.approx([0.1, 0.1])
    assert overlap(clock.interval("up", 0.1), clock.interval("down", 0.1))


def test_loss_rate_and_message_lost() -> None:
    link = Link("a", "b", LinkProfile(loss=0.3, seed=1))
    lost = asyncio.run(_count_lost(link, 2000))
    assert 0.25 < lost / 2000 < 0.35
    assert link.stats.lost == lost
    assert link.stats.messages_out == 2000  # lost messages were still sent
    # Reproducible: the same seed and peers lose the same messages.
    again = Link("a", "b", LinkProfile(loss=0.3, seed=1))
    again_lost = asyncio.run(_count_lost(again, 2000))
    assert again_lost == lost
    assert issubclass(MessageLost, ConnectionError)


async def _count_lost(link: Link, n: int) -> int:
    lost = 0
    for _ in range(n):
        try:
            await link.send(1)
        except MessageLost:
            lost += 1
    return lost


def test_lost_message_raises_after_the_delay() -> None:
    clock = RecordingClock()
    link = Link("a", "b", LinkProfile(rtt_ms=(40.0, 40.0), loss=0.999999), clock)

    async def main() -> None:
        with pytest.raises(MessageLost, match="a -> b lost a out message of 5 bytes"):
            await link.send(5)
        # Raised only once the whole propagation delay was waited out, as a real sender of a
        # lost message learns nothing sooner.
        assert clock.timeline == [("main", "begin", 0.020), ("main", "end", 0.020)]

    asyncio.run(named(main=main()))


def test_byte_counters() -> None:
    emulator = LinkEmulator("me", LinkProfile())

    async def traffic() -> None:
        await emulator.link("x").send(100, "out")
        await emulator.link("x").send(30, "in")
        await emulator.link("y").send(7)

    asyncio.run(traffic())
    stats = emulator.stats()
    assert stats == {"x": LinkStats(bytes_out=100, bytes_in=30, messages_out=1, messages_in=1),
                     "y": LinkStats(bytes_out=7, messages_out=1)}
    assert emulator.total_bytes() == 137
    assert emulator.link("x") is emulator.link("x")
    stats["x"].bytes_out = 0  # a snapshot, not the live counters
    assert emulator.stats()["x"].bytes_out == 100


class RefusingClock:
    """A clock for a link that must never wait."""

    async def sleep(self, seconds: float) -> None:
        raise AssertionError(f"asked to sleep {seconds} s on a disabled link")


def test_disabled_profile_does_not_sleep() -> None:
    assert not LinkProfile().enabled
    assert LinkProfile(loss=0.1).enabled and LinkProfile(bandwidth_mbps=1.0).enabled
    emulator = LinkEmulator("a", LinkProfile(), RefusingClock())

    async def traffic() -> None:
        await emulator.link("b").send(10**9)
        await emulator.uplink.send(10**9, "b")

    asyncio.run(traffic())
    assert emulator.stats()["b"].bytes_out == 10**9 and emulator.uplink.bytes_sent == 10**9


def test_the_emulator_gives_its_clock_to_every_link_and_its_uplink() -> None:
    clock = RecordingClock()
    emulator = LinkEmulator("a", LinkProfile(rtt_ms=(40.0, 40.0), uplink_mbps=8.0), clock)

    async def traffic() -> None:
        await emulator.uplink.send(1000, "b")  # 8 kbit at 8 Mbit/s: 1 ms
        await emulator.link("b").send(1000)
        await emulator.link("c").send(1000)

    asyncio.run(traffic())
    assert clock.delays == pytest.approx([0.001, 0.020, 0.020])


def test_link_survives_a_new_event_loop() -> None:
    link = Link("a", "b", LinkProfile(bandwidth_mbps=1000.0))
    for _ in range(2):
        async def both() -> None:
            await asyncio.gather(link.send(1000), link.send(1000))
        asyncio.run(both())
    assert link.stats.messages_out == 4


@pytest.mark.parametrize("kwargs, field", [
    ({"rtt_ms": (-1.0, 5.0)}, "rtt_ms"),
    ({"rtt_ms": (10.0, 5.0)}, "rtt_ms"),
    ({"rtt_ms": (1.0, 2.0, 3.0)}, "rtt_ms"),
    ({"rtt_ms": (1.0, float("inf"))}, "rtt_ms"),
    ({"jitter_ms": -1.0}, "jitter_ms"),
    ({"bandwidth_mbps": 0.0}, "bandwidth_mbps"),
    ({"bandwidth_mbps": -5.0}, "bandwidth_mbps"),
    ({"loss": 1.0}, "loss"),
    ({"loss": -0.1}, "loss"),
    ({"loss": float("nan")}, "loss"),
])
def test_invalid_profiles(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LinkProfile(**kwargs)


def test_bad_arguments() -> None:
    link = Link("a", "b", LinkProfile())
    with pytest.raises(ValueError, match="direction"):
        asyncio.run(link.send(1, "sideways"))
    with pytest.raises(ValueError, match="nbytes"):
        asyncio.run(link.send(-1))
    with pytest.raises(ValueError, match="itself"):
        LinkEmulator("a").link("a")
    assert LinkProfile(rtt_ms=[1, 2]).rtt_ms == (1.0, 2.0)  # type: ignore[arg-type]


def test_uplink_is_shared_and_takes_turns_by_destination() -> None:
    clock = RecordingClock()
    uplink = Uplink(mbps=8.0, clock=clock)  # 1 MB/s: a 20 kB message holds the wire for 20 ms
    finished: list[str] = []

    async def send(destination: str, label: str) -> None:
        await uplink.send(20_000, destination)
        finished.append(label)

    async def main() -> None:
        clock.hold()  # a0 stays on the wire while the others queue: a's three, then b's one
        busy = [asyncio.create_task(send("a", f"a{i}"), name=f"a{i}") for i in range(4)]
        await let_ready_tasks_run()
        busy.append(asyncio.create_task(send("b", "b0"), name="b0"))
        await let_ready_tasks_run()
        assert clock.timeline == [("a0", "begin", 0.020)]
        clock.release()
        await asyncio.gather(*busy)

    asyncio.run(main())
    # One wire: five messages, five transmissions of 20 ms, never two at once.
    assert clock.delays == pytest.approx([0.020] * 5)
    on_wire = [clock.interval(label, 0.020) for label in ("a0", "a1", "a2", "a3", "b0")]
    assert not any(overlap(first, second)
                   for i, first in enumerate(on_wire) for second in on_wire[i + 1:])
    # b's message waits for one of a's, not four.
    assert finished.index("b0") == 1
    assert uplink.bytes_sent == 100_000


def test_uplink_passes_the_turn_on_when_a_sender_is_cancelled() -> None:
    clock = RecordingClock()
    uplink = Uplink(mbps=8.0, clock=clock)

    async def main() -> None:
        clock.hold()
        first = asyncio.create_task(uplink.send(20_000, "a"), name="first")
        waiting = asyncio.create_task(uplink.send(20_000, "b"), name="waiting")
        await let_ready_tasks_run()
        # The first message is on the wire; the second waits for its turn and is cancelled.
        assert clock.timeline == [("first", "begin", 0.020)] and not waiting.done()
        waiting.cancel()
        await let_ready_tasks_run()
        assert waiting.cancelled()
        clock.release()
        await first
        # The turn went on past the cancelled sender: a later message gets the wire at once.
        late = asyncio.create_task(uplink.send(20_000, "c"), name="late")
        await let_ready_tasks_run()
        assert late.done() and late.exception() is None
        assert clock.delays == pytest.approx([0.020, 0.020])
        assert clock.interval("late", 0.020)[0] > clock.interval("first", 0.020)[1]

    asyncio.run(main())
    with pytest.raises(ValueError, match="uplink_mbps must be None or finite and > 0, got 0.0"):
        LinkProfile(uplink_mbps=0.0)

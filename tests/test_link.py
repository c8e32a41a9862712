from __future__ import annotations

import asyncio
import time

import pytest

from decentrl.net.link import Link, LinkEmulator, LinkProfile, LinkStats, MessageLost, Uplink


def timed(coro) -> float:
    """Wall seconds `coro` takes under a fresh event loop."""
    async def main() -> float:
        start = time.perf_counter()
        await coro
        return time.perf_counter() - start
    return asyncio.run(main())


def close_to(measured: float, expected: float) -> bool:
    # Sleeps never end early by much, but a busy machine can make them late.
    return expected * 0.9 <= measured < expected + 0.15


def test_one_way_delay_is_half_the_rtt() -> None:
    link = Link("a", "b", LinkProfile(rtt_ms=(40.0, 40.0)))
    assert link.rtt_s == pytest.approx(0.040)
    assert close_to(timed(link.send(100)), 0.020)


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


def test_jitter_adds_bounded_noise() -> None:
    link = Link("a", "b", LinkProfile(jitter_ms=20.0))

    async def many() -> None:
        await asyncio.gather(*(link.send(10) for _ in range(20)))

    assert timed(many()) < 0.020 + 0.15


def test_bandwidth_adds_transmission_time() -> None:
    link = Link("a", "b", LinkProfile(bandwidth_mbps=10.0))
    assert close_to(timed(link.send(125_000)), 0.1)  # 1 Mbit at 10 Mbit/s


def test_bandwidth_serializes_concurrent_sends() -> None:
    link = Link("a", "b", LinkProfile(rtt_ms=(40.0, 40.0), bandwidth_mbps=10.0))

    async def both() -> None:
        await asyncio.gather(link.send(125_000), link.send(125_000))

    # 0.1 s each on the wire one after the other, then the 20 ms propagation side by side.
    assert close_to(timed(both()), 0.2 + 0.020)


def test_directions_transmit_independently() -> None:
    link = Link("a", "b", LinkProfile(bandwidth_mbps=10.0))

    async def both() -> None:
        await asyncio.gather(link.send(125_000, "out"), link.send(125_000, "in"))

    assert close_to(timed(both()), 0.1)


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
    link = Link("a", "b", LinkProfile(rtt_ms=(40.0, 40.0), loss=0.999999))

    async def main() -> float:
        start = time.perf_counter()
        with pytest.raises(MessageLost, match="a -> b"):
            await link.send(5)
        return time.perf_counter() - start

    assert close_to(asyncio.run(main()), 0.020)


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


def test_disabled_profile_does_not_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not LinkProfile().enabled
    assert LinkProfile(loss=0.1).enabled and LinkProfile(bandwidth_mbps=1.0).enabled

    async def no_sleep(delay: float) -> None:
        raise AssertionError(f"slept {delay} s on a disabled link")

    link = Link("a", "b", LinkProfile())
    monkeypatch.setattr(asyncio, "sleep", no_sleep)
    asyncio.run(link.send(10**9))
    assert link.stats.bytes_out == 10**9


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
    uplink = Uplink(mbps=8.0)  # 1 MB/s: a 20 kB message holds the wire for 20 ms
    finished: list[str] = []

    async def send(destination: str, label: str) -> None:
        await uplink.send(20_000, destination)
        finished.append(label)

    async def main() -> float:
        started = time.perf_counter()
        busy = [asyncio.create_task(send("a", f"a{i}")) for i in range(4)]
        await asyncio.sleep(0)  # a's four messages queue first, then b's one
        await asyncio.gather(*busy, send("b", "b0"))
        return time.perf_counter() - started

    elapsed = asyncio.run(main())
    # One wire: five messages take five transmissions; b's waits for one of a's, not four.
    assert elapsed >= 0.1
    assert finished.index("b0") == 1
    assert uplink.bytes_sent == 100_000


def test_uplink_passes_the_turn_on_when_a_sender_is_cancelled() -> None:
    uplink = Uplink(mbps=8.0)

    async def main() -> None:
        first = asyncio.create_task(uplink.send(20_000, "a"))
        waiting = asyncio.create_task(uplink.send(20_000, "b"))
        await asyncio.sleep(0.005)
        waiting.cancel()
        await first
        await asyncio.wait_for(uplink.send(20_000, "c"), timeout=1.0)  # not stuck behind b

    asyncio.run(main())
    with pytest.raises(ValueError):
        LinkProfile(uplink_mbps=0.0)

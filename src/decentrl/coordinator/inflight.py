"""How many rows the coordinator keeps in flight through the swarm, and in how many sessions.

Stage peers batch the decoding steps of all their sessions into one forward per tick
(stage/batching.py), so what keeps them busy is the number of rows in flight: enough that every
peer has rows to step while others cross the network. By Little's law, the rows in flight a
swarm needs are its throughput (rows stepped per second) times a step's round trip through the
chain. Measured at the rows in flight of the moment that product is those rows themselves, so
`RowsInFlight` estimates the swarm's capacity the way BBR estimates a network path's (Cardwell
et al., 2016): the most rows stepped per second over the last RATE_WINDOW intervals, and the
shortest round trip of a decoding step (the median of an interval) over the last FLOOR_WINDOW;
their product is the rows the swarm keeps busy with nothing queued. The allowed rows are not
all decoding all the time (a session prefills, ends, and the next one starts), so the target is
the allowed rows times HEADROOM x that product over the rows that were decoding on average
(Little's L: rows x round trip, summed, over the interval). While latency dominates, the two
are equal and the target grows by HEADROOM each interval; once the peers are saturated, the
round trip grows with the rows and the target holds where it is about HEADROOM x its floor: the
rows beyond the floor's worth wait at a peer for its next tick, so no peer idles while steps
cross the network.

A floor measured under load is no floor: after FLOOR_WINDOW intervals of saturation the window
holds only round trips that queueing lengthened, and the target would grow with them, without
end. BBR drains the path now and then to measure it again; sessions here last many steps, so
draining would be slow and costly. Instead the rows in flight grow only while growing pays:
once they grew, they grow again only after at least PAYOFF of the rows added turned into
throughput (latency-bound, all of them do; saturated, none), and hold otherwise (`limited_by`
"throughput flat"). So they settle between the swarm's bandwidth-delay product, where the peers
are full, and HEADROOM times it. Shrinking is always allowed, and it resets that judgement (the
throughput of the last growth came from a swarm that no longer is: training took the CPU, a
replica left; held to it, the rows would never grow again), and a floor that rose for good (a
slower network) replaces the old one within FLOOR_WINDOW intervals.

The target stays within bounds: at least one session; at most the rows a training step can use
before they go stale (`groups_in_flight`: more generated ahead only waits, aging), the sessions
each replica has room for (`session_room`, per peer and sender, less what spot-checks use) and
the rows whose KV caches fit in a replica's budget for this sender, times the replicas of the
stage that has fewest. A fixed `swarm.sessions_in_flight` replaces the measured target.

Sessions carry `groups_per_session` groups, fixed for the run: evaluation sessions take the same
shape, and every evaluation of a run draws the same noise. The generation loops are started at
the most sessions the run could use (`max_sessions`); `SessionSlots` lets as many run at once as
the target allows, evaluation sessions included (`SlottedChain`): together they never pass it."""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from decentrl.config import RunConfig, SwarmConfig
from decentrl.rollout.chain import InferenceChain, InferenceSession, StepResult
from decentrl.rollout.sampling import SamplingConfig

log = logging.getLogger(__name__)

# A step's round trip settles at about this multiple of its floor (see the module docstring):
# half of it rows waiting or computing at the peers, half crossing the network.
HEADROOM = 2.0
# How often the target moves, and the decoding steps an interval needs to count: fewer give a
# median round trip that one straggler moves.
UPDATE_EVERY_S = 2.0
MIN_STEPS_PER_UPDATE = 8
# Intervals the throughput's maximum is taken over: short, so that a swarm that lost a replica
# is sized down within seconds.
RATE_WINDOW = 5
# Intervals the round trip's floor is taken over: long, so that a floor measured with few rows
# in flight outlives a minute of saturation (a floor measured under load would raise the target
# it was measured at).
FLOOR_WINDOW = 30
# The share of the rows the last growth added that must have turned into throughput before the
# rows in flight grow again: half, halfway between latency-bound (all) and saturated (none).
PAYOFF = 0.5
# Sessions of each replica's budget for this sender left to spot-checks (the verifier holds one
# session per peer of its panel at a time; a closed one may linger until the peer drops it).
VERIFY_SESSIONS = 2
# The prompt length the automatic `groups_per_session` allows for beside rollout.max_new_tokens:
# the chat-formatted prompts of the built-in tasks and environments are under 400 tokens.
PROMPT_ALLOWANCE = 512
# How long a generation loop waiting for a session slot sleeps before it looks at its stop event.
SLOT_WAIT_S = 0.5


def groups_in_flight(config: RunConfig) -> int:
    """The most groups worth generating at once: a group in flight when a step takes its batch is
    trained about (groups in flight / groups per step) steps later, each step
    `train.optimizer_steps_per_batch` versions, so more than the steps' worth of
    `train.max_staleness` versions only goes stale (one step's worth when that is none)."""
    steps = config.train.max_staleness // config.train.optimizer_steps_per_batch
    return config.rollout.prompts_per_step * max(1, steps)


def session_room(swarm: SwarmConfig) -> int:
    """The generation sessions one replica takes from this coordinator: its sessions per peer
    and per sender, less what spot-checks use."""
    return max(1, min(swarm.max_sessions_per_peer, swarm.max_sessions_per_sender)
               - VERIFY_SESSIONS)


def groups_per_session(config: RunConfig) -> int:
    """`swarm.groups_per_session`, or else the fewest groups per session that fit the groups
    worth generating at once into the sessions one replica per stage has room for, no more than
    a peer accepts in one session (prompts of up to PROMPT_ALLOWANCE tokens)."""
    if config.swarm.groups_per_session is not None:
        return config.swarm.groups_per_session
    wanted = math.ceil(groups_in_flight(config) / session_room(config.swarm))
    positions = config.rollout.max_new_tokens + PROMPT_ALLOWANCE
    fits = config.swarm.max_session_tokens // (config.rollout.group_size * positions)
    return max(1, min(wanted, fits))


class SessionSlots:
    """The generation sessions that may run at once. A generation loop holds a slot while its
    session runs; a lower limit lets the running sessions finish and starts no new one."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"session slots need a limit of at least 1, got {limit}")
        self._limit, self._running = limit, 0
        self._changed = threading.Condition()

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def running(self) -> int:
        return self._running

    def set_limit(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"session slots need a limit of at least 1, got {limit}")
        with self._changed:
            self._limit = limit
            self._changed.notify_all()

    def acquire(self, stop: threading.Event) -> bool:
        """Take a slot once one is free (True), or return False once `stop` is set."""
        with self._changed:
            while self._running >= self._limit:
                if stop.is_set():
                    return False
                self._changed.wait(SLOT_WAIT_S)
            self._running += 1
            return True

    def release(self) -> None:
        with self._changed:
            if self._running < 1:
                raise RuntimeError("a session slot released more often than taken")
            self._running -= 1
            self._changed.notify_all()


@dataclass(frozen=True)
class InflightState:
    """What the controller decided, and from what."""

    rows: int  # rows allowed in flight: sessions x groups per session x group size
    sessions: int
    round_trip_s: float | None  # the floor of a decoding step's round trip; None: not measured
    rows_per_s: float | None  # the most rows stepped per second lately; None: not measured
    limited_by: str  # what set `rows`: "measured", "fixed", "start", "throughput flat" (held), or
    # the bound that capped it ("staleness", "sessions per replica", "KV budget per replica")


class RowsInFlight:
    """Sizes the rows in flight from the decoding steps the coordinator's sessions report
    (`observe`), and moves `slots` accordingly. Thread-safe: every generation and evaluation
    thread reports its steps."""

    def __init__(self, config: RunConfig, replicas: Callable[[], list[int]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`replicas`: the inference replicas of each stage the run may use now."""
        swarm, rollout = config.swarm, config.rollout
        self.replicas, self.clock = replicas, clock
        self.groups_per_session = groups_per_session(config)
        self.session_rows = self.groups_per_session * rollout.group_size
        self.demand_rows = groups_in_flight(config) * rollout.group_size
        self.fixed_sessions = swarm.sessions_in_flight
        self.max_sessions = self.fixed_sessions or math.ceil(self.demand_rows / self.session_rows)
        self.room_per_replica = session_room(swarm)
        self.kv_tokens_per_replica = min(swarm.max_cached_tokens_per_sender, swarm.kv_pool_tokens)
        # Positions a session reserves, the longest seen so far (prompt and new tokens).
        self.session_length = rollout.max_new_tokens + 1
        self.lock = threading.Lock()
        # Rows stepped and round trips of the decoding steps of the current interval.
        self.interval_began = clock()
        self.rows_stepped = 0
        self.row_seconds = 0.0  # rows x round trip, summed: Little's L times the interval
        self.round_trips: list[float] = []
        self.rates: deque[float] = deque(maxlen=RATE_WINDOW)
        self.floors: deque[float] = deque(maxlen=FLOOR_WINDOW)
        # The throughput and the rows in flight before and after they last grew (None: never),
        # and the most throughput since.
        self.last_growth: tuple[float, int, int] | None = None
        self.rate_since_growth = 0.0
        # A fixed count, or one session: the floor of the round trip is measured before anything
        # queues (started above the swarm's bandwidth-delay product, it would never be seen),
        # and the target doubles each interval from there.
        start = self.fixed_sessions or 1
        self.state = InflightState(start * self.session_rows, start, None, None,
                                   "fixed" if self.fixed_sessions is not None else "start")
        self.slots = SessionSlots(start)

    def observe(self, rows: int, positions: int, max_length: int, seconds: float) -> None:
        """One step of a session of `rows` rows and `max_length` positions, which fed
        `positions` new ones per row and took `seconds` through the whole chain. Only decoding
        steps (one position) are timed: a prefill's round trip says nothing of a decoding
        step's."""
        with self.lock:
            self.session_length = max(self.session_length, max_length)
            if positions != 1:
                return
            self.rows_stepped += rows
            self.row_seconds += rows * seconds
            self.round_trips.append(seconds)
            now = self.clock()
            if now - self.interval_began < UPDATE_EVERY_S \
                    or len(self.round_trips) < MIN_STEPS_PER_UPDATE:
                return
            before, after = self.state, self._update(now)
        self.slots.set_limit(after.sessions)
        if after.sessions != before.sessions:
            log.info("rows in flight %d -> %d (%d sessions of %d groups; %s): decoding step "
                     "round trip floor %.0f ms, up to %.0f rows stepped/s", before.rows,
                     after.rows, after.sessions, self.groups_per_session, after.limited_by,
                     1000 * (after.round_trip_s or 0.0), after.rows_per_s or 0.0)

    def _update(self, now: float) -> InflightState:
        """Close the interval and size the rows in flight from the windows (under the lock)."""
        elapsed = now - self.interval_began
        latest = self.rows_stepped / elapsed
        decoding = self.row_seconds / elapsed  # rows in a decoding step, on average
        self.rates.append(latest)
        self.floors.append(statistics.median(self.round_trips))
        self.interval_began, self.rows_stepped, self.row_seconds = now, 0, 0.0
        self.round_trips = []
        self.rate_since_growth = max(self.rate_since_growth, latest)
        rate, floor = max(self.rates), min(self.floors)
        if self.fixed_sessions is not None:
            sessions, limited_by = self.fixed_sessions, "fixed"
        else:
            # The rows the swarm keeps busy at the floor (rate x floor), over those that were
            # decoding: the allowed rows were decoding only part of the time (prefills, a
            # session's turnover), and the allowed rows are what the slots set.
            wanted = HEADROOM * self.state.rows * rate * floor / decoding
            highest, limited_by = min(self._upper_bounds(), key=lambda bound: bound[0])
            sessions = int(highest // self.session_rows)  # a bound is never passed
            if wanted <= highest:
                # The nearest count: HEADROOM is the margin, not a rounding up.
                sessions, limited_by = min(sessions, round(wanted / self.session_rows)), "measured"
            sessions = min(self.max_sessions, max(1, sessions))
            if sessions < self.state.sessions:
                # What the swarm can do changed (training took the CPU, a replica left): the
                # throughput the last growth was judged by no longer says what growth pays.
                self.last_growth, self.rate_since_growth = None, latest
            elif sessions > self.state.sessions:
                if self._growth_paid():
                    self.last_growth = (self.rate_since_growth, self.state.sessions, sessions)
                    self.rate_since_growth = 0.0
                else:
                    sessions, limited_by = self.state.sessions, "throughput flat"
        self.state = InflightState(sessions * self.session_rows, sessions, floor, rate,
                                   limited_by)
        return self.state

    def _growth_paid(self) -> bool:
        """Whether at least PAYOFF of the rows the last growth added turned into throughput."""
        if self.last_growth is None:
            return True
        rate, before, after = self.last_growth
        return self.rate_since_growth >= rate * (1 + PAYOFF * (after / before - 1))

    def _upper_bounds(self) -> list[tuple[float, str]]:
        """(rows, what bounds them) of every bound on the rows in flight."""
        fewest = max(1, min(self.replicas(), default=1))  # none at all: generation waits anyway
        rows_per_replica = self.kv_tokens_per_replica // self.session_length
        return [(self.demand_rows, "staleness"),
                (fewest * self.room_per_replica * self.session_rows, "sessions per replica"),
                (fewest * rows_per_replica, "KV budget per replica")]


class SlottedChain:
    """`chain`, whose sessions each hold one of `slots` while open: evaluation sessions share
    the rows in flight (and the peers' room) with the generation loops."""

    def __init__(self, chain: InferenceChain, slots: SessionSlots) -> None:
        self.chain, self.slots = chain, slots

    @property
    def device(self) -> torch.device:
        return self.chain.device

    def versions(self) -> tuple[int, ...]:
        return self.chain.versions()

    def open_session(self, batch: int, max_length: int) -> SlottedSession:
        self.slots.acquire(threading.Event())  # an evaluation runs to its end
        try:
            return SlottedSession(self.chain.open_session(batch, max_length), self.slots)
        except BaseException:
            self.slots.release()
            raise


class SlottedSession:
    """A session of a `SlottedChain`: closing it frees its slot."""

    def __init__(self, session: InferenceSession, slots: SessionSlots) -> None:
        self.session, self.slots = session, slots
        self.closed = False

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor,
             sampling: SamplingConfig, seed: int | None) -> StepResult:
        return self.session.step(tokens, positions, key_valid, sampling, seed)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.session.close()
        finally:
            self.slots.release()

"""Strikes against the senders of requests refused as their own fault (decentrl/errors.py
`SenderFault`: malformed, unsigned, over a limit, not theirs to make): `strikes_to_block` of them
within `strike_window_s` block a sender for `block_s`, during which its requests are refused
unread."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from decentrl.errors import DecentrlError
from decentrl.net.text import peer_text

log = logging.getLogger(__name__)

STRIKES_TO_BLOCK = 20
STRIKE_WINDOW_S = 60.0
BLOCK_S = 300.0
# Senders with recent strikes, and blocked senders, that are remembered. A stream of throwaway
# identities must not grow either table without end, and identities are free, so a cap costs no
# protection: past it, strikes are forgotten stalest first (their sender starts over, as a fresh
# identity would) and blocks soonest to end first. An honest swarm has tens of peers. (Ended
# blocks also go when their sender is looked up.)
STRIKE_TABLE_SIZE = 1024
BLOCK_TABLE_SIZE = 1024


class SenderBlocked(DecentrlError, RuntimeError):
    """A request refused unread: its sender sent too many malformed ones lately. Not a strike."""


class Strikes:
    """The strikes and blocks of one node (`name`), by sender: written on its loop, read from
    any thread."""

    def __init__(self, name: str, strikes_to_block: int = STRIKES_TO_BLOCK,
                 strike_window_s: float = STRIKE_WINDOW_S, block_s: float = BLOCK_S) -> None:
        if strikes_to_block < 1 or strike_window_s <= 0 or block_s < 0:
            raise ValueError(f"need strikes_to_block >= 1, strike_window_s > 0, block_s >= 0; got "
                             f"{strikes_to_block}, {strike_window_s}, {block_s}")
        self.name = name
        self.strikes_to_block = strikes_to_block
        self.strike_window_s = strike_window_s
        self.block_s = block_s
        # Called with (peer id, reason) on each strike, from the loop thread.
        self.on_strike: Callable[[str, str], None] | None = None
        # Where strike and block times are read, in monotonic seconds. An attribute, so a test can
        # move a block's end past without waiting for it.
        self.clock: Callable[[], float] = time.monotonic
        self._lock = threading.Lock()
        # Least recently struck first.
        self._times: OrderedDict[str, deque[float]] = OrderedDict()
        self._blocks: dict[str, tuple[float, int]] = {}  # sender -> (until, strikes)

    def count(self, peer: str) -> int:
        """`peer`'s strikes within the last `strike_window_s` (0 while it is blocked)."""
        horizon = self.clock() - self.strike_window_s
        with self._lock:
            return sum(t > horizon for t in self._times.get(peer, ()))

    def blocked(self, peer: str) -> bool:
        return self._block_left(peer) is not None

    def _block_left(self, peer: str) -> tuple[float, int] | None:
        """(seconds left, strikes that caused it) of `peer`'s block, or None."""
        now = self.clock()
        with self._lock:
            block = self._blocks.get(peer)
            if block is None:
                return None
            until, strikes = block
            if until <= now:
                del self._blocks[peer]
                return None
            return until - now, strikes

    def refuse_if_blocked(self, sender: str) -> None:
        block = self._block_left(sender)
        if block is not None:
            left, strikes = block
            raise SenderBlocked(f"peer {sender[-8:]} is blocked for {left:.0f}s after {strikes} "
                                f"malformed requests")

    def strike(self, sender: str, method: str, error: Exception) -> None:
        """Count a request refused as its sender's fault against it; block it at the limit."""
        now = self.clock()
        horizon = now - self.strike_window_s
        with self._lock:
            block = self._blocks.get(sender)
            if block is not None and block[0] > now:
                return  # a request that was in flight when the block began
            self._blocks.pop(sender, None)
            times = self._times.setdefault(sender, deque())
            self._times.move_to_end(sender)
            times.append(now)
            while times[0] <= horizon:
                times.popleft()
            count = len(times)
            if count >= self.strikes_to_block:
                del self._times[sender]
                while len(self._blocks) >= BLOCK_TABLE_SIZE:
                    # The first block in the table ends first (each lasts block_s): ended or
                    # ending soonest, it is the one to forget.
                    del self._blocks[next(iter(self._blocks))]
                self._blocks[sender] = (now + self.block_s, count)
            while len(self._times) > STRIKE_TABLE_SIZE:
                self._times.popitem(last=False)
        # The error's text may be the sender's own (a field name, a session id): made inert.
        log.info("%s: %s from %s refused (strike %d of %d): %s", self.name, method, sender[-8:],
                 count, self.strikes_to_block, peer_text(error))
        if count >= self.strikes_to_block:
            log.warning("%s: blocking %s for %.0fs after %d malformed requests in %.0fs",
                        self.name, sender[-8:], self.block_s, count, self.strike_window_s)
        if self.on_strike is not None:
            try:
                self.on_strike(sender, f"{method}: {error}")
            except Exception:  # a listener's bug must not break serving
                log.exception("%s: on_strike failed", self.name)

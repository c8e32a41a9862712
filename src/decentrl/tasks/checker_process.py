"""Answer checks in a child process under a watchdog: math-verify and a user's verifier function.

Completions come from untrusted peers, and checking one can hang: sympy evaluating
`\\boxed{9^{9^{9^{9}}}}`, a user's regular expression backtracking. The coordinator computes rewards
on its loop's thread and on evaluation threads, where math-verify's SIGALRM timeouts cannot work
(signals reach the main thread only: math-verify raises ValueError elsewhere) and where a hung call
could never be stopped. So each checker runs in a child process of its own
(tasks/checker_child.py), started on first use and kept: math-verify and sympy take about a second
to import, an honest check a few milliseconds. The parent sends one request at a time (a lock: any
thread may call) and waits at most `timeout_s`; past that it kills the child's process group, the
check fails (reward 0) and the next request starts a fresh child. A child that dies (its memory
limit, a crash) fails its request the same way.

A reward must be a pure function of (problem, completion), since the coordinator recomputes it. A
check is, except for one that ends within a hair of `timeout_s` on one machine and past it on
another: honest checks take milliseconds, so keep `timeout_s` far above them.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

_CHILD_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checker_child.py")
# A busy machine can take several seconds to start an interpreter and import sympy.
STARTUP_TIMEOUT_S = 60.0
# A reply is a short JSON object; anything longer is a broken child.
MAX_REPLY_BYTES = 64 * 1024


def kill_group(process: subprocess.Popen[bytes]) -> None:
    """Kill the child's whole process group (whatever it started too) and reap it."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()
    for stream in (process.stdin, process.stdout):
        if stream is not None:
            stream.close()


class CheckerProcess:
    """`check(completion, answer)` for `checker` ("math" or "module:function") in a child."""

    def __init__(self, checker: str, timeout_s: float, memory_mb: int | None = None) -> None:
        self.checker = checker
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._selector: selectors.BaseSelector | None = None
        self._buffer = b""
        self._reaper: weakref.finalize | None = None

    def check(self, completion: str, answer: str) -> tuple[float, str | None]:
        """(score, None), or (0.0, why) when the check failed: the verifier raised or returned
        something else than a score, the child timed out or died. Raises RuntimeError only when
        the child cannot start at all."""
        with self._lock:
            if self._process is None:
                self._start()
            request = json.dumps({"completion": completion, "answer": answer}) + "\n"
            reply = self._exchange(request.encode("utf-8"), self.timeout_s)
            if reply is None:
                self._stop()
                return 0.0, f"no answer within {self.timeout_s} s (the checker process was "\
                            "restarted)"
            if "error" in reply:
                return 0.0, str(reply["error"])
            return float(reply["score"]), None

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _start(self) -> None:
        process = subprocess.Popen(
            [sys.executable, "-I", "-B", _CHILD_FILE], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
        # Kills the child when this object goes away without close(), or at exit.
        self._reaper = weakref.finalize(self, kill_group, process)
        self._process, self._buffer = process, b""
        self._selector = selectors.DefaultSelector()
        assert process.stdout is not None
        self._selector.register(process.stdout, selectors.EVENT_READ)
        setup = {"sys_path": sys.path, "checker": self.checker, "memory_mb": self.memory_mb}
        reply = self._exchange((json.dumps(setup) + "\n").encode("utf-8"), STARTUP_TIMEOUT_S)
        if reply is None or "error" in reply:
            self._stop()
            why = "it did not start" if reply is None else reply["error"]
            raise RuntimeError(f"answer checker {self.checker!r} cannot run: {why}")

    def _stop(self) -> None:
        if self._reaper is not None:
            self._reaper()  # kill_group, once
        if self._selector is not None:
            self._selector.close()
        self._process, self._selector, self._reaper, self._buffer = None, None, None, b""

    def _exchange(self, request: bytes, timeout_s: float) -> dict[str, Any] | None:
        """The child's reply to `request`, or None if it sent none in time or broke."""
        assert self._process is not None and self._process.stdin is not None
        try:
            self._process.stdin.write(request)
            self._process.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        line = self._read_line(time.monotonic() + timeout_s)
        if line is None:
            return None
        try:
            reply = json.loads(line)
        except ValueError:
            return None
        return reply if isinstance(reply, dict) else None

    def _read_line(self, deadline: float) -> bytes | None:
        assert self._process is not None and self._selector is not None
        assert self._process.stdout is not None
        descriptor = self._process.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not self._selector.select(left):
                return None
            chunk = os.read(descriptor, MAX_REPLY_BYTES)
            if not chunk or len(self._buffer) + len(chunk) > MAX_REPLY_BYTES:
                return None  # the child ended, or says far more than a reply
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

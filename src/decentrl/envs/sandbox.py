"""Evaluate a model-written arithmetic expression in a sandbox: the calculator tool of the agentic
environments.

`run_expression("(3 + 4) * 12")` returns `ToolResult(ok=True, output="84", error=None)`; a failure
(a syntax error, a refused construct, a timeout, the memory limit) returns `ok=False` and a short
error the model can read. Everything in the expression is hostile input, so there are layers, each
meant to hold if the one before it has a hole:

1. Input checks in the caller's process: the expression must be a string of at most
   MAX_EXPRESSION_CHARS characters. The caller's process never parses or evaluates it.
2. A whitelist interpreter, in a child process. The text is parsed with `ast.parse(mode="eval")`
   and every node must be on a whitelist: number/string/bool/None literals, `+ - * / // % **`,
   unary `- + not`, `and`/`or`, comparisons (no `is`), `x if c else y`, tuple/list/set/dict
   displays, and calls by bare name to a few pure functions (abs, min, max, round, sum, len, int,
   float, pow, sqrt, floor, ceil, gcd, lcm, factorial, comb, log, log2, log10, exp, sin, cos, tan)
   plus the names pi, e and tau. Attribute access, subscripts, lambdas, comprehensions, f-strings,
   `:=`, keyword arguments and every other name are refused before anything runs, and the tree is
   evaluated by our own interpreter, never by `eval`/`exec`. So there is no path to `__class__`,
   `__subclasses__`, `__import__`, `open`, modules or any object but plain values: this is what
   stops escapes. Trees deeper than MAX_DEPTH are refused (the interpreter recurses).
3. Size guards in that interpreter refuse, before computing them, results that would be
   astronomically large: `**`/pow past MAX_INT_BITS bits (`9**9**9`), `*` repetition past
   MAX_ITEMS items (`'x'*10**10`), factorial/comb of n > MAX_FACTORIAL_ARGUMENT, round to more than
   MAX_ROUND_DIGITS digits, and `%` string formatting (`'%999999999d' % 1`). Every intermediate
   int must fit in MAX_INT_BITS bits and every string/collection in MAX_ITEMS items. They do not
   bound the total work of many legal operations nor values built by nesting repetitions
   (`[[0]*10**6]*10**6` is ten million small items to compare or print): layers 5 and 6 stop those.
4. A fresh interpreter per call (`python -I -S -B sandbox_child.py`), not a fork: it holds
   nothing of the caller (no model, no peer keys, no sockets, no other threads' locks), gets an
   empty environment, `/` as working directory, its own session and process group, and only three
   file descriptors: the expression on stdin, the reply on stdout, /dev/null as stderr.
5. Resource limits, set in the child before it reads the expression: RLIMIT_AS (memory_mb of
   address space: a MemoryError is reported as "memory limit exceeded"), an ITIMER_PROF timer at
   timeout_s + CPU_TIMER_MARGIN_S of CPU time whose SIGPROF, left to its default action, ends the
   child even inside one long C operation (RLIMIT_CPU counts whole seconds only: it stays, at
   ceil(timeout_s) seconds, as the backstop), RLIMIT_NOFILE 0 (no new file descriptors: no file
   can be opened, no socket created), RLIMIT_FSIZE 0 (no file can be written), RLIMIT_NPROC 0 (no
   fork; the kernel does not apply it to root) and RLIMIT_CORE 0. A SIGALRM timer at timeout_s
   stops pure-Python work with a clean "timeout" error.
6. A watchdog in the caller: past timeout_s plus a startup allowance it kills the child's whole
   process group, and it kills the group before reaping the child on every path. It reads at most
   a bounded number of bytes of reply, checks its shape, truncates and re-encodes it. Reaping
   reads the child's resource usage: `ToolResult.cpu_s` is the CPU time it used (user + system,
   startup included), which is what an episode's tool budget (envs/budget.py) counts.

What this does not defend against: there is no seccomp filter, no namespace (network, mount, pid,
user) and no cgroup. Code that escaped the interpreter (a memory-corruption bug in CPython reachable
through whitelisted operations) could still make system calls that need no new file descriptor
(kill, unlink, rename, execve) with the caller's user rights, and a root child can raise its own
limits again. Run peers as an unprivileged user, or put the child in nsjail/bubblewrap, for that.

One call costs a fresh interpreter, imports included: about 50 ms on a busy two-core machine.
"""

from __future__ import annotations

import json
import math
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from decentrl.envs.sandbox_child import timeout_error, truncate

MAX_EXPRESSION_CHARS = 500
# The child interpreter itself takes about 16 MB of address space before it evaluates anything.
MIN_MEMORY_MB = 64
MIN_OUTPUT_CHARS = 10
# Time the child may take to start before its timeout_s of evaluation begins (a busy machine is
# slow to start a process).
STARTUP_ALLOWANCE_S = 1.0

# The child's program: run as a script in a bare interpreter, it imports nothing of ours.
_CHILD_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")


@dataclass(frozen=True)
class ToolResult:
    """What the tool answers: `output` (the value's repr, truncated) when `ok`, else `error`.

    `cpu_s` and `timed_out` say what the answer cost, not what it is: two results compare equal
    without them."""

    ok: bool
    output: str
    error: str | None
    cpu_s: float = field(default=0.0, compare=False)  # CPU seconds of the child; 0.0: none ran
    timed_out: bool = field(default=False, compare=False)  # stopped at its time limit


def run_expression(
    expression: str,
    timeout_s: float = 1.0,
    memory_mb: int = 256,
    max_output_chars: int = 200,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> ToolResult:
    """Evaluate `expression` in a sandboxed child process (see the module docstring).

    Never raises for anything in `expression` (a non-string one included: it comes from a model);
    raises ValueError for a bad `timeout_s`, `memory_mb` or `max_output_chars`. `clock` is the
    watchdog's, in monotonic seconds: a test passes one it controls to put the watchdog's
    deadline where it wants without waiting for it."""
    _check_limits(timeout_s, memory_mb, max_output_chars)
    if not isinstance(expression, str):
        kind = type(expression).__name__
        return _failure(f"TypeError: the expression must be a string, not {kind}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        return _failure(f"not allowed: expressions longer than {MAX_EXPRESSION_CHARS} characters")
    command = [
        sys.executable, "-I", "-S", "-B", _CHILD_FILE,
        repr(float(timeout_s)), str(memory_mb), str(max_output_chars),
    ]  # fmt: skip
    deadline = clock() + timeout_s + STARTUP_ALLOWANCE_S
    try:
        child = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            bufsize=0,
            env={},
            cwd="/",
            start_new_session=True,
        )
    except OSError as error:
        return _failure(f"sandbox failed to start: {error}")
    with child:  # closes the pipes
        try:
            reply = _exchange(child, expression.encode("utf-8", "surrogatepass"), deadline, clock)
        finally:
            # Before reaping: until then the child's pid, which is its group's id, stays ours.
            _kill_process_group(child.pid)
            cpu_s = _reap(child)
    if reply is None:
        result = _failure(timeout_error(timeout_s))
    else:
        parsed = _parse_reply(reply, max_output_chars)
        result = parsed if parsed is not None else _failure(
            _crash_error(child.returncode, timeout_s))
    return replace(result, cpu_s=cpu_s, timed_out=result.error == timeout_error(timeout_s))


def _check_limits(timeout_s: float, memory_mb: int, max_output_chars: int) -> None:
    if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if not (isinstance(memory_mb, int) and memory_mb >= MIN_MEMORY_MB):
        raise ValueError(f"memory_mb must be an integer >= {MIN_MEMORY_MB}, got {memory_mb!r}")
    if not (isinstance(max_output_chars, int) and max_output_chars >= MIN_OUTPUT_CHARS):
        raise ValueError(
            f"max_output_chars must be an integer >= {MIN_OUTPUT_CHARS}, got {max_output_chars!r}"
        )


def _failure(error: str) -> ToolResult:
    return ToolResult(ok=False, output="", error=error)


def _exchange(
    child: subprocess.Popen[bytes], request: bytes, deadline: float, clock: Callable[[], float]
) -> bytes | None:
    """Send the expression to the child and read its reply until it closes stdout; None when the
    deadline passes first. Stops reading past _MAX_REPLY_BYTES (the reply is then malformed)."""
    assert child.stdin is not None and child.stdout is not None
    try:
        # At most 4 * MAX_EXPRESSION_CHARS bytes: fits in an empty pipe, so this cannot block.
        child.stdin.write(request)
        child.stdin.close()
    except BrokenPipeError:
        pass  # the child died before reading; its exit status says why
    reply = bytearray()
    with selectors.DefaultSelector() as selector:
        selector.register(child.stdout, selectors.EVENT_READ)
        while (remaining_s := deadline - clock()) > 0:
            if not selector.select(remaining_s):
                continue
            chunk = os.read(child.stdout.fileno(), 65536)
            reply += chunk
            if not chunk or len(reply) > _MAX_REPLY_BYTES:
                return bytes(reply)
    return None


# The child truncates its texts, so an honest reply is far smaller than this.
_MAX_REPLY_BYTES = 1 << 20


def _kill_process_group(group_id: int) -> None:
    try:
        os.killpg(group_id, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(child: subprocess.Popen[bytes]) -> float:
    """Reap the child and return the CPU seconds it used. os.wait4 rather than Popen.wait, which
    drops the resource usage; getrusage(RUSAGE_CHILDREN) would mix in the children that other
    threads reap meanwhile."""
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)  # Popen then knows it is reaped
    return usage.ru_utime + usage.ru_stime


def _parse_reply(reply: bytes, max_output_chars: int) -> ToolResult | None:
    """The ToolResult in a reply of the child, or None when the reply is not a well-formed one."""
    if len(reply) > _MAX_REPLY_BYTES:
        return None
    try:
        fields = json.loads(reply)
    except ValueError:
        return None
    if not isinstance(fields, dict) or not isinstance(ok := fields.get("ok"), bool):
        return None
    text = fields.get("output" if ok else "error")
    if not isinstance(text, str):
        return None
    text = truncate(_displayable(text), max_output_chars)
    return ToolResult(ok=True, output=text, error=None) if ok else _failure(text)


def _displayable(text: str) -> str:
    # A lone surrogate would break whoever encodes the text later (the tokenizer, a log).
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _crash_error(returncode: int | None, timeout_s: float) -> str:
    """The error for a child that gave no usable reply, from its exit status."""
    if returncode is not None and returncode < 0:
        if -returncode in (signal.SIGPROF, signal.SIGXCPU):
            return timeout_error(timeout_s)
        try:
            signal_name = signal.Signals(-returncode).name
        except ValueError:
            signal_name = f"signal {-returncode}"
        return f"sandbox crashed: killed by {signal_name}"
    return f"sandbox crashed: exit status {returncode}"


__all__ = ["ToolResult", "run_expression"]

"""The calculator tool's sandbox: right answers, refusals, runaway code stopped, no process left."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from decentrl.envs import sandbox, sandbox_child
from decentrl.envs.sandbox import (
    MAX_EXPRESSION_CHARS,
    STARTUP_ALLOWANCE_S,
    ToolResult,
    run_expression,
)
from decentrl.envs.sandbox_child import MEMORY_LIMIT_ERROR, TRUNCATION_MARKER

# Each max() is short: the child's SIGALRM timer can stop the evaluation between them.
MANY_SHORT_STEPS = " + ".join(["max([0] * 10**6)"] * 25)
# One comparison of 10**12 items never returns to the interpreter: no timer in the child can stop
# it, only its CPU limit or the caller's watchdog.
NESTED = "[[[0] * 10**4] * 10**4] * 10**4"
ONE_ENDLESS_STEP = f"{NESTED} == {NESTED}"


class ScriptedClock:
    """A watchdog clock that reads `times` in turn, then the last one forever; it counts its
    reads."""

    def __init__(self, *times: float) -> None:
        self.times = list(times)
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.times[min(self.reads, len(self.times)) - 1]


@pytest.fixture
def children(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Every child the sandbox starts, to read how it ended."""
    started: list[subprocess.Popen[bytes]] = []

    class RecordingPopen(subprocess.Popen):  # type: ignore[type-arg]
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            started.append(self)

    monkeypatch.setattr(sandbox.subprocess, "Popen", RecordingPopen)
    yield started


# --- ordinary arithmetic --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "output"),
    [
        ("(3 + 4) * 12", "84"),
        ("2 + 3 * 4 - 1", "13"),
        ("2 ** 3 ** 2", "512"),  # right-associative
        ("-2 ** 2", "-4"),  # ** binds tighter than unary minus
        ("7 / 2", "3.5"),
        ("7 // 2 + -7 % 3", "5"),
        ("0.1 + 0.2", "0.30000000000000004"),
        ("1_000 * 3", "3000"),
        ("10 ** 30", "1" + "0" * 30),
        ("sqrt(16) + floor(2.7) + ceil(2.1)", "9.0"),
        ("max(3, 9, 2) - min([4, 5])", "5"),
        ("round(2.675, 2)", "2.67"),
        ("round(7.5)", "8"),
        ("factorial(5) + comb(5, 2) + gcd(12, 18)", "136"),
        ("abs(-3) + len([1, 2]) + sum((1, 2, 3.5))", "11.5"),
        ("pow(2, 10)", "1024"),
        ("log(8, 2) + log10(100)", "5.0"),
        ("pi * 2 == tau", "True"),
        ("int('12') + float('0.5')", "12.5"),
        ("2 < 3 <= 3 > 1", "True"),
        ("1 if 0 else 2", "2"),
        ("0 or [] or 5", "5"),
        ("1 and 0", "0"),
        ("not 3 in [1, 2]", "True"),
        ("[1, 2] + [3]", "[1, 2, 3]"),
        ("(1,)", "(1,)"),
        ("{'a': 1}", "{'a': 1}"),
        ("'ab' * 2", "'abab'"),
        ("  7  ", "7"),
    ],
)
def test_ordinary_arithmetic(expression: str, output: str) -> None:
    assert run_expression(expression) == ToolResult(ok=True, output=output, error=None)


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("1 / 0", "ZeroDivisionError: division by zero"),
        ("sqrt(-1)", "ValueError: math domain error"),
        ("abs(1, 2)", "TypeError: abs() takes 1 argument, got 2"),
        ("min()", "TypeError: min() takes at least 1 arguments, got 0"),
        ("sum(['a'])", "TypeError: unsupported operand type(s) for +: 'int' and 'str'"),
        ("1 +", "SyntaxError: invalid syntax"),
        ("(2", "SyntaxError: '(' was never closed at column 1"),
        ("1 2", "SyntaxError: invalid syntax"),
        ("x = 3", "SyntaxError: invalid syntax"),
        ("import os", "SyntaxError: invalid syntax"),
        ("", "SyntaxError: invalid syntax"),
    ],
)
def test_errors_are_reported_as_python_would(expression: str, error: str) -> None:
    result = run_expression(expression)
    assert not result.ok and result.output == ""
    assert result.error is not None and result.error.startswith(error)


# --- escapes --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("().__class__", "not allowed: attribute access"),
        ("().__class__.__base__.__subclasses__()", "not allowed: attribute access"),
        ("(1).real", "not allowed: attribute access"),
        ("__import__('os')", "NameError: name '__import__' is not defined"),
        ("open('/etc/passwd')", "NameError: name 'open' is not defined"),
        ("eval('1')", "NameError: name 'eval' is not defined"),
        ("os", "NameError: name 'os' is not defined"),
        ("__builtins__", "NameError: name '__builtins__' is not defined"),
        ("1 if True else os", "NameError: name 'os' is not defined"),  # untaken branches too
        ("lambda: 1", "not allowed: lambda"),
        ("(lambda: 1)()", "not allowed: lambda"),
        ("(1)(2)", "not allowed: calling anything but a function by its name"),
        ("[x for x in [1]]", "not allowed: comprehensions"),
        ("sum(x for x in [1])", "not allowed: comprehensions"),
        ("(y := 3)", "not allowed: assignment (:=)"),
        ("f'{1}'", "not allowed: f-strings"),
        ("[1, 2][0]", "not allowed: subscripts"),
        ("max([1], key=len)", "not allowed: keyword arguments"),
        ("max(*[1, 2])", "not allowed: * unpacking"),
        ("{**{}}", "not allowed: ** unpacking"),
        ("1 << 3", "not allowed: the << operator"),
        ("1 is 1", "not allowed: the is operator"),
        ("sqrt", "not allowed: sqrt is a function"),
        ("b'x'", "not allowed: bytes literals"),
        ("'%s' % 1", "not allowed: % string formatting"),
        ("-" * 200 + "1", "not allowed: expressions nested more than"),
        ("1+" * 300 + "1", f"not allowed: expressions longer than {MAX_EXPRESSION_CHARS}"),
    ],
)
def test_forbidden_constructs_are_refused(expression: str, error: str) -> None:
    result = run_expression(expression)
    assert not result.ok
    assert result.error is not None and result.error.startswith(error)


def test_hostile_text_never_raises() -> None:
    for expression in ["'\ud800'", "\x00", "1 +\n\n+", "'''", "\\", "\u0661 + 1"]:
        result = run_expression(expression)
        # Whatever the answer, the caller can encode it (a tokenizer, a log).
        (result.output + (result.error or "")).encode("utf-8")
    not_a_string = run_expression(42)  # type: ignore[arg-type]
    assert not not_a_string.ok and not_a_string.error is not None
    assert not_a_string.error.startswith("TypeError: the expression must be a string")


# --- runaway code ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expression",
    [
        "9**9**9",
        "pow(10, 10**8)",
        "2 ** 10001",
        "factorial(10**6)",
        "comb(10**9, 5 * 10**8)",
        "'x' * 10**10",
        "[0] * 10**10",
        "10**10 * (1, 2)",
        "round(5, -10**6)",
        "int('f' * 4000, 16)",
    ],
)
def test_astronomical_results_are_refused(expression: str) -> None:
    # The child's own answer, under a watchdog that never fires: a size guard refused the result
    # before computing it (a result computed anyway would end in a timeout or the memory limit).
    result = run_expression(expression, clock=ScriptedClock(0.0))
    assert not result.ok and result.error is not None
    assert result.error.startswith("too large:")


def test_the_childs_timer_stops_work_past_the_timeout(
        children: list[subprocess.Popen[bytes]]) -> None:
    # The watchdog never fires here: the child stopped itself and answered.
    result = run_expression(MANY_SHORT_STEPS, timeout_s=0.1, clock=ScriptedClock(0.0))
    assert result == ToolResult(ok=False, output="", error="timeout: took longer than 0.1 s")
    assert [child.returncode for child in children] == [0]


def test_the_cpu_timer_kills_a_child_stuck_in_one_operation(
        children: list[subprocess.Popen[bytes]]) -> None:
    # The watchdog never fires here: the kernel stopped the child by SIGPROF once it had used
    # timeout_s (plus a margin) of CPU time, before RLIMIT_CPU's whole second.
    result = run_expression(ONE_ENDLESS_STEP, timeout_s=0.2, clock=ScriptedClock(0.0))
    assert result == ToolResult(ok=False, output="", error="timeout: took longer than 0.2 s")
    assert [child.returncode for child in children] == [-signal.SIGPROF]
    assert result.cpu_s < 1.0


def test_a_call_reports_the_cpu_time_its_child_used() -> None:
    quick = run_expression("1 + 1")
    # Starting the interpreter alone costs some; the call stopped at its limit used at least that.
    assert quick.ok and not quick.timed_out and quick.cpu_s > 0.0
    stuck = run_expression(ONE_ENDLESS_STEP, timeout_s=0.2, clock=ScriptedClock(0.0))
    assert stuck.timed_out and stuck.cpu_s >= 0.2


def test_the_watchdog_kills_the_child_at_its_deadline_and_not_before(
        children: list[subprocess.Popen[bytes]]) -> None:
    # Started at 10.0, the deadline is 10.0 + timeout_s + the startup allowance. The watchdog
    # reads its clock once to set the deadline, keeps waiting at a hair before it, and stops at
    # it, long before the child could reach its CPU limit.
    deadline = 10.0 + 0.5 + STARTUP_ALLOWANCE_S
    clock = ScriptedClock(10.0, deadline - 0.001, deadline)
    result = run_expression(ONE_ENDLESS_STEP, timeout_s=0.5, clock=clock)
    assert result == ToolResult(ok=False, output="", error="timeout: took longer than 0.5 s")
    assert clock.reads == 3
    assert [child.returncode for child in children] == [-signal.SIGKILL]


def test_memory_limit_is_reported() -> None:
    # Forty separate 8 MB lists: every step is legal, the total is past 256 MB. The time limit
    # is generous: on a loaded machine the allocations alone can take over a second.
    forty_lists = "[" + "[0]*10**6," * 40 + "]"
    result = run_expression(forty_lists, timeout_s=30.0, memory_mb=256, clock=ScriptedClock(0.0))
    assert result == ToolResult(ok=False, output="", error=MEMORY_LIMIT_ERROR)
    # The same with room to spare.
    assert run_expression("len([" + "[0]*10**6," * 4 + "])").output == "4"


def test_child_limits_hold_even_if_the_interpreter_were_escaped() -> None:
    # The whitelist gives no way to open a file or a socket; if an escape found one, the child's
    # resource limits would still refuse. Apply them in a throwaway interpreter and try.
    probe = f"""
import json, runpy, socket
child = runpy.run_path({sandbox_child.__file__!r}, run_name="sandbox_probe")
child["_limit_resources"](timeout_s=1.0, memory_mb=64)
refused = []
for attempt in (
    lambda: open("/etc/hostname"),
    lambda: socket.socket(),
    lambda: bytearray(100 * 2**20),
):
    try:
        attempt()
    except (OSError, MemoryError) as error:
        refused.append(type(error).__name__)
print(json.dumps(refused))
"""
    completed = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=30, check=True
    )
    assert json.loads(completed.stdout) == ["OSError", "OSError", "MemoryError"]


# --- output ---------------------------------------------------------------------------------------


def test_output_is_truncated() -> None:
    result = run_expression("'x' * 1000", max_output_chars=50)
    assert result.ok and len(result.output) == 50
    assert result.output == "'" + "x" * (49 - len(TRUNCATION_MARKER)) + TRUNCATION_MARKER
    long_number = run_expression("10 ** 300")
    assert len(long_number.output) == 200 and long_number.output.startswith("1000")
    long_error = run_expression("int('" + "z" * 400 + "')", max_output_chars=40)
    assert long_error.error is not None and len(long_error.error) == 40


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({"timeout_s": 0}, "timeout_s must be a positive number of seconds, got 0"),
        ({"timeout_s": -1.0}, "timeout_s must be a positive number of seconds, got -1.0"),
        ({"timeout_s": math.nan}, "timeout_s must be a positive number of seconds, got nan"),
        ({"memory_mb": 1}, "memory_mb must be an integer >= 64, got 1"),
        ({"max_output_chars": 0}, "max_output_chars must be an integer >= 10, got 0"),
    ],
)
def test_bad_limits_are_programming_errors(limits: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        run_expression("1", **limits)  # type: ignore[arg-type]


# --- processes ------------------------------------------------------------------------------------


def test_no_child_process_is_left_behind(children: list[subprocess.Popen[bytes]]) -> None:
    expressions = ["1 + 1", "().__class__", "1 / 0", "9**9**9", "(2"] * 8
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(run_expression, expressions))
    assert [result.ok for result in results] == [True, False, False, False, False] * 8
    timed_out = run_expression(MANY_SHORT_STEPS, timeout_s=0.1)
    assert timed_out.error == "timeout: took longer than 0.1 s"
    killed = run_expression(ONE_ENDLESS_STEP, timeout_s=0.5, clock=ScriptedClock(0.0, 100.0))
    assert killed.error == "timeout: took longer than 0.5 s"
    assert len(children) == len(expressions) + 2
    for child in children:
        # Reaped: no zombie, not running.
        with pytest.raises(ChildProcessError, match="No child processes"):
            os.waitpid(child.pid, os.WNOHANG)
        assert not os.path.exists(f"/proc/{child.pid}")

"""The child side of tasks/checker_process.py: checks answers in a process of its own.

Run as a script (`python -I -B checker_child.py`), it imports nothing of decentrl. Its first line
on stdin is the set-up, a JSON object: "sys_path" (the parent's import path, so that a user's
module resolves as it does in the parent), "checker" ("math" or "module:function") and
"memory_mb" (an address-space limit, or null). It answers that line with {"ready": true} or
{"error": "..."}; then each request line {"completion": ..., "answer": ...} with
{"score": <float>} or {"error": "..."}, until stdin closes.

This is the main thread of its own interpreter, so math-verify's timeouts (SIGALRM) work here,
which they do not in the coordinator's scoring threads; the parent's watchdog still kills this
process when one C-level operation (a huge integer power in sympy) outlasts them.
"""

from __future__ import annotations

import importlib
import json
import resource
import sys
from collections.abc import Callable
from functools import lru_cache
from typing import Any

MATH_CHECKER = "math"
# math-verify's own limits per parse and per comparison, in whole seconds (it uses signal.alarm).
MATH_STEP_TIMEOUT_S = 2


def math_scorer() -> Callable[[str, str], float]:
    from math_verify import parse, verify

    @lru_cache(maxsize=4096)
    def parsed_reference(answer: str) -> Any:
        # A bare reference ("1/2", "x+1") parses reliably only as LaTeX between dollars.
        text = answer if "$" in answer or "\\boxed" in answer else f"${answer}$"
        return parse(text, parsing_timeout=MATH_STEP_TIMEOUT_S)

    def score(completion: str, answer: str) -> float:
        extracted = parse(completion, parsing_timeout=MATH_STEP_TIMEOUT_S)
        if not extracted:
            return 0.0
        return 1.0 if verify(parsed_reference(answer), extracted,
                             timeout_seconds=MATH_STEP_TIMEOUT_S) else 0.0

    return score


def user_scorer(spec: str) -> Callable[[str, str], float]:
    module_name, _, function_name = spec.partition(":")
    function = getattr(importlib.import_module(module_name), function_name)

    def score(completion: str, answer: str) -> float:
        value = function(completion, answer)
        if isinstance(value, bool):
            return float(value)
        if not isinstance(value, (int, float)) or not (0.0 <= value <= 1.0):  # NaN fails too
            raise ValueError(f"{spec} returned {value!r}; a verifier returns a bool or a number "
                             "in [0, 1]")
        return float(value)

    return score


def reply(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> None:
    setup = json.loads(sys.stdin.readline())
    sys.path[:] = setup["sys_path"]
    if setup["memory_mb"] is not None:
        limit = setup["memory_mb"] * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        checker = setup["checker"]
        score = math_scorer() if checker == MATH_CHECKER else user_scorer(checker)
    except Exception as error:  # reported to the parent, which names the checker
        reply({"error": f"{type(error).__name__}: {error}"})
        return
    reply({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        try:
            value = score(request["completion"], request["answer"])
        except MemoryError:
            reply({"error": "memory limit exceeded"})
            continue
        except Exception as error:  # a verifier's failure is a reward of 0, not the child's end
            reply({"error": f"{type(error).__name__}: {error}"})
            continue
        reply({"score": value})


if __name__ == "__main__":
    main()

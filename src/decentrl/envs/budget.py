"""The CPU budget of an episode's tool calls: what all its calls may use together.

Each call runs with the limit min(CALL_TIMEOUT_S, budget left) and is charged the CPU time its
sandbox child actually used (`ToolResult.cpu_s`, from the child's resource usage: user + system,
its interpreter's startup included). Once the charges reach the budget, no further call of the
episode runs: each answers the error `refusal` ("tool budget of X s for this episode is spent"),
which the environment treats like any failed call. A call stopped at a limit the budget lowered
answers that error as well, not a timeout that would name the lowered limit. The sandbox's CPU
timer stops a call within CPU_TIMER_MARGIN_S of its limit even inside one C operation, so an
episode's calls use at most the budget plus the last call's margin and interpreter startup.
Without a budget a last-stage peer, which samples the tokens, could make every turn a call that
burns the per-call limit, at generation and again at the coordinator's replay.

Why the replay still matches the rollout, although CPU time differs between machines and between
two runs on one machine. The replay cannot recompute the generator's verdicts from its own
measurements, so it takes them from the record, in the one direction that is always safe:
- a call the rollout answered with the budget error is not run at replay either, once the
  episode checks that this answer is exactly what the rollout recorded (`adopt_exhaustion`).
  Running fewer calls never costs the coordinator anything, and a refused call is a failed call,
  which earns no environment here more, so a peer that claims a refusal it did not have loses;
- a call the rollout ran is run at replay, whose own limit is REPLAY_ALLOWANCE times the budget:
  an honest rollout spent at most the budget on its machine, so a coordinator up to that many
  times slower replays every call the rollout ran. A rollout that claims more runs than that
  meets the replay's own refusal, no longer matches, and its group is refused; that replay cost
  at most the allowance times the budget.
A call cut by its own per-call limit (not the budget's) answers the usual timeout at replay too.
What can still differ is a call that ends within a hair of its limit on one machine and past it on
the other; that was true of the per-call timeout before any budget.
"""

from __future__ import annotations

from collections.abc import Callable

from decentrl.envs.sandbox import ToolResult
from decentrl.tasks.base import is_real

CALL_TIMEOUT_S = 1.0  # one call's limit while the budget has at least this much left
DEFAULT_TOOL_BUDGET_S = 1.0  # an honest call costs about 0.05 s, most of it starting the sandbox
MAX_TOOL_BUDGET_S = 3600.0
# The replay's limit, in budgets: how many times slower than the generating machine the
# coordinator may be and still replay every honest rollout.
REPLAY_ALLOWANCE = 2.0


def check_tool_budget(tool_budget_s: float) -> None:
    if not (is_real(tool_budget_s) and 0.0 < tool_budget_s <= MAX_TOOL_BUDGET_S):
        raise ValueError(f"tool_budget_s must be a number of CPU seconds in (0, "
                         f"{MAX_TOOL_BUDGET_S:g}], got {tool_budget_s!r}")


class ToolBudget:
    """One episode's CPU budget for tool calls (see the module docstring)."""

    def __init__(self, seconds: float) -> None:
        check_tool_budget(seconds)
        self.seconds = float(seconds)
        self.call_timeout_s = CALL_TIMEOUT_S
        self.spent_s = 0.0  # CPU seconds the calls run here used, as measured here
        self.calls_run = 0
        self.exhausted = False

    @property
    def refusal(self) -> str:
        """The error of a call the budget stops; the same text at generation and at replay."""
        return f"tool budget of {self.seconds:g} s for this episode is spent"

    def run(self, call: Callable[[float], ToolResult], replaying: bool) -> ToolResult:
        """`call(limit_s)` within the budget, or the refusal without running it. `replaying`:
        this is the coordinator's replay, whose limit is REPLAY_ALLOWANCE budgets."""
        if self.exhausted:
            return ToolResult(ok=False, output="", error=self.refusal)
        limit_s = self.seconds * (REPLAY_ALLOWANCE if replaying else 1.0)
        granted_s = min(self.call_timeout_s, limit_s - self.spent_s)
        result = call(granted_s)
        self.calls_run += 1
        self.spent_s += result.cpu_s
        cut_by_budget = result.timed_out and granted_s < self.call_timeout_s
        if cut_by_budget or self.spent_s >= limit_s:
            self.exhausted = True
        if cut_by_budget:
            return ToolResult(ok=False, output="", error=self.refusal, cpu_s=result.cpu_s)
        return result

    def adopt_exhaustion(self) -> None:
        """At replay: the rollout recorded the budget as spent here; no further call runs."""
        self.exhausted = True

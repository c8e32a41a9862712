"""Branch counts of the fuzz tests (tests/test_fuzz.py).

A fuzz test's example either decodes (and then the test checks what came out) or is refused. If
every example took the same branch, the other branch's checks never ran and the test proved less
than it reads: each test counts both and asserts that both happened. The counts of a whole session
are also the number of examples it ran, which `make fuzz` prints (tests/conftest.py)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Outcomes:
    """How the examples of one fuzz test ended."""

    test: str
    accepted: int = 0
    refused: int = 0

    @property
    def examples(self) -> int:
        return self.accepted + self.refused

    def accept(self) -> None:
        self.accepted += 1

    def refuse(self) -> None:
        self.refused += 1

    def assert_both_branches_ran(self) -> None:
        assert self.accepted > 0 and self.refused > 0, (
            f"{self.test}: {self.accepted} examples accepted and {self.refused} refused; the "
            f"checks of a branch that never runs prove nothing")


@dataclass
class FuzzTally:
    """Every fuzz test's outcomes in one test session."""

    tests: list[Outcomes] = field(default_factory=list)

    def start(self, test: str) -> Outcomes:
        outcomes = Outcomes(test)
        self.tests.append(outcomes)
        return outcomes

    @property
    def examples(self) -> int:
        return sum(outcomes.examples for outcomes in self.tests)

    def summary(self, profile: str) -> str:
        accepted = sum(outcomes.accepted for outcomes in self.tests)
        refused = sum(outcomes.refused for outcomes in self.tests)
        tests = f"{len(self.tests)} test" + ("" if len(self.tests) == 1 else "s")
        return (f"fuzz: {self.examples:,} examples run in {tests} "
                f"({accepted:,} accepted, {refused:,} refused; hypothesis profile {profile!r})")

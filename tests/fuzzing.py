"""What the fuzz tests (test_fuzz*.py, in tests/unit/net and tests/swarm) share: hypothesis's
settings for them, strategies for the bytes a peer can send, and the count of each test's examples
by branch.

A fuzz test's example either decodes (and then the test checks what came out) or is refused. If
every example took the same branch, the other branch's checks never ran and the test proved less
than it reads: each test counts both and asserts that both happened. The counts of a whole session
are also the number of examples it ran, which `make fuzz` prints (tests/conftest.py)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any

import msgspec
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# `make test` runs each fuzz test (test_fuzz*.py) on 150 examples (seconds in all).
# `make fuzz` (DECENTRL_FUZZ=1) runs FUZZ_EXAMPLES_PER_TEST each (the network ones an eighth of
# it): with the tests' ~35 message types, records, streams and payloads, about 145,000 in all
# (about three minutes on two cores).
REGULAR_EXAMPLES_PER_TEST = 150
FUZZ_EXAMPLES_PER_TEST = 3_000
# What `make fuzz` promises: a session under DECENTRL_FUZZ that ran fewer examples fails
# (tests/conftest.py). hypothesis stops a test early when it runs out of distinct inputs, and a
# settings object made before its profile was loaded keeps the default of 100: either would
# shrink the run silently otherwise.
FUZZ_FLOOR = 100_000
FUZZING = os.environ.get("DECENTRL_FUZZ") == "1"
settings.register_profile("decentrl", max_examples=REGULAR_EXAMPLES_PER_TEST)
settings.register_profile("fuzz", max_examples=FUZZ_EXAMPLES_PER_TEST)
settings.load_profile("fuzz" if FUZZING else "decentrl")
# Tests whose every example is a round trip to a live node (tests/swarm/test_fuzz_node.py).
NETWORK_EXAMPLES_PER_TEST = max(40, settings.default.max_examples // 8)

# Every fuzz test's settings; the number of examples is the profile's, loaded above first.
FUZZ = settings(deadline=2000,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    """Apply (kind, position, value) edits: 0 flips a byte, 1 inserts one, 2 deletes one."""
    out = bytearray(data)
    for kind, position, value in edits:
        if kind == 1 or not out:
            out.insert(position % (len(out) + 1), value)
        elif kind == 0:
            out[position % len(out)] ^= value or 1
        else:
            del out[position % len(out)]
    return bytes(out)


EDITS = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2**16), st.integers(0, 255)),
                 min_size=1, max_size=8)
Edits = list[tuple[int, int, int]]


def flip(position: int, value: int) -> Edits:
    """One byte flipped: an edit that leaves what a byte-level decoder accepts when `position`
    holds data (a string's letters, a tensor's values) rather than structure."""
    return [(0, position, value)]


# ---- any bytes as a message type ---------------------------------------------------------------

# Any int msgpack carries.
ANY_INT = st.integers(-2**63, 2**64 - 1)


def wire_values(info: msgspec.inspect.Type, ints: st.SearchStrategy[int] = ANY_INT
                ) -> st.SearchStrategy[Any]:
    """What msgpack carries for a message field's type: structs as maps of their fields (the
    optional ones present or not), ints drawn from `ints` (any a msgpack int can hold, or small
    ones, which reach the checks after decoding more often). Values are drawn as a peer could
    send them, so the receiver's validation (a struct's __post_init__) refuses some."""
    match info:
        case (msgspec.inspect.StructType(fields=fields)
              | msgspec.inspect.DataclassType(fields=fields)):
            return st.fixed_dictionaries(
                {field.encode_name: wire_values(field.type, ints)
                 for field in fields if field.required},
                optional={field.encode_name: wire_values(field.type, ints)
                          for field in fields if not field.required})
        case msgspec.inspect.NamedTupleType(fields=fields):
            return st.tuples(*(wire_values(field.type, ints) for field in fields))
        case msgspec.inspect.IntType():
            return ints
        case msgspec.inspect.FloatType():
            return st.floats()
        case msgspec.inspect.StrType():
            return st.text(max_size=20)
        case msgspec.inspect.BytesType():
            return st.binary(max_size=20)
        case msgspec.inspect.BoolType():
            return st.booleans()
        case msgspec.inspect.NoneType():
            return st.none()
        case msgspec.inspect.LiteralType(values=values):
            return st.sampled_from(values)
        case msgspec.inspect.UnionType(types=types):
            return st.one_of(*(wire_values(member, ints) for member in types))
        case msgspec.inspect.ListType(item_type=item) | msgspec.inspect.VarTupleType(
                item_type=item):
            return st.lists(wire_values(item, ints), max_size=3)
        case msgspec.inspect.TupleType(item_types=items):
            return st.tuples(*(wire_values(item, ints) for item in items))
        case msgspec.inspect.DictType(key_type=key, value_type=value):
            return st.dictionaries(wire_values(key, ints), wire_values(value, ints), max_size=3)
    raise TypeError(f"no strategy for a message field of type {info}")


@functools.cache  # built once per type, not once per example
def message_bytes(message_type: type) -> st.SearchStrategy[bytes]:
    """Random bytes (nearly always refused), a well-formed message of the type (accepted unless
    its values are out of range, so the checks on a decoded message run for every type), or a
    well-formed one mutated (either)."""
    well_formed = wire_values(msgspec.inspect.type_info(message_type)).map(msgspec.msgpack.encode)
    mutated = st.tuples(well_formed, EDITS).map(lambda pair: mutate(*pair))
    return st.one_of(st.binary(max_size=256), well_formed, mutated)



# ---- counting examples by branch --------------------------------------------------------------



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

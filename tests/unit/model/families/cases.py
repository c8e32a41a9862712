"""Every registered family's tiny conformance models, gathered from the family test modules (each
test_<family>.py lists its FamilyCase objects as CASES), for the tests and the bench that run
every family: two training steps (tests/unit/model/test_families_train.py, tests/swarm) and the
conformance table (bench/family_conformance.py). A family that joins the registry joins them
through its test module's CASES."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from decentrl.model.families import FAMILIES
from tests.unit.model.families.conformance import FamilyCase

PACKAGE = "tests.unit.model.families"


def all_cases() -> dict[str, list[FamilyCase]]:
    """model_type -> the cases the family test modules list for it."""
    found: dict[str, list[FamilyCase]] = {}
    for module_info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if not module_info.name.startswith("test_"):
            continue
        module = importlib.import_module(f"{PACKAGE}.{module_info.name}")
        for case in getattr(module, "CASES", ()):
            found.setdefault(case.model_type, []).append(case)
    return found


def family_cases() -> list[FamilyCase]:
    """One case per registered family (its test module's first), in the registry's order."""
    cases = all_cases()
    missing = [model_type for model_type in FAMILIES if model_type not in cases]
    if missing:
        raise LookupError(f"registered families without a conformance case (CASES in "
                          f"{PACKAGE}.test_<family>): {missing}")
    return [cases[model_type][0] for model_type in FAMILIES]

"""The `family` fixture of the conformance tests (conformance.py): the tiny model of the test
module's `case`."""

from __future__ import annotations

import pytest

from tests.unit.model.families.conformance import Family, FamilyCase, build_family


@pytest.fixture(scope="module")
def family(case: FamilyCase, tmp_path_factory: pytest.TempPathFactory) -> Family:
    return build_family(case, tmp_path_factory.mktemp("family") / str(case))

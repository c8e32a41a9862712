"""Shared fixtures: tiny random models written once per test session (a few milliseconds each).
Also the count of the examples the fuzz tests ran (their floor under `make fuzz`), and a guard
that fails a test which starts a p2p daemon without the network marker."""

from __future__ import annotations

import logging
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fuzzing import FUZZ_FLOOR, FUZZING, FuzzTally, Outcomes
from helpers import sampled_rollouts
from hivemind.p2p import P2P
from hypothesis import settings
from safetensors.torch import load_file, save_file

from decentrl.model.loading import LoadedModel, load_model
from decentrl.model.tiny import make_tiny_model
from decentrl.rollout.types import Rollout

# ---- fuzzing ------------------------------------------------------------------------------------
# hypothesis's profiles are tests/fuzzing.py's (loaded as it is imported, above).
_FUZZ_TALLY = FuzzTally()


@pytest.fixture
def restored_logging() -> Iterator[None]:
    """The logging setup as it was before the test (tests of configure_logging change it)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    ours = logging.getLogger("decentrl").level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    logging.getLogger("decentrl").setLevel(ours)


@pytest.fixture
def fuzz_outcomes(request: pytest.FixtureRequest) -> Outcomes:
    """Counts of this fuzz test's accepted and refused examples (tests/fuzzing.py)."""
    return _FUZZ_TALLY.start(request.node.nodeid)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Under DECENTRL_FUZZ, a session whose fuzz tests all passed but ran fewer than FUZZ_FLOOR
    examples in all fails (`make fuzz` runs every fuzz test; a selection of them falls short)."""
    if FUZZING and _FUZZ_TALLY.tests and session.exitstatus == pytest.ExitCode.OK \
            and _FUZZ_TALLY.examples < FUZZ_FLOOR:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The number of fuzz examples the session ran: the figure `make fuzz` is run for."""
    if _FUZZ_TALLY.tests:
        terminalreporter.write_line(_FUZZ_TALLY.summary(settings.get_current_profile_name()))
    if FUZZING and _FUZZ_TALLY.tests and _FUZZ_TALLY.examples < FUZZ_FLOOR:
        terminalreporter.write_line(
            f"FAILED: the fuzz floor is {FUZZ_FLOOR:,} examples (DECENTRL_FUZZ=1), this session "
            f"ran {_FUZZ_TALLY.examples:,}", red=True, bold=True)

# ---- the network marker --------------------------------------------------------------------------
# `make test-unit` leaves out tests marked network, the ones that start p2p daemons: a test that
# starts one unmarked fails here, when its daemon would start, rather than slowing or breaking a
# run that meant to start none. (Fixtures run within the first test that uses them.)
_network_test = False
_create_p2p = P2P.create.__func__  # type: ignore[attr-defined]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    global _network_test
    _network_test = item.get_closest_marker("network") is not None


async def _create_p2p_in_network_tests(cls: type[P2P], *args: Any, **kwargs: Any) -> P2P:
    if not _network_test:
        raise RuntimeError("this test starts a p2p daemon: mark it @pytest.mark.network")
    return await _create_p2p(cls, *args, **kwargs)


P2P.create = classmethod(_create_p2p_in_network_tests)  # type: ignore[method-assign,assignment]

# The tiny models' matmuls are microseconds long: a second intra-op thread buys nothing, and on a
# busy machine its spin-waits make a forward pass 100x slower (0.7 s instead of 4 ms).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer, hidden-32 Llama with tied embeddings and the character-level tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="session")
def tiny_printable_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`make_tiny_model` whose tokenizer has every printable ASCII character: tool calls' JSON
    (braces, quotes, underscores) survives it, so demonstrations can be written in it."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "printable", seed=3,
                           characters=string.printable.replace("\r", "").replace("\x0b", "")
                           .replace("\x0c", ""))


@pytest.fixture(scope="session")
def tiny_sharp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`make_tiny_model` with every weight but the norms scaled by 10. At the default init (std
    0.02) the tiny model is nearly uniform and greedy decoding repeats one token forever, which
    would let a wrong generation loop pass a token-for-token comparison."""
    folder = make_tiny_model(tmp_path_factory.mktemp("tiny") / "sharp", seed=2)
    path = folder / "model.safetensors"
    tensors = {name: tensor if "norm" in name else 10 * tensor
               for name, tensor in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path) -> LoadedModel:
    """`tiny_model_dir` loaded once. Tests must not modify its tensors; build_stages copies."""
    return load_model(str(tiny_model_dir))


@pytest.fixture(scope="module")
def rollouts(tiny_model: LoadedModel) -> list[Rollout]:
    """`helpers.sampled_rollouts` of the tiny model, once per test module."""
    return sampled_rollouts(tiny_model)

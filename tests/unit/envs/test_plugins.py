"""Plug-ins (decentrl/plugins.py): a task or environment of another installed package, found
through its entry point and named in a config like a built-in; and the refusals: a name taken by
a built-in or another plug-in, a plug-in that fails to import, one that builds no task, unknown
options.

Nothing is installed: a test writes a distribution's `*.dist-info` (METADATA, entry_points.txt)
into a folder it puts on sys.path, which is all importlib.metadata reads."""

from __future__ import annotations

import logging
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from decentrl.config import load_config
from decentrl.envs import Environment, make_environment, make_task_or_environment
from decentrl.plugins import ENVIRONMENT_GROUP, TASK_GROUP, PluginError
from decentrl.tasks import is_task_name, make_task

TEMPLATE = Path(__file__).resolve().parents[3] / "examples" / "plugin-template"
# The plug-in modules of the refusal tests, written into the test's folder on sys.path.
FAKE_MODULE = "decentrl_test_plugins"
FAKE_SOURCE = '''
from decentrl.envs.single_turn import TaskEnvironment
from decentrl.tasks import SumsTask


class HalfATask:
    name = "half-a-task"

    def problem(self, split, index):
        raise NotImplementedError


def misnamed_sums():
    return SumsTask()


NOT_A_FACTORY = 3


class SumsEpisodes(TaskEnvironment):
    """An environment plug-in: sums as one-turn episodes, under a name of its own."""

    def __init__(self, max_digits: int = 2) -> None:
        super().__init__(SumsTask(max_digits=max_digits))
        self.name = "sums-episodes"
'''
BROKEN_MODULE = "decentrl_test_broken_plugin"


def install(site: Path, distribution: str, entry_points: dict[str, dict[str, str]],
            version: str = "0.1.0") -> None:
    """Make `distribution` look installed in `site`, as pip leaves it: its dist-info folder."""
    info = site / f"{distribution.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in entries.items())
        for group, entries in entry_points.items()))


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder on sys.path for this test's distributions and plug-in modules."""
    (tmp_path / f"{FAKE_MODULE}.py").write_text(FAKE_SOURCE)
    (tmp_path / f"{BROKEN_MODULE}.py").write_text(
        'raise ImportError("this plug-in needs libfoo 2")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop(FAKE_MODULE, None)


@pytest.fixture
def template_plugin(site: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The template package as if installed: its entry points, read from its pyproject.toml, and
    its package on sys.path. Gives the distribution's "name version"."""
    project = tomllib.loads((TEMPLATE / "pyproject.toml").read_text())["project"]
    install(site, project["name"], project["entry-points"], project["version"])
    monkeypatch.syspath_prepend(str(TEMPLATE))
    return f"{project['name']} {project['version']}"


def test_a_config_names_the_template_plugin_like_a_builtin(
        template_plugin: str, caplog: pytest.LogCaptureFixture) -> None:
    config = load_config(TEMPLATE / "count-letters.toml")
    assert config.task.name == config.eval.task.name == "count-letters"
    with caplog.at_level(logging.INFO, logger="decentrl.plugins"):
        task = make_task_or_environment(config.task.name, dict(config.task.options))
    # Which version built the task: the config names the plug-in only.
    assert "'count-letters' comes from the plug-in" in caplog.text
    assert template_plugin in caplog.text
    assert not isinstance(task, Environment) and is_task_name("count-letters")
    train = [task.problem("train", index) for index in range(20)]
    heldout = [task.problem("heldout", index) for index in range(20)]
    assert not {p.key for p in train} & {p.key for p in heldout}
    for problem in train:
        assert problem.task == "count-letters"
        assert task.reward(problem, f"It appears {problem.answer} times.").solved
        assert not task.reward(problem, "It appears 17 times.").solved
    # As every task, it is a one-turn environment too.
    episode = make_environment("task:count-letters").episode("train", 0)
    assert episode.respond(train[0].answer).reward.solved  # type: ignore[union-attr]


def test_unknown_names_and_options_list_the_plugins(template_plugin: str) -> None:
    with pytest.raises(ValueError, match=f"count-letters \\({template_plugin}\\)"):
        make_task("count-leters")
    with pytest.raises(ValueError, match="unknown task 'count-leters'.*count-letters"):
        make_task_or_environment("count-leters", {})
    with pytest.raises(ValueError, match="task 'count-letters' has no option 'digits'; its "
                                         "options: absent_letters, heldout_fraction"):
        make_task_or_environment("count-letters", {"digits": 3})


def test_an_environment_plugin_trains_as_episodes(site: Path) -> None:
    install(site, "sums-episodes", {ENVIRONMENT_GROUP: {
        "sums-episodes": f"{FAKE_MODULE}:SumsEpisodes"}})
    environment = make_task_or_environment("sums-episodes", {"max_digits": 1})
    assert isinstance(environment, Environment) and environment.name == "sums-episodes"
    episode = environment.episode("train", 3)
    assert episode.respond(episode.problem.answer).reward.solved  # type: ignore[union-attr]


@pytest.mark.parametrize("group,name", [(TASK_GROUP, "sums"), (TASK_GROUP, "rg:chain_sum"),
                                        (ENVIRONMENT_GROUP, "agentic-calculator"),
                                        (TASK_GROUP, "task:sums")])
def test_a_plugin_with_a_builtins_name_is_refused(site: Path, group: str, name: str) -> None:
    install(site, "shadow", {group: {name: f"{FAKE_MODULE}:HalfATask"}})
    # Refused whatever the run names, so that an installed set never means two things.
    with pytest.raises(PluginError, match=f"entry point {name} = .*shadow 0.1.0.*built-in"):
        make_task_or_environment("sums", {})


def test_two_plugins_of_one_name_are_refused_naming_both(site: Path) -> None:
    install(site, "first-letters", {TASK_GROUP: {"letters": f"{FAKE_MODULE}:HalfATask"}})
    install(site, "second-letters", {ENVIRONMENT_GROUP: {"letters": f"{FAKE_MODULE}:HalfATask"}},
            version="2.0")
    with pytest.raises(PluginError, match="two installed plug-ins are named 'letters'") as refusal:
        make_task("letters")
    assert "first-letters 0.1.0" in str(refusal.value)
    assert "second-letters 2.0" in str(refusal.value)


def test_a_plugin_that_fails_to_import_names_itself_and_the_cause(site: Path) -> None:
    install(site, "broken", {TASK_GROUP: {"broken-task": f"{BROKEN_MODULE}:Task"}})
    with pytest.raises(PluginError, match=f"decentrl.tasks entry point broken-task = "
                                          f"{BROKEN_MODULE}:Task \\(broken 0.1.0\\) failed to "
                                          "load: ImportError: this plug-in needs libfoo 2") as error:
        make_task_or_environment("broken-task", {})
    assert isinstance(error.value.__cause__, ImportError)


@pytest.mark.parametrize("target,refusal", [
    ("HalfATask", ("built a HalfATask, which is not a task: it has no extract_answer, messages, "
                   "reward")),
    ("NOT_A_FACTORY", "is not a class or factory: it names a value of type int"),
    ("misnamed_sums", "built a task named 'sums'; it must carry its entry point's name"),
])
def test_a_plugin_that_builds_no_task_is_refused(site: Path, target: str, refusal: str) -> None:
    install(site, "odd", {TASK_GROUP: {"half-a-task": f"{FAKE_MODULE}:{target}"}})
    with pytest.raises(PluginError, match=refusal):
        make_task("half-a-task")

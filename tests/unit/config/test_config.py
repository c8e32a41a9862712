"""The config a user finds and changes: every field described in docs/config.md, generated from
the config itself; `--set SECTION.FIELD=VALUE` checked like the file; a file that extends
another; former names refused with the new one; the host section outside the run's identity
(its hash, its manifest, a resumed run's check); the package importable without torch."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from decentrl.cli import app
from decentrl.config import ConfigError, HostConfig, load_config, parse_config, parse_host
from decentrl.config.docs import REGENERATE, config_markdown, undescribed_fields
from decentrl.config.renames import RENAMED
from decentrl.coordinator.loop import RESUMABLE_CHANGES
from decentrl.coordinator.store import RunStore

ROOT = Path(__file__).resolve().parents[3]


def test_every_field_and_section_has_a_description() -> None:
    assert undescribed_fields() == []


def test_docs_config_md_is_generated_from_the_config() -> None:
    page = ROOT / "docs" / "config.md"
    assert page.is_file() and page.read_text() == config_markdown(), (
        f"docs/config.md is stale: regenerate it with `{REGENERATE}`")


def test_the_docs_give_each_field_its_type_default_and_range() -> None:
    page = config_markdown()
    assert "| `lr` | float | `1e-05` | > 0, < 1 | AdamW's learning rate" in page
    assert "## [host.link]" in page and "## [eval.task]" in page
    assert '| `device` | "auto" \\| "cpu" \\| "cuda" \\| "mps" | `"auto"` |' in page


def test_set_changes_one_field_read_as_a_toml_value() -> None:
    config = parse_config({}, ["train.lr=3e-5", "host.device=cpu", "task.options={min_digits=3}",
                               "host.link.rtt_ms=[60, 120]", "eval.greedy=false",
                               "train.lr=2e-5"])  # the later wins
    assert config.train.lr == 2e-5 and config.host.device == "cpu"  # a bare word is a string
    assert config.task.options == {"min_digits": 3} and config.host.link.rtt_ms == (60.0, 120.0)
    assert config.eval.greedy is False
    inside = parse_config({"task": {"options": {"max_digits": 2}}}, ["task.options.min_digits=1"])
    assert inside.task.options == {"max_digits": 2, "min_digits": 1}


@pytest.mark.parametrize(("setting", "message"), [
    ("train.lrr=1", "--set train.lrr: unknown field train.lrr; the fields of train are mode"),
    ("trian.lr=1", "--set trian.lr: unknown field trian.lr; the fields of the config are name"),
    ("train.lr.x=1", "unknown field train.lr.x: train.lr is a value, not a section"),
    ("train.lr", "--set 'train.lr' must look like SECTION.FIELD=VALUE"),
    ("train.lr=abc", "train.lr: Input should be a valid number"),
    ("train.lr=2", "train.lr: Input should be less than 1"),
    ("host.device=tpu", "host.device: Input should be 'auto', 'cpu', 'cuda' or 'mps'"),
])
def test_a_bad_set_names_the_field_and_why(setting: str, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config({}, [setting])
    assert message in str(refused.value)


def test_unknown_fields_of_a_file_are_called_so(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[train]\nlrr = 1\n")
    with pytest.raises(ConfigError, match=r"train\.lrr: unknown field"):
        load_config(path)


@pytest.mark.parametrize(("old", "new"), sorted(RENAMED.items()))
def test_a_former_name_is_refused_with_its_new_name(old: str, new: str, tmp_path: Path) -> None:
    """In a TOML file, a run folder's config.json and --set alike."""
    *sections, leaf = old.split(".")
    # A table such as swarm.link, or a field set to 1: refused before its value is looked at.
    table, line = (old, "rtt_ms = [1, 2]") if leaf == "link" else (".".join(sections),
                                                                   f"{leaf} = 1")
    toml = tmp_path / "old.toml"
    toml.write_text((f"[{table}]\n" if table else "") + line + "\n")
    data = tomllib.loads(toml.read_text())
    said = f"{old} is now called {new}"
    run = tmp_path / "config.json"
    run.write_text(json.dumps(data))
    for load in (lambda: load_config(toml), lambda: load_config(run),
                 lambda: parse_config({}, [f"{old}=1"])):
        with pytest.raises(ConfigError) as refused:
            load()
        assert said in str(refused.value)


def test_updates_per_batch_is_now_minibatches_and_epochs() -> None:
    with pytest.raises(ConfigError, match="train.updates_per_batch is now called "
                                          "train.minibatches_per_batch"):
        parse_config({"train": {"updates_per_batch": 2}})
    train = parse_config({"train": {"minibatches_per_batch": 3, "epochs_per_batch": 2}}).train
    assert train.optimizer_steps_per_batch == 6
    assert parse_config({}).train.optimizer_steps_per_batch == 1
    for field in ("minibatches_per_batch", "epochs_per_batch"):
        with pytest.raises(ConfigError, match=f"train.{field}"):
            parse_config({"train": {field: 0}})


def test_entropy_control_settings_are_checked() -> None:
    entropy = parse_config({"train": {"entropy": {"method": "clip_cov", "fraction": 0.01,
                                                  "target": 0.6}}}).train.entropy
    assert (entropy.method, entropy.fraction, entropy.target) == ("clip_cov", 0.01, 0.6)
    # --set reaches the nested section too.
    assert parse_config({}, ["train.entropy.method=clip_cov"]).train.entropy.method == "clip_cov"
    assert parse_config({}).train.clip_high is None  # the loss's own upper clip
    with pytest.raises(ConfigError, match="acts from a batch's second optimizer step on"):
        parse_config({"train": {"entropy": {"method": "kl_cov"}}})
    assert parse_config({"train": {"entropy": {"method": "kl_cov"},
                                   "epochs_per_batch": 2}}).train.entropy.method == "kl_cov"
    for section, message in (({"method": "top_cov"}, "train.entropy.method"),
                             ({"fraction": 0}, "train.entropy.fraction"),
                             ({"clip_cov_bounds": [5, 1]}, "low < high"),
                             ({"target": -1}, "train.entropy.target"),
                             ({"max_coef": float("nan")}, "train.entropy.max_coef")):
        with pytest.raises(ConfigError, match=message):
            parse_config({"train": {"entropy": section}})


def test_a_file_extends_another_section_by_section(tmp_path: Path) -> None:
    (tmp_path / "base.toml").write_text(
        'name = "base"\n[train]\nlr = 1e-4\nsteps = 50\n'
        '[task]\nname = "sums"\noptions = { min_digits = 1, max_digits = 2 }\n')
    (tmp_path / "child.toml").write_text(
        'extends = "base.toml"\nname = "child"\n[train]\nsteps = 10\n'
        '[task]\noptions = { max_digits = 3 }\n')
    config = load_config(tmp_path / "child.toml")
    assert (config.name, config.train.lr, config.train.steps) == ("child", 1e-4, 10)
    assert config.task.options == {"max_digits": 3}  # a field's value replaces the base's whole
    (tmp_path / "base.toml").write_text('extends = "child.toml"\n')
    with pytest.raises(ConfigError, match="comes back to a file that extends it"):
        load_config(tmp_path / "child.toml")


def test_the_host_section_is_outside_the_runs_identity(tmp_path: Path) -> None:
    """The run's hash and manifest text leave it out, and a resumed run may bring other host
    settings, but not another value of a run field."""
    from decentrl.coordinator.manifest import config_hash

    config = parse_config({"host": {"run_dir": str(tmp_path)}})
    elsewhere = config.with_host(HostConfig(device="cuda", dtype="bf16", threads=16,
                                            run_dir=tmp_path / "other", dashboard_port=None))
    assert "host" not in json.loads(config.run_json())
    assert config.run_json() == elsewhere.run_json()
    assert config_hash(config) == config_hash(elsewhere)
    assert config_hash(config) != config_hash(parse_config({}, ["seed=1"]))
    store = RunStore(tmp_path / "run.sqlite")
    store.check_or_set_config(config.run_json(), may_change=RESUMABLE_CHANGES)
    store.check_or_set_config(elsewhere.run_json(), may_change=RESUMABLE_CHANGES)
    with pytest.raises(ValueError, match="run config differs"):
        store.check_or_set_config(parse_config({}, ["train.lr=2e-5"]).run_json(),
                                  may_change=RESUMABLE_CHANGES)


def test_a_peer_without_a_config_file_sets_host_fields_only() -> None:
    assert parse_host(["host.dtype=bf16", "host.threads=4"]) == HostConfig(dtype="bf16",
                                                                           threads=4)
    with pytest.raises(ConfigError, match="--set train.lr=1: without --config, the run's "
                                          "settings come from its owner"):
        parse_host(["train.lr=1"])


def test_train_refuses_a_bad_set_in_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["train", "--config", str(ROOT / "examples" / "sums.toml"),
                                      "--set", "train.warmup_steps=3"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "train.warmup_steps is now called train.lr_warmup_steps" in result.output


def test_the_config_package_imports_without_torch() -> None:
    code = "import sys, decentrl.config.docs; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "False"


def test_the_demo_takes_set_after_its_recipe_and_refuses_a_bad_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["demo", "--set", "swarm.ban_s=5"])
    assert result.exit_code == 2
    assert "swarm.ban_s is now called swarm.avoid_failed_peer_s" in " ".join(result.output.split())
    assert not (tmp_path / "runs").exists()  # refused before anything was made

"""The benches run end to end on the tiny model and print their figures. Not a timing test: the
figures only have to exist and be positive."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str) -> ModuleType:
    """Import bench/NAME.py by file path, as `decentrl bench NAME` does."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def figures(output: str, prefix: str) -> dict[str, float]:
    lines = [line for line in output.splitlines() if line.startswith(prefix + " ")]
    assert len(lines) == 1, f"expected one '{prefix} key=value ...' line in:\n{output}"
    pairs = (item.split("=", 1) for item in lines[0].split()[1:])
    return {key: float(value) for key, value in pairs}


def assert_positive(values: dict[str, float], keys: list[str]) -> None:
    for key in keys:
        assert key in values, f"{key} missing from {sorted(values)}"
        assert math.isfinite(values[key]) and values[key] > 0, f"{key}={values[key]}"


def test_trainer_throughput_prints_figures(tiny_model_dir: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("trainer_throughput")
    bench.main(["--model", str(tiny_model_dir), "--device", "cpu", "--batch", "4",
                "--completion-length", "6", "--group-size", "2", "--steps", "1", "--warmup", "0",
                "--threads", "1", "--variants", "decentrl,plain", "--in-process"])
    values = figures(capsys.readouterr().out, "trainer_throughput")
    assert_positive(values, [
        "decentrl_tokens_per_s", "decentrl_completion_tokens_per_s", "decentrl_s_per_step",
        "decentrl_peak_mib", "plain_tokens_per_s", "plain_completion_tokens_per_s",
        "plain_s_per_step", "plain_peak_mib", "ratio_decentrl_vs_plain",
    ])


def test_generation_prints_figures(tiny_model_dir: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("generation")
    bench.main(["--model", str(tiny_model_dir), "--device", "cpu", "--batch", "3",
                "--max-new-tokens", "5", "--steps", "1", "--warmup", "0", "--threads", "1",
                "--in-process"])
    output = capsys.readouterr().out
    values = figures(output, "generation")
    assert_positive(values, [
        "decentrl_sample_new_tokens_per_s", "hf_sample_new_tokens_per_s",
        "decentrl_greedy_new_tokens_per_s", "hf_greedy_new_tokens_per_s",
        "ratio_sample", "ratio_greedy",
    ])
    assert "rows identical to HF" in output

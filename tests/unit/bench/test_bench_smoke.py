"""The benches run end to end on the tiny model and print their figures. Not a timing test: the
figures only have to exist and be positive."""

from __future__ import annotations

import argparse
import importlib
import json
import math
from pathlib import Path
from types import ModuleType

import pytest
import torch


def load_bench(name: str) -> ModuleType:
    """Import the bench package's module NAME, as `decentrl bench NAME` does; importing it in the
    test that runs it keeps one broken bench from failing the others' collection."""
    return importlib.import_module(f"bench.{name}")


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


def test_episode_generation_prints_figures(tiny_model_dir: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("episode_generation")
    options = '{"stories": ["purchase"], "prefill_first_call": true, "max_turns": 3}'
    bench.main(["--model", str(tiny_model_dir), "--device", "cpu", "--batch", "4",
                "--group-size", "2", "--options", options, "--max-new-tokens", "6",
                "--steps", "1", "--warmup", "0", "--threads", "1", "--in-process"])
    values = figures(capsys.readouterr().out, "episode_generation")
    assert_positive(values, ["prompt_tokens_per_row", "prefill_s", "episodes_s",
                             "episodes_sampled_tokens_per_s", "prefill_share"])
    # Two episodes per problem: half of the prompt tokens repeat their group's prompt.
    assert values["repeated_prompt_share"] == pytest.approx(0.5)


def test_prefix_cache_prints_figures(tiny_model_dir: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("prefix_cache")
    bench.main(["--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "bf16",
                "--problems", "4", "--group-size", "2", "--groups-per-session", "2", "--steps",
                "1", "--warmup", "0", "--threads", "1", "--in-process"])
    output = capsys.readouterr().out
    values = figures(output, "prefix_cache")
    assert_positive(values, ["prompt_tokens_per_row", "plain_s", "cached_s",
                             "plain_computed_tokens", "cached_computed_tokens",
                             "cached_reused_tokens", "reused_share", "speedup"])
    # The second session's prompts start with the first's system prompt.
    assert values["cached_computed_tokens"] < values["plain_computed_tokens"]
    assert "greedy next tokens equal" in output


def sweep_result(variant: str, tokens_per_s: list[float]) -> dict[str, object]:
    """A made-up result of one variant of a concurrency sweep (swarm-generation, peer-batching):
    `tokens_per_s` at each level, the rest fixed."""
    levels = [{"tokens_per_s": t, "new_tokens": 256, "generation_s_mean": 1.0}
              for t in tokens_per_s]
    return {"variant": variant, "device": "cpu", "dtype": "bfloat16", "machine": "test",
            "model": "/cache/smollm2", "layers": 30, "prompt_lengths": [40, 42], "failovers": 0,
            "levels": levels}


def test_swarm_generation_baselines_print_figures(tiny_model_dir: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The two single-process baselines: all rows as one HF batch, and one session per thread."""
    bench = load_bench("swarm_generation")
    bench.main(["--model", str(tiny_model_dir), "--device", "cpu", "--batch", "2",
                "--max-new-tokens", "3", "--concurrency", "1,2", "--warmup", "0",
                "--threads", "1", "--variants", "local,batched", "--plot", "none",
                "--in-process"])
    values = figures(capsys.readouterr().out, "swarm_generation")
    assert_positive(values, [f"{variant}_tokens_per_s_c{c}" for variant in ("local", "batched")
                             for c in (1, 2)])


def test_swarm_generation_warms_its_one_batch_baseline_at_every_level(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """Each level's one-batch call is timed after a warm-up call of its own rows, not only the
    first level's: a new batch shape's first call is slower."""
    bench = load_bench("swarm_generation")
    output = tmp_path / "result.json"
    bench.main(["--model", str(tiny_model_dir), "--device", "cpu", "--batch", "2",
                "--max-new-tokens", "2", "--concurrency", "1,2,4", "--warmup", "1",
                "--threads", "1", "--variants", "batched", "--plot", "none", "--in-process",
                "--json", str(output)])
    [batched] = json.loads(output.read_text())["results"]
    assert [len(level["warmup_s"]) for level in batched["levels"]] == [1, 1, 1]


def test_swarm_generation_reports_swarm_against_both_baselines(
        capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("swarm_generation")
    args = bench.parse_args(["--concurrency", "1,16", "--plot", "none"])
    assert args.variants == ["local", "batched", "swarm-off", "swarm-on"]
    bench.report([sweep_result("local", [80.0, 85.0]), sweep_result("batched", [90.0, 250.0]),
                  sweep_result("swarm-off", [20.0, 100.0]),
                  sweep_result("swarm-on", [22.0, 230.0])], args)
    output = capsys.readouterr().out
    values = figures(output, "swarm_generation")
    assert values["swarm_on_vs_batched_c16"] == pytest.approx(0.92)
    assert values["swarm_off_vs_batched_c16"] == pytest.approx(0.4)
    assert values["swarm_off_vs_local_c1"] == pytest.approx(0.25)
    assert values["swarm_on_vs_off_c16"] == pytest.approx(2.3)
    assert "swarm on / one batch (HF) at 16 sessions: 0.92; target >= 0.90 reached" in output
    assert "swarm off / one batch (HF) at 16 sessions: 0.40; target >= 0.90 not reached" in output


def test_swarm_generation_sets_the_data_planes_side_by_side(
        capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("swarm_generation")
    args = bench.parse_args(["--concurrency", "1,4", "--plot", "none", "--variants", "swarm",
                             "--batching", "on", "--planes", "both", "--stages", "4"])
    assert args.variants == ["swarm-on-relayed", "swarm-on"]
    bench.report([sweep_result("swarm-on-relayed", [20.0, 70.0]),
                  sweep_result("swarm-on", [32.0, 84.0])], args)
    output = capsys.readouterr().out
    values = figures(output, "swarm_generation")
    assert values["swarm_on_vs_relayed_c1"] == pytest.approx(1.6)
    assert values["swarm_on_vs_relayed_c4"] == pytest.approx(1.2)
    assert "swarm on / swarm on (relayed): 1.20 at worst (4 sessions); target >= 1.5" in output


@pytest.mark.network
def test_coordinator_bytes_prints_figures(capsys: pytest.CaptureFixture[str]) -> None:
    """Both data planes of a 2-stage swarm of a tiny model, one replica a stage (no check)."""
    bench = load_bench("coordinator_bytes")
    bench.main(["--model", "tiny", "--widths", "", "--stage-counts", "2", "--groups", "1",
                "--group-size", "2", "--max-new-tokens", "3", "--replicas", "1",
                "--micro-batch", "2", "--in-process"])
    values = figures(capsys.readouterr().out, "coordinator_bytes")
    assert_positive(values, ["tiny_2stages_coordinator_bytes_per_token",
                             "tiny_2stages_peer_to_peer_bytes_per_token",
                             "tiny_2stages_peer_to_peer_reduction",
                             "tiny_2stages_coordinator_bytes_per_trained_token",
                             "tiny_2stages_peer_to_peer_bytes_per_trained_token"])


@pytest.mark.network
def test_peer_batching_prints_figures(tiny_model_dir: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Sessions stepping through one peer's real inference RPC (one setting: one peer start)."""
    bench = load_bench("peer_batching")
    bench.main(["--model", str(tiny_model_dir), "--batch", "2", "--max-new-tokens", "3",
                "--concurrency", "1,2", "--warmup", "0", "--threads", "1", "--batching", "on",
                "--in-process"])
    values = figures(capsys.readouterr().out, "peer_batching")
    assert_positive(values, ["batching_on_tokens_per_s_c1", "batching_on_tokens_per_s_c2"])
    assert values["batching_on_failovers"] == 0


def test_peer_batching_reports_after_over_before(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("peer_batching")
    args = bench.parse_args(["--concurrency", "1,16"])
    assert args.variants == ["off", "on"] and args.stages == 1
    bench.report([sweep_result("off", [50.0, 60.0]), sweep_result("on", [55.0, 200.0])], args)
    output = capsys.readouterr().out
    values = figures(output, "peer_batching")
    assert values["ratio_c1"] == pytest.approx(1.1)
    assert values["ratio_c16"] == pytest.approx(200 / 60, rel=1e-5)  # printed to 6 digits
    assert "on / off at 16 sessions: 3.33; target >= 3 reached" in output


def test_update_bytes_prints_figures(tiny_model_dir: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("update_bytes")
    bench.main(["--model", str(tiny_model_dir), "--device", "cpu", "--batch", "4", "--steps", "1",
                "--threads", "1", "--lora-rank", "2", "--in-process", "--encodings",
                "magnitude/int8_delta,served_changes/bf16_value@0.02"])
    values = figures(capsys.readouterr().out, "update-bytes")
    encodings = ["magnitude/int8_delta@0.01", "served_changes/bf16_value@0.02"]
    assert_positive(values, [f"{variant}_{encoding}_{figure}" for variant in ("full", "lora")
                             for encoding in encodings
                             for figure in ("bytes", "vs_dense_bf16", "gap_last", "kl_mean")])
    for variant in ("full", "lora"):
        for encoding in encodings:
            assert 0 < values[f"{variant}_{encoding}_bf16_differing_mean"] <= 1
            assert 0 <= values[f"{variant}_{encoding}_flagged_mean"] <= 1


def test_update_learning_reports_the_difference_with_its_interval(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("update_learning")

    def result(variant: str, after: float) -> dict[str, object]:
        def accuracy(mean: float) -> dict[str, object]:
            return {"pass1": {"mean": mean, "low": mean - 0.06, "high": mean + 0.06, "n": 200}}
        return {"variant": variant, "steps": 25, "wall_s": 600.0, "before": accuracy(0.145),
                "after": accuracy(after), "accuracy": [0.1, 0.3, 0.5], "machine": "test"}

    args = argparse.Namespace(steps=25, eval_problems=200, replicas=2, json=None,
                              out=str(tmp_path))
    bench.report([result("sparse", 0.40), result("dense", 0.44)], args)
    out = capsys.readouterr().out
    assert "sparse - dense pass@1: -0.040" in out and "no significant difference" in out
    bench.report([result("sparse", 0.20), result("dense", 0.44)], args)
    assert "sparse significantly WORSE" in capsys.readouterr().out
    assert (tmp_path / "update_learning.png").read_bytes().startswith(b"\x89PNG")

@pytest.mark.network
def test_update_spread_prints_figures(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("update_spread")
    # One warm-up update: replicas wait on each other only once they have served each other
    # (sync/sources.py).
    bench.main(["--scale", "0.02", "--replicas", "2", "--updates", "1", "--warmup", "1",
                "--out", "none"])
    values = figures(capsys.readouterr().out, "update_spread")
    assert_positive(values, ["swarm_n2_delivered_s", "swarm_n2_applied_s",
                             "star_n2_delivered_s", "dense_bf16_n2_s"])
    # The swarm's publisher sends each chunk once in all; the star's once per replica.
    assert values["swarm_n2_publisher_ratio"] == pytest.approx(1.0, abs=0.1)
    assert values["star_n2_publisher_ratio"] == pytest.approx(2.0, abs=0.1)


@pytest.mark.network
def test_unchecked_claims_prints_figures(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("unchecked_claims")
    bench.main(["--joiners", "2", "--updates", "1", "--params", "4096"])
    values = figures(capsys.readouterr().out, "unchecked-claims")
    assert_positive(values, ["eval_wait_s", "update_clean_s", "update_s"])
    assert values["joiners_stage0"] + values["joiners_stage1"] == 2


def test_curriculum_prints_figures(tiny_model_dir: Path, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("curriculum")
    outcomes = tmp_path / "outcomes.json"
    bench.main(["--model", str(tiny_model_dir), "--device", "cpu", "--threads", "1",
                "--problems", "1", "--batch", "2", "--groups", "40", "--outcomes", str(outcomes)])
    values = figures(capsys.readouterr().out, "curriculum")
    assert values["without_candidates_per_group"] == 1  # every candidate handed out
    assert values["with_candidates_per_group"] >= 1
    for variant in ("without", "with", "replays"):
        assert 0 <= values[f"{variant}_zero_spread_share"] <= 1
    assert outcomes.is_file()  # measured once, read back by the next run


def test_curriculum_replays_see_a_policy_that_learns(tiny_model_dir: Path) -> None:
    """With a learning rate, a problem's groups with spread raise its success chance, so the
    rows solved grow over the run; with none, every problem keeps its measured pass rate."""
    from decentrl.coordinator.curriculum import bucket_of
    from decentrl.envs import make_task_or_environment

    bench = load_bench("curriculum")
    args = bench.parse_args(["--model", str(tiny_model_dir), "--groups", "400"])
    config = bench.demo_task_config(args)
    task = make_task_or_environment(config.task.name, config.task.options)
    buckets = {bucket_of(task.problem("train", index)) for index in range(2000)}
    # Every problem solved 2 times in 8 by the base.
    measured = {bucket: [{"key": bucket, "rewards": [1.0, 1.0] + [0.0] * 6}]
                for bucket in buckets}
    fixed = bench.simulate(args, measured, bench.VARIANTS["replays"], learning_rate=0.0)
    moving = bench.simulate(args, measured, bench.VARIANTS["replays"], learning_rate=0.3)
    assert fixed["solved_share"] == pytest.approx(0.25, abs=0.03)
    assert moving["solved_share"] > fixed["solved_share"] + 0.1
    # Learned problems lose their spread: more groups without it than the base's 1 - P(spread).
    assert moving["zero_spread_share"] > fixed["zero_spread_share"]


def test_train_audit_reports_the_smallest_poison_it_catches(
        capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("train_audit")
    detection = {**{f"{count} of 4 rows negated": [[error, 2.0]]
                    for count, error in ((1, 0.3), (2, 0.7), (4, 2.0))},
                 **{f"advantages x{factor:g}": [[factor - 1, factor - 1]]
                    for factor in bench.SCALES}}
    detection["1 of 4 rows negated"].append([0.9, 0.9])  # caught at one step: not every audit
    found = bench.report_detection(detection, tolerance=0.5, rows=4)
    assert found == {"smallest_rows_negated_caught": 2.0, "smallest_scale_caught": 2.0}
    output = capsys.readouterr().out
    assert "smallest poison every audit catches: 2 of 4 rows negated; advantages x2" in output


def test_train_audit_poisons_on_the_tiny_model(tiny_model_dir: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A scaled step disagrees with the honest one by exactly (factor - 1), and the full ascent
    by 2: the poisons do what their names say."""
    bench = load_bench("train_audit")
    bench.main(["--model", str(tiny_model_dir), "--steps", "1", "--rows", "4"])
    output = capsys.readouterr().out
    values = figures(output, "train_audit")
    assert values["poisoned_min"] == pytest.approx(2.0, rel=1e-3)
    assert values["smallest_scale_caught"] in (1.5, 2.0)  # x1.5 sits on the tolerance, 0.5
    assert 1 <= values["smallest_rows_negated_caught"] <= 4
    assert "advantages x1.25" in output and "4 of 4 rows negated" in output


def test_record_signing_prints_figures(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("record_signing")
    bench.main(["--records", "20", "--repeats", "1"])
    values = figures(capsys.readouterr().out, "record-signing")
    assert_positive(values, [f"{body}_{cost}" for body in ("announcement", "limit")
                             for cost in ("sign_us", "validate_us", "total_us")])


@pytest.mark.network
def test_shared_tables_prints_figures(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("shared_tables")
    bench.main(["--seconds", "0.2", "--identities", "3", "--tiny", "5"])
    values = figures(capsys.readouterr().out, "shared-tables")
    assert_positive(values, ["any_key_records_sent", "stage_crowd_replicas",
                             "inbox_submissions"])
    # Refused, every one of them (what main kept is in bench/README.md).
    assert values["any_key_bytes_added"] == values["inbox_peak_bytes_held"] == 0
    assert values["stage_crowd_joiner_sees"] == values["stage_crowd_replicas"]
    assert values["tiny_records_late_replica_in_directory"] == 1


def test_commit_sensitivity_prints_figures(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("commit_sensitivity")
    bench.main(["--models", "tiny", "--trials", "2"])
    values = figures(capsys.readouterr().out, "commit-sensitivity")
    assert_positive(values, ["tiny_bf16_honest_worst", "tiny_int8_honest_mean"])
    for codec in ("bf16", "int8"):
        assert values[f"tiny_{codec}_honest_every"] == 0  # no false alarm
        assert values[f"tiny_{codec}_noise_0p2_every"] == 1
        assert values[f"tiny_{codec}_noise_0p2_unopened"] == 1


@pytest.mark.network
def test_trust_prints_figures(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Honest peers are never charged; a liar on probation is caught at its first group and
    none of its groups would train; both scenarios report what checking costs."""
    bench = load_bench("trust")
    bench.main(["--model", str(tiny_model_dir), "--groups", "4", "--verify-fraction", "1",
                "--probation-share", "1", "--scenarios", "honest,random-tokens"])
    output = capsys.readouterr().out
    honest = figures(output, "trust_new_honest")
    liar = figures(output, "trust_new_random_tokens")
    assert_positive(honest, ["cost_ratio", "steady_state_cost"])
    assert_positive(liar, ["culprit_groups", "caught"])
    assert liar["caught"] == liar["checked"] and liar["reached_training"] == 0
    assert honest["wrongful"] == liar["wrongful"] == 0
    assert honest["honest_bans"] == liar["honest_bans"] == 0


def test_staleness_forces_exactly_k_and_staleness_shows_in_the_behaviour_kl(
        tmp_path: Path) -> None:
    """With `--model tiny` the bench keeps zero-advantage groups and lets weight decay move the
    weights from version to version (the tiny model solves nothing)."""
    bench = load_bench("staleness")
    out = tmp_path / "staleness"
    bench.main(["--model", "tiny", "--device", "cpu", "--dtype", "fp32", "--threads", "1",
                "--ks", "0,2", "--mixed", "2", "--methods", "tis", "--steps", "4",
                "--eval-problems", "2", "--out", str(out)])
    results = json.loads((out / "staleness.json").read_text())
    runs = {tuple(run["lags"]): run for run in results["runs"]}
    assert set(runs) == {(0, 0), (2, 2), (0, 2), (2, 0)}
    for lags, run in runs.items():
        assert run["steps"] == 4
        # Every group was sampled by each stage exactly its lag behind (less only while the
        # learner had fewer versions), as the groups' own records say.
        assert [[learner - version for version in versions] for learner, versions in
                run["sampled"]] == [[min(learner, lag) for lag in lags]
                                    for learner, _ in run["sampled"]]
        assert len(run["sampled"]) == 4 * 8  # 4 steps of 8 prompts
    kl = {lags: bench.statistics.fmean(run["curves"]["behaviour_kl"])
          for lags, run in runs.items()}
    assert kl[(2, 2)] > 1e-4 and kl[(2, 2)] > 100 * kl[(0, 0)]
    assert kl[(0, 2)] > 100 * kl[(0, 0)] and kl[(2, 0)] > 100 * kl[(0, 0)]
    for plot in ("staleness_accuracy.png", "staleness_curves.png"):
        assert (out / plot).read_bytes().startswith(b"\x89PNG")
    # A grid run in pieces reads back as one: each row compared with lag 0 of its own steps.
    combined = tmp_path / "combined"
    bench.main(["--combine", str(out / "staleness.json"), str(out / "staleness.json"),
                "--out", str(combined)])
    rows = json.loads((combined / "staleness.json").read_text())["rows"]
    assert {(row["label"], row["seeds"], row["steps"]) for row in rows} == {
        ("0", 2, 4), ("2", 2, 4), ("0/2", 2, 4), ("2/0", 2, 4)}
    assert all(("difference" in row) == (row["label"] != "0") for row in rows)
    with pytest.raises(SystemExit, match="not a staleness.json"):
        bench.main(["--combine", str(out / "staleness_accuracy.png"), "--out", str(combined)])


def test_moe_routing_replay_prints_figures(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("moe_routing_replay")
    bench.main(["--updates", "2", "--report", "1,2", "--seeds", "1", "--batch", "8",
                "--length", "6", "--layers", "2", "--threads", "1"])
    values = figures(capsys.readouterr().out, "moe_routing_replay")
    keys = [f"{family}_{row}_{figure}_{arm}" for family in ("qwen3_moe", "mixtral")
            for row in ("1step", "2step", "bf16") for figure in ("kl", "k3", "changed")
            for arm in ("free", "replay")]
    assert sorted(values) == sorted(keys)
    assert all(math.isfinite(value) for value in values.values())
    assert all(0 <= values[key] <= 1 for key in keys if "_changed_" in key)
    assert all(values[key] >= 0 for key in keys if "_k3_" in key)


def test_expert_claims_prints_figures(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("expert_claims")
    bench.main(["--inits", "0.1", "--seeds", "1", "--batch", "4", "--length", "6",
                "--layers", "2", "--threads", "1"])
    values = figures(capsys.readouterr().out, "expert_claims")
    keys = [f"{family}_0.1_{figure}" for family in ("qwen3_moe", "mixtral")
            for figure in ("std", "hidden_error", "honest_p999", "honest_max", "honest_over",
                           "random_median", "random_caught", "next_best_median",
                           "next_best_caught")]
    assert sorted(values) == sorted(keys)
    assert all(math.isfinite(value) and value >= 0 for value in values.values())
    # A forgery with an unchosen expert always has a gap; the honest claims' are smaller.
    for family in ("qwen3_moe", "mixtral"):
        assert values[f"{family}_0.1_random_median"] > values[f"{family}_0.1_honest_p999"]


def test_simulate_projects_both_data_planes(capsys: pytest.CaptureFixture[str]) -> None:
    """A small internet projection (the demo's calibration times real stages: not here): both
    designs train, and activations from peer to peer take the coordinator off the data plane."""
    bench = load_bench("simulate")
    bench.main(["--scenario", "internet", "--model", "135m", "--stages", "2", "--peers", "8",
                "--duration", "150", "--session-s", "0"])
    values = figures(capsys.readouterr().out, "simulate")
    for plane in ("coordinator", "peer_to_peer"):
        assert values[f"{plane}_steps"] >= 1 and values[f"{plane}_rows_stepped_per_s"] > 0
    relayed = values["coordinator_coordinator_received_mb"]
    assert values["peer_to_peer_coordinator_received_mb"] < relayed / 3


def test_simulate_refuses_a_measured_scenario_without_what_it_replays(
        capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("simulate")
    with pytest.raises(SystemExit):
        bench.main(["--scenario", "chaos"])
    assert "give --measured RUN_DIR" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--scenario", "operator"])
    assert "needs the walk's --config" in capsys.readouterr().err


def test_family_conformance_prints_figures(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("family_conformance")
    bench.main(["--families", "qwen3"])
    values = figures(capsys.readouterr().out, "family_conformance")
    keys = [f"qwen3_{key}" for key in ("stages1", "stages2", "stages3", "stages4", "kv",
                                        "sessions", "lora", "export")]
    assert sorted(values) == sorted(["cases", "loaded", "max_difference", "seconds", *keys])
    assert (values["cases"], values["loaded"]) == (1, 1)
    assert all(0 <= values[key] <= 1e-5 for key in keys)
    with pytest.raises(SystemExit):
        bench.main(["--families", "gpt2"])


def test_mixed_precision_prints_figures(tiny_model_dir: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("mixed_precision")
    bench.main(["--model", str(tiny_model_dir), "--groups", "2", "--group-size", "2",
                "--max-new-tokens", "3", "--threads", "1"])
    values = figures(capsys.readouterr().out, "mixed_precision")
    # The same dtype twice computes the same hidden states; bf16 against fp32 does not.
    assert values["bf16_bf16_hidden_error_max"] == 0.0
    assert_positive(values, ["bf16_fp32_hidden_error_mean", "fp32_bf16_logprob_gap_max"])
    assert values["bf16_fp32_hidden_error_max"] < 0.25  # within the sketch tolerance


def test_int8_base_halves_the_projections_and_stays_near_fp32(
        tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("int8_base")
    path = tmp_path / "int8.json"
    bench.main(["--model", str(tiny_model_dir), "--variants", "bf16,int8,int8-fp32", "--rank",
                "4", "--batch", "2", "--prompt-length", "6", "--max-new-tokens", "4", "--steps",
                "1", "--warmup", "0", "--threads", "1", "--json", str(path)])
    values = figures(capsys.readouterr().out, "int8_base")
    assert json.loads(path.read_text())["figures"] == pytest.approx(values, rel=1e-5)
    assert all(math.isfinite(value) for value in values.values()), values
    variants = ("fp32", "bf16", "int8", "int8_fp32")  # fp32, the reference, always runs
    assert_positive(values, [f"{v}_{name}" for v in variants for name in (
        "frozen_bytes", "projection_bytes", "adapter_bytes", "new_tokens_per_s",
        "train_step_s")])
    # int8 values and an fp32 scale a row: about half of bf16's bytes, whatever the compute.
    assert values["int8_projection_bytes"] < 0.6 * values["bf16_projection_bytes"]
    assert values["int8_fp32_projection_bytes"] == values["int8_projection_bytes"]
    assert values["bf16_projection_bytes"] == values["fp32_projection_bytes"] / 2
    assert values["int8_frozen_bytes"] < values["bf16_frozen_bytes"]
    # The learners' adapters are fp32 masters in every variant; the served ones take the compute.
    assert len({values[f"{v}_adapter_bytes"] for v in variants}) == 1
    assert values["int8_served_adapter_bytes"] == values["fp32_adapter_bytes"] / 2
    # The base moves the log-probs, a little: quantized or rounded, never identical to fp32.
    assert values["fp32_logprob_diff_max"] == 0.0
    for variant in ("bf16", "int8", "int8_fp32"):
        assert 0 < values[f"{variant}_logprob_diff_mean"] <= values[f"{variant}_logprob_diff_max"]
        assert values[f"{variant}_logprob_diff_max"] < 0.5


def test_entropy_study_evaluates_every_family_at_its_steps_and_fits_r_against_h(
        tmp_path: Path) -> None:
    bench = load_bench("entropy")
    out = tmp_path / "entropy"
    bench.main(["--model", "tiny", "--device", "cpu", "--dtype", "fp32", "--threads", "1",
                "--methods", "baseline,kl_cov", "--lags", "0,2", "--seeds", "0", "--steps", "3",
                "--at", "1", "--eval-problems", "2", "--family-problems", "2", "--pass-k", "2",
                "--out", str(out)])
    results = json.loads((out / "entropy.json").read_text())
    runs = {(run["method"], run["lag"]): run for run in results["runs"]}
    assert set(runs) == {("baseline", 0), ("baseline", 2), ("kl_cov", 0), ("kl_cov", 2)}
    for (method, _), run in runs.items():
        # KL-Cov takes two optimizer steps a batch (a version each), the baseline one.
        assert run["steps"] == 3 and run["version"] == 3 * (2 if method == "kl_cov" else 1)
        assert [e["step"] for e in run["evaluations"]] == [1, 3]
        for evaluation in run["evaluations"]:
            assert len(evaluation["families"]) == 3
            assert all(f["problems"] == 2 and f["pass_k"] is not None
                       for f in evaluation["families"].values())
        assert len(run["curves"]["entropy"]) == 3
    selected = runs[("kl_cov", 0)]["curves"]["cov_selected_fraction"]
    assert all(v is not None and v > 0 for v in selected)
    # Every method replaces the demo recipe's own entropy bonus: the baseline runs without one.
    assert all(v is None for v in runs[("baseline", 0)]["curves"]["entropy_coef"])
    rows = {(row["method"], row["lag"], row["step"]) for row in results["rows"]}
    assert len(rows) == 8 and set(results["fits"]) == {"baseline", "kl_cov"}
    for plot in ("entropy_curves.png", "entropy_fit.png"):
        assert (out / plot).read_bytes().startswith(b"\x89PNG")
    combined = tmp_path / "combined"
    bench.main(["--combine", str(out / "entropy.json"), str(out / "entropy.json"),
                "--out", str(combined)])
    combined_rows = json.loads((combined / "entropy.json").read_text())["rows"]
    assert {row["seeds"] for row in combined_rows} == {2}


def test_vs_trl_gives_trl_the_recipes_minibatches_epochs_and_entropy_bonus(
        tmp_path: Path) -> None:
    bench = load_bench("vs_trl")
    config = bench.bench_config("smollm2-135m-instruct", 10, 10, tmp_path)
    config = config.model_copy(update={"train": config.train.model_copy(
        update={"minibatches_per_batch": 2, "epochs_per_batch": 2})})
    arguments = bench.trl_arguments(config, torch.float32, True, tmp_path)
    # 64 completions in micro-batches of 32: one generation batch of 2 micro-batches, an
    # optimizer step each, passed over twice.
    assert arguments["steps_per_generation"] == 2
    assert arguments["gradient_accumulation_steps"] == 1
    assert arguments["num_iterations"] == 2
    assert arguments["max_steps"] == config.train.steps * 4
    entropy = config.train.entropy
    assert arguments["use_adaptive_entropy"] and arguments["entropy_coef"] == 0.0
    assert (arguments["entropy_target"], arguments["entropy_coef_delta"],
            arguments["entropy_coef_max"]) == (entropy.target, entropy.coef_step,
                                               entropy.max_coef)

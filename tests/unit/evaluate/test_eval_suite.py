"""`decentrl eval` over a suite: the general-set KL and perplexity against a direct computation
with transformers, the changes' intervals against hand-computed values, the suite end to end on
tiny models, its JSON and Markdown, and the command line."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import torch
from helpers import build
from typer.testing import CliRunner

from decentrl.cli import app
from decentrl.evaluate.divergence import (
    GeneralPrompt,
    GeneralResult,
    Interval,
    evaluate_general,
    load_general_prompts,
)
from decentrl.evaluate.runner import EvalResult
from decentrl.evaluate.stats import Accuracy, difference_interval
from decentrl.evaluate.suite import (
    DEFAULT_SUITE,
    Family,
    FamilyResult,
    SuiteResult,
    evaluate_suite,
    mean_change,
    pass1_change,
    suite_table_markdown,
    with_overrides,
)
from decentrl.model.loading import load_model

# Different lengths, so batches of two are left-padded and one batch holds a single prompt.
PROMPTS = [
    GeneralPrompt("What is rain?", "Water that falls from clouds."),
    GeneralPrompt("Say hi.", "Hi!"),
    GeneralPrompt("Name a colour.", "Blue, like the sky on a clear day."),
]


def direct_logprobs(folder: Path, prompts: list[GeneralPrompt]) -> list[tuple[torch.Tensor,
                                                                              torch.Tensor]]:
    """Per prompt, with transformers and no padding: log-softmax [T, vocab] at the positions that
    predict the reply's tokens, and those tokens. The reply's tokens are read off the full
    two-turn chat (reply, end-of-turn), not built the way divergence.py builds them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = load_model(str(folder)).tokenizer
    out = []
    for item in prompts:
        user = [{"role": "user", "content": item.prompt}]
        prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True)["input_ids"]
        chat = tokenizer.apply_chat_template(
            [*user, {"role": "assistant", "content": item.response}])["input_ids"]
        end = chat.index(tokenizer.eos_token_id, len(prompt)) + 1  # the reply's <|im_end|>
        ids = torch.tensor([chat[:end]])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        out.append((torch.log_softmax(logits[len(prompt) - 1:end - 1], -1), ids[0, len(prompt):]))
    return out


def perplexity(logprobs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    nll = sum(-float(lp.gather(1, t[:, None]).sum()) for lp, t in logprobs)
    return math.exp(nll / sum(len(t) for _, t in logprobs))


def test_kl_against_itself_is_zero_and_perplexity_matches_a_direct_forward(
        tiny_model_dir: Path) -> None:
    model = load_model(str(tiny_model_dir))
    result = evaluate_general(build(model, 2), build(model, 1), model.tokenizer, PROMPTS,
                              batch_size=2)
    direct = direct_logprobs(tiny_model_dir, PROMPTS)
    assert result.prompts == 3
    # The tiny tokenizer has one token per character; every reply ends with <|im_end|>.
    assert result.tokens == sum(len(t) for _, t in direct) == sum(len(p.response) + 1
                                                                  for p in PROMPTS)
    assert result.kl is not None
    assert max(abs(result.kl.mean), abs(result.kl.low), abs(result.kl.high)) < 1e-6
    assert result.perplexity == pytest.approx(perplexity(direct), rel=1e-4)
    assert result.base_perplexity == pytest.approx(result.perplexity, rel=1e-6)
    # Without a base there is only the model's perplexity.
    alone = evaluate_general(build(model, 1), None, model.tokenizer, PROMPTS)
    assert alone.kl is None and alone.base_perplexity is None
    assert alone.perplexity == pytest.approx(result.perplexity, rel=1e-5)


def test_kl_against_another_model_matches_a_direct_computation(
        tiny_model_dir: Path, tiny_sharp_dir: Path) -> None:
    model, base = load_model(str(tiny_model_dir)), load_model(str(tiny_sharp_dir))
    result = evaluate_general(build(model, 2), build(base, 2), model.tokenizer, PROMPTS,
                              batch_size=2)
    direct_model = direct_logprobs(tiny_model_dir, PROMPTS)
    direct_base = direct_logprobs(tiny_sharp_dir, PROMPTS)
    per_prompt = [float((p.exp() * (p - q)).sum(-1).mean())
                  for (p, _), (q, _) in zip(direct_model, direct_base)]
    mean = statistics.fmean(per_prompt)
    half_width = 1.96 * statistics.stdev(per_prompt) / math.sqrt(3)
    assert result.kl is not None and result.kl.mean > 0.01
    assert result.kl.mean == pytest.approx(mean, rel=1e-4)
    assert result.kl.low == pytest.approx(mean - half_width, rel=1e-4, abs=1e-6)
    assert result.kl.high == pytest.approx(mean + half_width, rel=1e-4)
    assert result.perplexity == pytest.approx(perplexity(direct_model), rel=1e-4)
    assert result.base_perplexity == pytest.approx(perplexity(direct_base), rel=1e-4)


def test_general_prompt_set_is_packaged_and_general() -> None:
    prompts = load_general_prompts()
    assert len(prompts) >= 40
    assert len({p.prompt for p in prompts}) == len(prompts)
    for item in prompts:
        assert 10 <= len(item.response.split()) <= 90, item.prompt


def test_pass1_change_is_newcombes_interval_of_the_counts() -> None:
    # Newcombe (1998), Table II, example (a): 56/70 vs 48/80 -> 0.2000 [0.0524, 0.3339].
    change = pass1_change(Accuracy.from_counts(56, 70), Accuracy.from_counts(48, 80))
    assert change.mean == pytest.approx(0.2)
    assert change.low == pytest.approx(0.0524, abs=2e-4)
    assert change.high == pytest.approx(0.3339, abs=2e-4)


def test_mean_change_adds_standard_errors_in_quadrature() -> None:
    # Half widths 0.1 and 0.08 are 1.96 standard errors each; the difference's half width is
    # sqrt(0.1^2 + 0.08^2) = sqrt(0.0164) = 0.128062.
    change = mean_change(Accuracy(0.5, 0.4, 0.6, 50), Accuracy(0.3, 0.22, 0.38, 50))
    assert change.mean == pytest.approx(0.2)
    assert change.low == pytest.approx(0.2 - 0.128062, abs=1e-6)
    assert change.high == pytest.approx(0.2 + 0.128062, abs=1e-6)
    # An interval clipped at 0 keeps its unclipped half width: 0.1 - 0.0 (clipped from -0.02)
    # and 0.22 - 0.1 = 0.12 give 0.12, against a base with no spread.
    change = mean_change(Accuracy(0.1, 0.0, 0.22, 8), Accuracy(0.0, 0.0, 0.0, 8))
    assert change.low == pytest.approx(-0.02) and change.high == pytest.approx(0.22)
    # From none to nearly all: the bound stays a difference two shares can have (1.0, not 1.05).
    change = mean_change(Accuracy(0.95, 0.85, 1.0, 5), Accuracy(0.0, 0.0, 0.0, 5))
    assert change.high == 1.0 and change.low == pytest.approx(0.85)


def test_families_validate_and_take_overrides() -> None:
    with pytest.raises(ValueError, match="problems must be >= 1"):
        Family("sums", problems=0)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        Family("sums", max_new_tokens=0)
    overridden = with_overrides(DEFAULT_SUITE, problems=7)
    assert [f.problems for f in overridden] == [7] * len(DEFAULT_SUITE)
    assert [f.max_new_tokens for f in overridden] == [f.max_new_tokens for f in DEFAULT_SUITE]
    assert Family("sums", {"min_digits": 2, "max_digits": 2}).label == \
        "sums min_digits=2 max_digits=2"
    # The default suite: the demo's trained family and at least two it does not train on.
    assert DEFAULT_SUITE[0] == Family("sums", {"min_digits": 2, "max_digits": 2},
                                      max_new_tokens=24)
    assert len({f.label for f in DEFAULT_SUITE}) >= 3


def accuracy_result(task: str, pass1: Accuracy, pass_k: Accuracy | None) -> EvalResult:
    return EvalResult(task=task, split="heldout", problems=pass1.n, pass1=pass1, pass_k=pass_k,
                      k=4, mean_completion_tokens=5.0, samples=[])


def test_markdown_table_holds_every_number_with_its_interval() -> None:
    after, before = Accuracy.from_counts(30, 100), Accuracy.from_counts(20, 100)
    after_k, before_k = Accuracy(0.5, 0.4, 0.6, 100), Accuracy(0.3, 0.22, 0.38, 100)
    family = Family("sums", {"min_digits": 2, "max_digits": 2}, problems=100)
    result = SuiteResult(
        model="runs/demo/model", base="smollm2-135m-instruct", pass_k=4, seed=0,
        families=[FamilyResult(family, accuracy_result("sums", after, after_k),
                               accuracy_result("sums", before, before_k),
                               pass1_change(after, before), mean_change(after_k, before_k))],
        general=GeneralResult(prompts=41, tokens=2457, perplexity=13.0, base_perplexity=12.5,
                              kl=Interval(0.0123, 0.0101, 0.0145)),
        seconds=1.0)
    low, high = difference_interval(30, 100, 20, 100)
    assert suite_table_markdown(result).splitlines() == [
        "| family | metric | base | model | change |",
        "| --- | --- | --- | --- | --- |",
        f"| sums min_digits=2 max_digits=2 (100 problems) | pass@1 (greedy) | "
        f"{before.as_percent()} | {after.as_percent()} | "
        f"+10.0 pts [{100 * low:+.1f}, {100 * high:+.1f}] |",
        "|  | pass@4 (T=1) | 30.0% [22.0, 38.0] | 50.0% [40.0, 60.0] | "
        "+20.0 pts [+7.2, +32.8] |",
        "| general set (41 prompts, 2457 tokens) | perplexity | 12.500 | 13.000 | +4.0% |",
        "|  | KL(model ‖ base), nats/token |  | 0.0123 [0.0101, 0.0145] |  |",
    ]
    alone = SuiteResult(
        model="m", base=None, pass_k=1, seed=0,
        families=[FamilyResult(family, accuracy_result("sums", after, None), None, None, None)],
        general=GeneralResult(41, 2457, 13.0, None, None), seconds=1.0)
    assert suite_table_markdown(alone).splitlines() == [
        "| family | metric | model |",
        "| --- | --- | --- |",
        f"| sums min_digits=2 max_digits=2 (100 problems) | pass@1 (greedy) | "
        f"{after.as_percent()} |",
        "| general set (41 prompts, 2457 tokens) | perplexity | 13.000 |",
    ]


def test_suite_end_to_end_on_tiny_models(tiny_model_dir: Path, tiny_sharp_dir: Path) -> None:
    families = [Family("sums", {"max_digits": 1}, problems=3, max_new_tokens=3),
                Family("rg:chain_sum", {"config": {"min_terms": 2, "max_terms": 2}}, problems=2,
                       max_new_tokens=3)]
    calls: list[tuple[str, int, int | None]] = []
    result = evaluate_suite(tiny_model_dir, tiny_sharp_dir, families, pass_k=2, batch_size=4,
                            num_stages=2, device="cpu", dtype="fp32", general_prompts=PROMPTS,
                            progress=lambda *call: calls.append(call))
    assert [f.family for f in result.families] == families
    for item in result.families:
        assert item.base is not None and item.pass1_change is not None
        assert item.model.problems == item.base.problems == item.family.problems
        assert item.model.k == 2 and item.model.pass_k is not None
        assert item.pass_k_change is not None
        solved_model = round(item.model.pass1.mean * item.family.problems)
        solved_base = round(item.base.pass1.mean * item.family.problems)
        assert (item.pass1_change.low, item.pass1_change.high) == difference_interval(
            solved_model, item.family.problems, solved_base, item.family.problems)
    assert result.general.prompts == 3 and result.general.kl is not None
    assert result.general.kl.mean > 0
    # Every family of both models, and the general set, ran to its end: greedy plus k samples.
    finished = {description: done for description, done, total in calls if done == total}
    assert finished == {"model · sums max_digits=1": 9, "base · sums max_digits=1": 9,
                        'model · rg:chain_sum config={"min_terms":2,"max_terms":2}': 6,
                        'base · rg:chain_sum config={"min_terms":2,"max_terms":2}': 6,
                        "general set": 3}
    data = json.loads(json.dumps(result.to_json()))
    assert SuiteResult.from_json(data) == result
    assert set(data) == {"model", "base", "pass_k", "seed", "families", "general", "seconds"}
    assert set(data["families"][0]) == {"family", "model", "base", "pass1_change",
                                        "pass_k_change"}
    assert set(data["general"]["kl"]) == {"mean", "low", "high"}
    table = suite_table_markdown(result)
    assert result.families[0].model.pass1.as_percent() in table
    assert f"{result.general.kl.low:.4f}" in table


def run_cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["eval", *args])
    # Rich wraps long lines; compare with the whitespace collapsed.
    return result.exit_code, " ".join(result.output.split())


def test_cli_compares_against_a_base_and_writes_json(tiny_model_dir: Path, tiny_sharp_dir: Path,
                                                     tmp_path: Path) -> None:
    output = tmp_path / "eval.json"
    code, text = run_cli("--model", str(tiny_model_dir), "--base", str(tiny_sharp_dir),
                         "--problems", "2", "--pass-k", "2", "--max-new-tokens", "2",
                         "--device", "cpu", "--dtype", "fp32", "--output", str(output))
    assert code == 0, text
    result = SuiteResult.from_json(json.loads(output.read_text()))
    assert [f.family for f in result.families] == with_overrides(DEFAULT_SUITE, 2, 2)
    assert result.general.prompts == len(load_general_prompts())
    assert result.general.kl is not None and result.general.kl.mean > 0
    assert "KL(model" in text and "perplexity" in text  # rich wraps the narrow table


def test_cli_evaluates_one_task_with_options(tiny_model_dir: Path, tmp_path: Path) -> None:
    output = tmp_path / "eval.json"
    code, text = run_cli("--model", str(tiny_model_dir), "--task", "sums", "--option",
                         "max_digits=1", "--problems", "3", "--pass-k", "1",
                         "--max-new-tokens", "2", "--device", "cpu", "--output", str(output))
    assert code == 0, text
    result = SuiteResult.from_json(json.loads(output.read_text()))
    assert [f.family for f in result.families] == [Family("sums", {"max_digits": 1}, 3, 2)]
    assert result.base is None and result.general.kl is None
    assert result.families[0].model.pass_k is None


@pytest.mark.parametrize(("args", "message"), [
    (["--task", "nope"], "unknown task 'nope'"),
    (["--task", "sums", "--option", "max_digits"], "must look like KEY=VALUE"),
    (["--task", "sums", "--option", "digits=3"], "task 'sums' has no option 'digits'"),
    (["--task", "sums", "--option", "max_digits=99"], "max_digits must be an int in"),
    (["--option", "max_digits=1"], "--option needs --task"),
    (["--problems", "0"], "problems must be >= 1"),
    (["--pass-k", "0"], "pass_k must be >= 1"),
    (["--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
    (["--batch-size", "0"], "batch_size must be >= 1"),
    (["--device", "tpu"], "device must be one of"),
    (["--base", "/no/such/model"], "'/no/such/model' is neither"),
    (["--output", "/no/such/folder/eval.json"], "folder /no/such/folder does not exist"),
])
def test_cli_refuses_bad_input(tiny_model_dir: Path, args: list[str], message: str) -> None:
    code, text = run_cli("--model", str(tiny_model_dir), *args)
    assert code == 2, text
    assert message in text


def test_cli_refuses_a_missing_model() -> None:
    code, text = run_cli("--model", "/no/such/model")
    assert code == 2
    assert "'/no/such/model' is neither 'smollm2-135m-instruct', a Hugging Face folder with a " \
           "config.json, nor a .gguf file" in text

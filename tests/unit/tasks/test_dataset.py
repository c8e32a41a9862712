"""The "dataset" task (tasks/dataset.py): every format, the columns, the hash split and a dataset's
own test split, the problem order, every refusal, and the task end to end through
`make_task_or_environment` on the shipped word problems (examples/datasets)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from datasets import Dataset, DatasetDict

from decentrl.envs import make_task_or_environment
from decentrl.tasks import make_task, problems, split_of
from decentrl.tasks.dataset import DatasetTask

REPOSITORY = Path(__file__).resolve().parents[3]
WORD_PROBLEMS = REPOSITORY / "examples" / "datasets" / "word_problems.jsonl"
GENERATOR = REPOSITORY / "examples" / "datasets" / "make_word_problems.py"


def rows(count: int = 60) -> list[dict[str, Any]]:
    return [{"q": f"What is {i} plus {i}?", "a": 2 * i, "sys": f"Be brief ({i})."}
            for i in range(count)]


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def dataset_task(path: Path, **options: Any) -> DatasetTask:
    task = make_task("dataset", path=str(path), **{"prompt_column": "q", "answer_column": "a",
                                                   "heldout_fraction": 0.3, **options})
    assert isinstance(task, DatasetTask)
    return task


def all_questions(task: DatasetTask) -> dict[str, set[str]]:
    return {split: {row.question for row in split_rows} for split, split_rows in task.rows.items()}


# --- formats and columns -------------------------------------------------------------------------


@pytest.mark.parametrize("format_", ["jsonl", "parquet", "csv", "saved", "saved_dict"])
def test_every_format_reads_the_same_problems(tmp_path: Path, format_: str) -> None:
    source = write_jsonl(tmp_path / "rows.jsonl", rows())
    table = Dataset.from_json(str(source))
    path = {"jsonl": source, "parquet": tmp_path / "rows.parquet", "csv": tmp_path / "rows.csv",
            "saved": tmp_path / "saved", "saved_dict": tmp_path / "saved_dict"}[format_]
    if format_ == "parquet":
        table.to_parquet(str(path))
    elif format_ == "csv":
        table.to_csv(str(path), index=False)
    elif format_ == "saved":
        table.save_to_disk(str(path))
    elif format_ == "saved_dict":
        DatasetDict({"train": table}).save_to_disk(str(path))
    task = dataset_task(path, system_prompt_column="sys")
    assert all_questions(task) == all_questions(dataset_task(source, system_prompt_column="sys"))
    problem = task.problem("train", 0)
    number = int(problem.question.split()[2])
    assert problem.answer == str(2 * number)  # an integer column comes back as text
    assert task.messages(problem) == [
        {"role": "system", "content": f"Be brief ({number})."},
        {"role": "user", "content": problem.question}]


def test_the_format_option_overrides_the_suffix(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "rows.txt", rows())
    with pytest.raises(ValueError, match="cannot tell the format"):
        dataset_task(path)
    assert len(problems(dataset_task(path, format="json"), "heldout", 3)) == 3


def test_without_a_system_prompt_column_a_problem_is_one_user_message(tmp_path: Path) -> None:
    task = dataset_task(write_jsonl(tmp_path / "rows.jsonl", rows()))
    problem = task.problem("train", 0)
    assert task.messages(problem) == [{"role": "user", "content": problem.question}]


# --- splits and order ----------------------------------------------------------------------------


def test_the_hash_split_is_disjoint_stable_and_independent_of_row_order(tmp_path: Path) -> None:
    records = rows(200)
    task = dataset_task(write_jsonl(tmp_path / "rows.jsonl", records))
    reversed_task = dataset_task(write_jsonl(tmp_path / "reversed.jsonl", records[::-1]))
    questions = all_questions(task)
    assert questions == all_questions(reversed_task)
    assert not questions["train"] & questions["heldout"]
    assert len(questions["train"]) + len(questions["heldout"]) == 200
    assert all(split_of(q, 0.3) == split for split in questions for q in questions[split])
    assert 0.2 < len(questions["heldout"]) / 200 < 0.4


def test_problems_walk_a_fixed_shuffled_order_and_train_ones_go_around(tmp_path: Path) -> None:
    task = dataset_task(write_jsonl(tmp_path / "rows.jsonl", rows(40)))
    size = len(task.rows["train"])
    first_pass = [p.key for p in problems(task, "train", size)]
    second_pass = [p.key for p in problems(task, "train", size, start=size)]
    assert set(first_pass) == set(second_pass) == all_questions(task)["train"]
    assert first_pass != second_pass  # a new order for every pass
    file_order = [row.question for row in task.rows["train"]]
    assert first_pass != file_order
    again = dataset_task(write_jsonl(tmp_path / "again.jsonl", rows(40)))
    assert [p.key for p in problems(again, "train", 2 * size)] == first_pass + second_pass


def test_held_out_problems_end_at_the_last_held_out_row(tmp_path: Path) -> None:
    task = dataset_task(write_jsonl(tmp_path / "rows.jsonl", rows()))
    held_out = len(task.rows["heldout"])
    assert {p.key for p in problems(task, "heldout", held_out)} == all_questions(task)["heldout"]
    with pytest.raises(ValueError, match=f"has {held_out} held-out problems.*eval.problems"):
        task.problem("heldout", held_out)


def test_a_saved_dataset_dicts_own_test_split_is_held_out(tmp_path: Path) -> None:
    train, test = rows(50), [{"q": f"What is {i} times 3?", "a": 3 * i, "sys": ""}
                             for i in range(10)]
    # A test prompt that also appears among the training rows must not be trained on.
    path = tmp_path / "saved"
    DatasetDict({"train": Dataset.from_list(train + test[:2]),
                 "test": Dataset.from_list(test)}).save_to_disk(str(path))
    task = dataset_task(path, test_split="test")
    questions = all_questions(task)
    assert questions["heldout"] == {record["q"] for record in test}
    assert questions["train"] == {record["q"] for record in train}


def test_a_test_file_is_held_out(tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", rows(30))
    test_table = Dataset.from_list([{"q": "What is 1000 plus 1?", "a": 1001, "sys": ""}])
    test_table.to_parquet(str(tmp_path / "test.parquet"))
    task = dataset_task(train, test_path=str(tmp_path / "test.parquet"))
    assert all_questions(task)["heldout"] == {"What is 1000 plus 1?"}
    assert len(task.rows["train"]) == 30


def test_a_split_other_than_train_can_be_trained_on(tmp_path: Path) -> None:
    path = tmp_path / "saved"
    DatasetDict({"validation": Dataset.from_list(rows())}).save_to_disk(str(path))
    with pytest.raises(ValueError, match="has no split 'train'; its splits: validation"):
        dataset_task(path)
    assert len(dataset_task(path, split="validation").rows["train"]) > 0


# --- refusals ------------------------------------------------------------------------------------


def test_bad_datasets_are_refused_with_the_problem_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing.jsonl does not exist"):
        dataset_task(tmp_path / "missing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty.jsonl is empty"):
        dataset_task(empty)
    path = write_jsonl(tmp_path / "rows.jsonl", rows())
    with pytest.raises(ValueError, match="has no column 'question'; its columns: 'q', 'a', 'sys'"):
        dataset_task(path, prompt_column="question")
    with pytest.raises(ValueError, match="no split"):
        dataset_task(path, split="train")  # a file has no splits
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="cannot read dataset .*broken.parquet as parquet"):
        dataset_task(broken)
    with pytest.raises(ValueError, match="unknown dataset format 'xml'"):
        dataset_task(path, format="xml")


def test_a_dataset_without_rows_is_refused(tmp_path: Path) -> None:
    parquet, csv = tmp_path / "rows.parquet", tmp_path / "rows.csv"
    Dataset.from_dict({"q": [], "a": []}).to_parquet(str(parquet))
    csv.write_text("q,a\n")
    for path in (parquet, csv):
        with pytest.raises(ValueError, match=f"{path.name} has no rows"):
            dataset_task(path)


def test_empty_answers_and_prompts_are_refused_naming_the_rows(tmp_path: Path) -> None:
    records = rows(10)
    for index in (2, 7):
        records[index]["a"] = ""
    records[4]["a"] = None
    with pytest.raises(ValueError, match=r"answer column 'a' is empty in rows 2, 4, 7"):
        dataset_task(write_jsonl(tmp_path / "answers.jsonl", records))
    records = rows(10)
    records[3]["q"] = "   "
    with pytest.raises(ValueError, match=r"prompt column 'q' is empty or not text in rows 3"):
        dataset_task(write_jsonl(tmp_path / "prompts.jsonl", records))


def test_answers_the_checker_cannot_read_are_refused(tmp_path: Path) -> None:
    records = rows(10)
    records[5]["a"] = "five"
    with pytest.raises(ValueError, match=r"row 5 .*checker 'numeric'.*'five' is not a number"):
        dataset_task(write_jsonl(tmp_path / "rows.jsonl", records), checker="numeric")
    test_path = write_jsonl(tmp_path / "test.jsonl", records)
    with pytest.raises(ValueError, match=r"test.jsonl, row 5 .*'five' is not a number"):
        dataset_task(write_jsonl(tmp_path / "train.jsonl", rows(20)[10:]), checker="numeric",
                     test_path=str(test_path))


def test_a_split_too_small_for_the_fraction_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="falls in the heldout split"):
        dataset_task(write_jsonl(tmp_path / "rows.jsonl", rows(2)), heldout_fraction=0.01)


def test_unknown_options_and_checkers_are_refused(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "rows.jsonl", rows())
    with pytest.raises(ValueError, match="task 'dataset' has no option 'prompt'; its options: "
                                         "path, format, prompt_column"):
        make_task("dataset", path=str(path), prompt="q")
    with pytest.raises(ValueError, match="unknown checker 'close'"):
        dataset_task(path, checker="close")
    with pytest.raises(ValueError, match="cannot import module 'nowhere_to_be_found'"):
        dataset_task(path, checker="nowhere_to_be_found:verify")


# --- the shipped dataset, end to end -------------------------------------------------------------


def test_the_shipped_word_problems_are_what_their_script_writes(tmp_path: Path) -> None:
    out = tmp_path / "word_problems.jsonl"
    subprocess.run([sys.executable, str(GENERATOR), "--out", str(out)], check=True)
    assert out.read_bytes() == WORD_PROBLEMS.read_bytes()
    assert WORD_PROBLEMS.stat().st_size < 200_000


@pytest.mark.parametrize("checker", ["exact", "numeric", "math"])
def test_the_dataset_task_prompts_and_scores_through_make_task_or_environment(
        checker: str) -> None:
    task = make_task_or_environment("dataset", {"path": str(WORD_PROBLEMS), "checker": checker})
    assert isinstance(task, DatasetTask)
    for split in ("train", "heldout"):
        problem = task.problem(split, 3)  # type: ignore[arg-type]
        assert problem.question.endswith("Answer with just the number.")
        assert task.reward(problem, problem.answer).solved
        assert task.reward(problem, f"<answer>{problem.answer}</answer>").solved
        assert not task.reward(problem, str(int(problem.answer) + 1)).solved
        assert task.reward(problem, "").total == 0.0
    if checker != "exact":
        assert task.reward(problem, f"So the answer is {problem.answer}.").solved

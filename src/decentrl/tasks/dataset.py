"""The "dataset" task: problems read from local files through the `datasets` library.

`path` is a JSONL/JSON, parquet or CSV file, or a folder written by `save_to_disk` (a Dataset, or
a DatasetDict whose `split` is read, "train" unless set); `format` ("json", "parquet", "csv",
"saved") is inferred from the suffix, or from a folder, when absent. Each row is a problem: its
`prompt_column` the user message, its `answer_column` the reference, its `system_prompt_column`
(optional) a system message. Answers are checked by `checker` (tasks/answers.py: "exact",
"numeric" with `tolerance`, "math", or "module:function"). Nothing is downloaded: the file is
the run owner's and only the coordinator reads it (peers receive token ids).

The held-out split, as for every task, is fixed by a hash of the problem (`split_of` on the prompt
text, so duplicated prompts share a split): the same rows are held out on every machine, whatever
the file's order. A dataset's own test split may be held out instead: `test_split` names a split
of the saved DatasetDict, `test_path` another file or folder. The training rows then leave out
any prompt that is also a test prompt.

`problem(split, index)` walks its split's rows in a fixed shuffled order (seeded by the split and
the pass over the rows, not by the file's order, which may be sorted by difficulty): train indices
go around again in a new order after every pass; a held-out index past the last held-out row is an
error rather than a repeat, so an evaluation never counts one problem twice.
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from decentrl.tasks.answers import DEFAULT_CHECK_TIMEOUT_S, make_checker
from decentrl.tasks.base import (
    Problem,
    Reward,
    Split,
    check_heldout_fraction,
    check_split,
    split_of,
)

log = logging.getLogger(__name__)

SAVED = "saved"  # a folder written by Dataset.save_to_disk or DatasetDict.save_to_disk
FORMAT_OF_SUFFIX = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
FORMATS = ("json", "parquet", "csv", SAVED)
DEFAULT_SPLIT = "train"
# How `datasets` words a file with no rows: 'Instruction "train" corresponds to no data!'.
NO_DATA = "corresponds to no data"
# The rows an error names before it counts the rest.
NAMED_ROWS = 5
# Orders kept per split: an epoch's order is a permutation of every row of the split.
ORDER_CACHE_SIZE = 4


@dataclass(frozen=True)
class Row:
    question: str
    answer: str
    system_prompt: str | None
    row: int  # its position in the table it was read from, counting from 0
    source: Path  # that table's file or folder


def infer_format(path: Path) -> str:
    if path.is_dir():
        return SAVED
    format_ = FORMAT_OF_SUFFIX.get(path.suffix.lower())
    if format_ is None:
        raise ValueError(f"cannot tell the format of dataset {path} from its suffix; set the "
                         f"task option format to one of {', '.join(FORMATS)}")
    return format_


@contextmanager
def quiet_datasets() -> Iterator[None]:
    """No progress bars while a table loads: a run's console is the run's."""
    import datasets

    enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if enabled:
            datasets.enable_progress_bars()


def load_table(path: Path, format_: str | None, split: str | None) -> Any:
    """The `datasets.Dataset` at `path` (`split` of a saved DatasetDict)."""
    # Imported here: `datasets` takes about two seconds, and only this task needs it.
    from datasets import Dataset, DatasetDict, load_from_disk

    if not path.exists():
        raise FileNotFoundError(f"dataset {path} does not exist")
    format_ = format_ or infer_format(path)
    if format_ not in FORMATS:
        raise ValueError(f"unknown dataset format {format_!r}; formats: {', '.join(FORMATS)}")
    if path.is_file() and path.stat().st_size == 0:
        raise ValueError(f"dataset {path} is empty")
    readers = {"json": Dataset.from_json, "parquet": Dataset.from_parquet,
               "csv": Dataset.from_csv, SAVED: load_from_disk}
    try:
        with quiet_datasets():
            table = readers[format_](str(path))
    except Exception as error:  # whatever the reader raises on a malformed file
        if NO_DATA in str(error):  # the builders' word for a file of no rows (a CSV header)
            raise ValueError(f"dataset {path} has no rows") from error
        raise ValueError(f"cannot read dataset {path} as {format_}: {type(error).__name__}: "
                         f"{error}") from error
    if isinstance(table, DatasetDict):
        chosen = split or DEFAULT_SPLIT
        if chosen not in table:
            raise ValueError(f"dataset {path} has no split {chosen!r}; its splits: "
                             f"{', '.join(table)}")
        return table[chosen]
    if split is not None:
        raise ValueError(f"dataset {path} has no splits (it is not a saved DatasetDict), so the "
                         f"split {split!r} cannot be read from it")
    return table


def named_rows(rows: list[int]) -> str:
    shown = ", ".join(map(str, rows[:NAMED_ROWS]))
    return shown + (f" and {len(rows) - NAMED_ROWS} more" if len(rows) > NAMED_ROWS else "")


def read_rows(table: Any, path: Path, prompt_column: str, answer_column: str,
              system_prompt_column: str | None) -> list[Row]:
    columns = [prompt_column, answer_column] + ([system_prompt_column]
                                                if system_prompt_column is not None else [])
    missing = [column for column in columns if column not in table.column_names]
    if missing:
        raise ValueError(f"dataset {path} has no column {', '.join(map(repr, missing))}; its "
                         f"columns: {', '.join(map(repr, table.column_names))}")
    if table.num_rows == 0:
        raise ValueError(f"dataset {path} has no rows")
    questions, answers = list(table[prompt_column]), list(table[answer_column])
    systems = (list(table[system_prompt_column]) if system_prompt_column is not None
               else [None] * len(questions))
    bad_questions = [i for i, q in enumerate(questions) if not isinstance(q, str) or not q.strip()]
    if bad_questions:
        raise ValueError(f"dataset {path}: the prompt column {prompt_column!r} is empty or not "
                         f"text in rows {named_rows(bad_questions)} (counting from 0)")
    empty_answers = [i for i, a in enumerate(answers) if a is None or not str(a).strip()]
    if empty_answers:
        raise ValueError(f"dataset {path}: the answer column {answer_column!r} is empty in rows "
                         f"{named_rows(empty_answers)} (counting from 0)")
    bad_systems = [i for i, s in enumerate(systems) if s is not None and not isinstance(s, str)]
    if bad_systems:
        raise ValueError(f"dataset {path}: the system prompt column {system_prompt_column!r} is "
                         f"not text in rows {named_rows(bad_systems)} (counting from 0)")
    return [Row(question=q, answer=str(a).strip(), system_prompt=s or None, row=i, source=path)
            for i, (q, a, s) in enumerate(zip(questions, answers, systems))]


class DatasetTask:
    name = "dataset"

    def __init__(
        self,
        path: str,
        format: str | None = None,
        prompt_column: str = "question",
        answer_column: str = "answer",
        system_prompt_column: str | None = None,
        split: str | None = None,
        test_split: str | None = None,
        test_path: str | None = None,
        checker: str = "exact",
        tolerance: float | None = None,
        check_timeout_s: float = DEFAULT_CHECK_TIMEOUT_S,
        heldout_fraction: float = 0.1,
    ) -> None:
        check_heldout_fraction(heldout_fraction)
        self.path = Path(path)
        self.heldout_fraction = heldout_fraction
        self.checker = make_checker(checker, tolerance, check_timeout_s)
        columns = (prompt_column, answer_column, system_prompt_column)
        rows = read_rows(load_table(self.path, format, split), self.path, *columns)
        if test_split is None and test_path is None:
            self.rows = self._split_by_hash(rows)
        else:
            test_source = self.path if test_path is None else Path(test_path)
            test_format = format if test_path is None else None
            test_rows = read_rows(load_table(test_source, test_format, test_split), test_source,
                                  *columns)
            self.rows = {"train": self._without_test_prompts(rows, test_rows),
                         "heldout": test_rows}
        for split_rows in self.rows.values():
            for row in split_rows:
                try:
                    self.checker.check_reference(row.answer)
                except ValueError as error:
                    raise ValueError(f"dataset {row.source}, row {row.row} (counting from 0): "
                                     f"checker {checker!r} cannot use its answer: {error}") from None
        self._order = functools.lru_cache(maxsize=ORDER_CACHE_SIZE)(self._shuffled)

    def _split_by_hash(self, rows: list[Row]) -> dict[str, list[Row]]:
        by_split: dict[str, list[Row]] = {"train": [], "heldout": []}
        for row in rows:
            by_split[split_of(row.question, self.heldout_fraction)].append(row)
        for split_name, split_rows in by_split.items():
            if not split_rows:
                raise ValueError(f"no problem of dataset {self.path} ({len(rows)} rows) falls in "
                                 f"the {split_name} split with heldout_fraction="
                                 f"{self.heldout_fraction}; use more rows or another fraction")
        return by_split

    def _without_test_prompts(self, rows: list[Row], test_rows: list[Row]) -> list[Row]:
        test_prompts = {row.question for row in test_rows}
        kept = [row for row in rows if row.question not in test_prompts]
        if len(kept) < len(rows):
            log.info("dataset %s: %d training rows left out, their prompts are test prompts",
                     self.path, len(rows) - len(kept))
        if not kept:
            raise ValueError(f"every training row of dataset {self.path} is also a test row")
        return kept

    def _shuffled(self, split: Split, epoch: int) -> list[int]:
        order = list(range(len(self.rows[split])))
        # A string seed is hashed with SHA-512, the same in every process (unlike hash()).
        random.Random(f"{self.name}:{split}:{epoch}").shuffle(order)
        return order

    def problem(self, split: Split, index: int) -> Problem:
        check_split(split, index)
        rows = self.rows[split]
        if split == "heldout" and index >= len(rows):
            raise ValueError(f"dataset {self.path} has {len(rows)} held-out problems, so there is "
                             f"no held-out problem {index}: evaluate at most {len(rows)} "
                             "(eval.problems)")
        epoch, position = divmod(index, len(rows))
        row = rows[self._order(split, epoch)[position]]
        return Problem(task=self.name, index=index, question=row.question, answer=row.answer,
                       key=row.question, metadata={"row": row.row, "system": row.system_prompt})

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        system = problem.metadata.get("system")
        return ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": problem.question}]

    def extract_answer(self, completion: str) -> str | None:
        return self.checker.extract(completion)

    def reward(self, problem: Problem, completion: str) -> Reward:
        if problem.task != self.name:
            raise ValueError(f"task {self.name!r} cannot score a problem of task {problem.task!r}")
        # No format bonus: "an answer was found" pays a bare wrong number (examples/demo.toml).
        return Reward(correct=self.checker.score(completion, problem.answer), format=0.0)

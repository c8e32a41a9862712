"""Progress bars for long work (model conversion, evaluation, training). On a terminal they are
rich bars that vanish when done; on a pipe or a file they draw nothing (the work's own log lines
say what happened there)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class ProgressUpdate(Protocol):
    def __call__(self, completed: float, total: float | None = None,
                 description: str | None = None) -> None: ...


@contextmanager
def progress_bar(console: Console, description: str, total: float | None,
                 counted: bool = True) -> Iterator[ProgressUpdate]:
    """A bar for `total` units of work (None: unknown yet, a pulsing bar); yields
    `update(completed, total=None, description=None)`, where None keeps what was there.
    `counted=False` leaves out the "done/total" column (for a bar over seconds)."""
    columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
               *([MofNCompleteColumn()] if counted else []), TimeElapsedColumn(),
               TimeRemainingColumn()]
    with Progress(*columns, console=console, transient=True,
                  disable=not console.is_terminal) as progress:
        task = progress.add_task(description, total=total)

        def update(completed: float, total: float | None = None,
                   description: str | None = None) -> None:
            progress.update(task, completed=completed, total=total, description=description)

        yield update

"""Rich progress bars for long work: planning, checkpoint loading, benchmarks.

Bars are drawn on stderr so that a command's stdout (tables, JSON) stays
clean; when stderr is not a terminal, rich prints the finished bar once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)


class ProgressTask:
    """One bar: `advance` moves it, `describe` changes its label.

    A task made with `enabled=False` does nothing, so callers need no
    branches.
    """

    def __init__(self, progress: Progress | None = None, task_id=None):
        self._progress = progress
        self._task_id = task_id

    def advance(self, amount: float = 1.0) -> None:
        """Add `amount` to the completed work."""
        if self._progress is not None:
            self._progress.advance(self._task_id, amount)

    def describe(self, description: str) -> None:
        """Replace the label shown before the bar."""
        if self._progress is not None:
            self._progress.update(self._task_id, description=description)

    def print(self, text: str) -> None:
        """Print a line above the bar (plain text, no rich markup)."""
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False)
        else:
            print(text)


@contextlib.contextmanager
def progress_bar(
    description: str, total: float | None, enabled: bool = True
) -> Iterator[ProgressTask]:
    """A progress bar on stderr for the duration of a `with` block.

    Args:
        description: Label shown before the bar.
        total: Units of work (`None`: unknown, a spinner only).
        enabled: `False` gives a task whose methods do nothing.

    Returns:
        A context manager yielding a `ProgressTask`.

    Example:

    ```python
    with progress_bar("loading", total=len(variables)) as task:
        for variable in variables:
            load(variable)
            task.advance()
    ```
    """
    if not enabled:
        yield ProgressTask()
        return
    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
    )
    with progress:
        yield ProgressTask(progress, progress.add_task(description, total=total))

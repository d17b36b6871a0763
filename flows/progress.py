"""Rich progress bars for long work, shared by threads of one flow (quiet in Ray workers)."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class Bars:
    """One bar per unit of work; ``bar(name, total)`` gives a ``callback(done, total)``."""

    def __init__(self, progress: Progress | None):
        self._progress = progress
        self._lock = threading.Lock()

    def bar(self, name: str, total: int | None = None) -> Callable[[int, int], None] | None:
        if self._progress is None:
            return None
        with self._lock:
            task_id = self._progress.add_task(name, total=total)

        def update(done: int, total_: int) -> None:
            self._progress.update(task_id, completed=done, total=total_)

        return update


@contextlib.contextmanager
def progress_bars(enabled: bool = True) -> Iterator[Bars]:
    if not enabled:
        yield Bars(None)
        return
    console = Console(file=sys.stderr)
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=console, transient=not console.is_terminal) as progress:
        yield Bars(progress)

"""What `foldline compile` shows while it works: a bar per stage with its elapsed time.

backends/stage_clock.StageClock calls `start_stage(name, total)` when a stage begins
and `advance(detail)` after each unit of it (an entry point imported, a
target compiled); every other message is printed above the bars. On a
terminal that is not interactive (CI logs, pipes) rich draws no live bars
and the messages come out as plain lines. rich comes with the compiler extra:
only `foldline compile` imports this module.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)


class CompileProgress:
    """A progress callable for backends.build with one rich task per stage."""

    def __init__(self, console: Console | None = None, shown_as: dict[Path, Path] | None = None):
        """shown_as: paths that messages show as other paths (the staging directory a bundle is
        written into, as the output directory it becomes)."""
        self.console = console or Console(stderr=True, highlight=False)
        self.shown_as = {str(k): str(v) for k, v in (shown_as or {}).items()}
        self.bars = Progress(SpinnerColumn(), TextColumn("{task.description:<13}"), BarColumn(),
                             MofNCompleteColumn(), TextColumn("{task.fields[detail]}"), TimeElapsedColumn(),
                             console=self.console, transient=False)
        self._task = None

    def __enter__(self) -> CompileProgress:
        return self  # the bars start with the first stage: a cache hit or an early error draws none

    def __exit__(self, *exc) -> None:
        self._finish_task()
        if self.bars.live.is_started:
            self.bars.stop()

    def __call__(self, message: str) -> None:
        for path, shown in self.shown_as.items():
            message = message.replace(path, shown)
        self.bars.console.print(message, markup=False, soft_wrap=True)

    def start_stage(self, name: str, total: int | None) -> None:
        self._finish_task()
        if not self.bars.live.is_started:
            self.bars.start()
        self._task = self.bars.add_task(name, total=total, detail="")

    def advance(self, detail: str) -> None:
        if self._task is not None:
            self.bars.update(self._task, advance=1, detail=detail)

    def _finish_task(self) -> None:
        if self._task is not None:
            task = self.bars.tasks[self._task]
            self.bars.update(self._task, total=task.completed or 1, completed=task.completed or 1)
            self.bars.stop_task(self._task)
            self._task = None

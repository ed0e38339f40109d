"""What `foldline bench` shows on stderr while it works: a bar over every engine run of the bench.

The bar goes to stderr, so stdout holds only the tables. rich draws it
(it comes with the compiler extra); without rich, or on a stderr that is no
terminal, each run is one plain line instead.
"""

from __future__ import annotations

import sys
from typing import Any


class BenchProgress:
    """A context manager: `start(total)` once, then `step(description)` before each engine run."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._bar: Any = None
        self._task: Any = None
        self._steps = 0

    def __enter__(self) -> BenchProgress:
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def start(self, total: int) -> None:
        if not self.enabled or not sys.stderr.isatty():
            return
        try:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )
        except ModuleNotFoundError:
            return
        self._bar = Progress(TextColumn("bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                             TextColumn("{task.description}"), console=Console(stderr=True), transient=True)
        self._bar.start()
        self._task = self._bar.add_task("", total=total)

    def step(self, description: str) -> None:
        """Marks the start of one engine run (the previous one, if any, is done)."""
        if not self.enabled:
            return
        if self._bar is None:
            print(description, file=sys.stderr, flush=True)
            return
        self._bar.update(self._task, completed=self._steps, description=description)
        self._steps += 1

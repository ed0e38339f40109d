"""The compile's stage timer: how long each stage and step took, and where the progress display is."""

from __future__ import annotations

import time

from .options import Progress


class StageClock:
    """Times the stages of a compile and tells the progress display where it is.

    `progress` is called with each message; a display that also has
    `start_stage(name, total)` and `advance(detail)` (tools/compile_progress.py)
    draws a bar per stage from them.
    """

    def __init__(self, progress: Progress):
        self.progress = progress
        self.times: dict[str, float] = {}
        self.steps: dict[str, dict[str, float]] = {}  # stage -> step (entry point, module) -> seconds
        self._current: str | None = None
        self._since = self._last_step = time.perf_counter()

    def stage(self, name: str, message: str, total: int | None = None) -> None:
        self._close()
        self._current, self._since = name, time.perf_counter()
        self._last_step = self._since
        self.progress(message)
        start = getattr(self.progress, "start_stage", None)
        if start is not None:
            start(name, total)

    def advance(self, detail: str, seconds: float | None = None) -> None:
        """A step of the current stage is done: `seconds` it took (default: since the previous step)."""
        now = time.perf_counter()
        if self._current is not None:
            took = now - self._last_step if seconds is None else seconds
            self.steps.setdefault(self._current, {})[detail] = took
        self._last_step = now
        step = getattr(self.progress, "advance", None)
        if step is not None:
            step(detail)

    def _close(self) -> None:
        if self._current is not None:
            self.times[self._current] = self.times.get(self._current, 0.0) + time.perf_counter() - self._since
            self._current = None

    def summary(self) -> str:
        """One line, `stage times: export N s [prefill N, decode N], passes N s, ... (total N s)`."""
        self._close()
        total = sum(self.times.values())

        def stage(name: str, seconds: float) -> str:
            steps = self.steps.get(name, {})
            detail = f" [{', '.join(f'{s} {t:.1f}' for s, t in steps.items())}]" if len(steps) > 1 else ""
            return f"{name} {seconds:.1f} s{detail}"

        return "stage times: " + ", ".join(stage(n, t) for n, t in self.times.items()) + f" (total {total:.1f} s)"

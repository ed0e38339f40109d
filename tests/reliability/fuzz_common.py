"""The fuzz harness: run a loader on a damaged input, accept success or a FoldlineError, time-box it.

Anything else (a raw KeyError / IndexError / struct.error, a MemoryError from
believing a header, a call that does not return) is a failure and is kept
with the case that caused it.
"""

from __future__ import annotations

import signal
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from foldline.errors import FoldlineError

from reliability.reliability_common import address_space_headroom, record


class CaseTimeout(BaseException):
    """Raised by the alarm in a case that ran past its time: a hang as far as the fuzz is concerned."""


@dataclass
class FuzzLog:
    """Outcome counts of one fuzzed format, and the cases that did not end in a clear error."""

    fmt: str
    expected: type[FoldlineError] = FoldlineError  # the error class the interface promises
    ok: int = 0
    clear_errors: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def cases(self) -> int:
        return self.ok + self.clear_errors + len(self.failures)

    def run(self, what: str, fn: Callable[[], object], seconds: float = 30.0) -> object:
        """Run one case: success and FoldlineError are fine, anything else is recorded as a failure."""

        def on_alarm(_signum, _frame):
            raise CaseTimeout(f"{what}: no answer after {seconds} s")

        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            with address_space_headroom():
                result = fn()
            self.ok += 1
            return result
        except FoldlineError as e:
            if not isinstance(e, self.expected):
                self.failures.append(f"{what}: {type(e).__name__} where {self.expected.__name__} belongs: {e}")
            elif not str(e).strip():
                self.failures.append(f"{what}: {type(e).__name__} with an empty message")
            else:
                self.clear_errors += 1
        except (Exception, CaseTimeout) as e:  # everything that is not a FoldlineError is a finding
            tb = traceback.format_exception(type(e), e, e.__traceback__)
            self.failures.append(f"{what}: {type(e).__name__}: {e}\n{''.join(tb[-3:])}")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        return None

    def finish(self) -> None:
        """Record the counts and fail with every case that did not end in a clear error."""
        record(f"fuzz {self.fmt}: cases", self.cases)
        record(f"fuzz {self.fmt}: loaded", self.ok)
        record(f"fuzz {self.fmt}: clear errors", self.clear_errors)
        print(f"fuzz {self.fmt}: {self.cases} cases, {self.ok} loaded, {self.clear_errors} clear errors, "
              f"{len(self.failures)} failures")
        assert not self.failures, f"{len(self.failures)} of {self.cases} {self.fmt} cases:\n" + "\n".join(
            self.failures[:40])

"""Reliability suite settings: a quick deterministic slice by default, the full run on request.

The quick slice runs in CI, so its hypothesis profile is derandomized (the
same examples every run: CI cannot flake). FOLDLINE_RELIABILITY=full loads a
profile that draws fresh random examples each run and prints the blob that
replays a failure (`@reproduce_failure`); counts come from
`reliability_common.scaled`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from reliability.reliability_common import COUNTS, FULL

_COMMON = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("reliability-quick", derandomize=True, database=None, **_COMMON)
settings.register_profile("reliability-full", derandomize=False, database=None, **_COMMON)
settings.load_profile("reliability-full" if FULL else "reliability-quick")


def pytest_terminal_summary(terminalreporter) -> None:
    """Print the cases tried per property and per fuzzed format."""
    if COUNTS:
        terminalreporter.section(f"reliability counts ({'full' if FULL else 'quick'} run)")
        for name, n in sorted(COUNTS.items()):
            terminalreporter.write_line(f"{name}: {n}")


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Eager runs of tiny graphs are dominated by thread hand-offs on a shared 2-core machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

"""The order a bench runs its engines in: every engine at every prompt length and thread count, in rounds.

Each round runs the engines in a shuffled order (seeded, so a run can be
repeated; never the previous round's order), so no engine always runs first
on a cold host or right after a heavy peer. An engine that is not installed
is reported once and dropped.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .child import PeerUnavailable
from .progress import BenchProgress

# An engine's run: (prompt length, threads) -> its figures, in a child process of its own.
Runner = Callable[[int, int], dict[str, Any]]


def round_orders(names: list[str], rounds: int, seed: int) -> list[list[str]]:
    """Each round's order of the engines: a seeded shuffle, never the same as the round before."""
    rng = random.Random(seed)
    orders: list[list[str]] = []
    for _ in range(rounds):
        order = list(names)
        rng.shuffle(order)
        if orders and order == orders[-1] and len(order) > 1:
            order = order[1:] + order[:1]
        orders.append(order)
    return orders


@dataclass
class RoundResults:
    """Every run's figures by (engine, prompt length, threads), one entry per round in the order run."""

    names: list[str]  # the engines as the run named them, foldline first
    orders: list[list[str]]
    runs: dict[tuple[str, int, int], list[dict[str, Any]]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def engines(self) -> list[str]:
        """The engines that ran, in the order the run named them."""
        return [n for n in self.names if any(k[0] == n for k in self.runs)]


def run_rounds(runners: dict[str, Runner], lengths: list[int], threads: list[int], rounds: int, seed: int,
               progress: BenchProgress) -> RoundResults:
    """`rounds` rounds; in each, every prompt length and thread count with the engines in that round's order."""
    names = list(runners)
    results = RoundResults(names, round_orders(names, rounds, seed))
    progress.start(rounds * len(lengths) * len(threads) * len(names))
    for r, order in enumerate(results.orders):
        for length in lengths:
            for count in threads:
                for name in order:
                    progress.step(f"round {r + 1}/{rounds}, prompt {length}, {count} threads: {name}")
                    if name in results.skipped:
                        continue
                    try:
                        figures = runners[name](length, count)
                    except PeerUnavailable as e:
                        results.skipped[name] = str(e)
                        continue
                    results.runs.setdefault((name, length, count), []).append(figures)
    return results

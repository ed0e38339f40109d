"""`foldline bench --plot FILE`: tok/s against prompt length or tokens held, one line per engine.

Each point is the median over rounds, its error bar the rounds' min-max.
matplotlib is an optional extra (`foldline[plot]`): only this module
imports it, and only when `--plot` is given.
"""

from __future__ import annotations

from typing import Any

# (figure key, panel title) of each panel
_THROUGHPUT = (("prefill_tok_s", "prefill"), ("decode_tok_s", "decode"))


def _panel(ax: Any, by_x: dict[int, dict[str, dict[str, Any]]], key: str, xlabel: str, title: str) -> None:
    names = list(dict.fromkeys(n for engines in by_x.values() for n in engines))
    for name in names:
        xs = [x for x, engines in by_x.items() if name in engines]
        medians = [by_x[x][name][key] for x in xs]
        rounds = [[r[key] for r in by_x[x][name]["rounds"]] for x in xs]
        below = [m - min(rs) for m, rs in zip(medians, rounds)]
        above = [max(rs) - m for m, rs in zip(medians, rounds)]
        ax.errorbar(xs, medians, yerr=[below, above], marker="o", capsize=3, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("tok/s")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()


def _save(path: str, fig: Any) -> None:
    fig.tight_layout()
    fig.savefig(path)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(path: str, model: str, by_length: dict[int, dict[str, dict[str, Any]]]) -> None:
    """Prefill and decode tok/s against prompt length (error bars: min-max over rounds)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, (key, what) in zip(axes, _THROUGHPUT):
        _panel(ax, by_length, key, "prompt tokens", f"{model}: {what}")
        if max(by_length) / min(by_length) > 20:  # e.g. 16 to 1000 tokens: short prompts stay readable
            ax.set_xscale("log")
    _save(path, fig)
    plt.close(fig)


def plot_held(path: str, model: str, by_held: dict[int, dict[str, dict[str, Any]]]) -> None:
    """Decode tok/s against tokens held (error bars: min-max over rounds)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    _panel(ax, by_held, "decode_tok_s", "tokens held", f"{model}: decode")
    _save(path, fig)
    plt.close(fig)

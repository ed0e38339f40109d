"""What `foldline bench` prints: the engines side by side, rounds combined into medians, and ratios."""

from __future__ import annotations

from typing import Any

import numpy as np

ROWS = (
    ("prefill tok/s ({prompt_len} tokens)", "prefill_tok_s", "{:.1f}"),
    ("decode tok/s ({new_tokens} tokens)", "decode_tok_s", "{:.1f}"),
    ("prefill CPU ms/token", "prefill_cpu_ms_tok", "{:.1f}"),
    ("decode CPU ms/token", "decode_cpu_ms_tok", "{:.1f}"),
    ("peak RSS (MiB)", "peak_rss_mib", "{:.0f}"),
    ("load (s)", "load_s", "{:.1f}"),
)


def spread(values: list[float]) -> str:
    """`(min-max)` of a ratio over rounds; empty for one round."""
    return f" ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else ""


def ratio_cell(first: dict[str, Any], other: dict[str, Any], key: str) -> str:
    """first / other for `key`: the ratio of the medians, then its spread over the rounds."""
    if not other.get(key):
        return "-"
    return f"{first[key] / other[key]:.2f}x" + spread(round_ratios({"a": first, "b": other}, key)["b"])


def format_table(engines: dict[str, dict[str, Any]], prompt_len: int, new_tokens: int) -> str:
    """One column per engine (the first is foldline), then foldline / engine for each other one, with the
    ratio's spread over the rounds."""
    names = list(engines)
    first, others = names[0], names[1:]
    table = [["", *names, *[f"{first} / {o}" for o in others]]]
    for label, key, fmt in ROWS:
        line = [label.format(prompt_len=prompt_len, new_tokens=new_tokens)]
        line += [fmt.format(engines[n][key]) for n in names]
        line += [ratio_cell(engines[first], engines[o], key) for o in others]
        table.append(line)
    table.append(["threads", *(str(engines[n].get("threads", "?")) for n in names), *([""] * len(others))])
    if any("cosine_worst" in engines[n] for n in names):
        table += accuracy_rows(engines, len(others))
    return _aligned(table)


def accuracy_rows(engines: dict[str, dict[str, Any]], ratio_columns: int) -> list[list[str]]:
    """The rows of `--accuracy`: each engine's worst and mean cosine to HF eager and its top-1 agreement; `ref`
    for the reference itself, `-` for an engine it does not score."""
    steps = next(f["steps"] for f in engines.values() if "steps" in f)

    def cell(figures: dict[str, Any], text: str) -> str:
        if figures.get("accuracy_reference"):
            return "ref"
        return text if "cosine_worst" in figures else "-"

    rows = [(f"cosine to HF eager, worst of {steps} steps", lambda f: f"{f.get('cosine_worst', 0):.4f}"),
            ("cosine to HF eager, mean", lambda f: f"{f.get('cosine_mean', 0):.4f}"),
            ("top-1 = HF eager", lambda f: f"{f.get('top1_agree')}/{f.get('steps')}")]
    return [[label, *(cell(f, text(f)) for f in engines.values()), *([""] * ratio_columns)] for label, text in rows]


def _aligned(table: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in table)


# Figures that are a rate or a time take the median over rounds; peak RSS takes the largest round.
_MEDIAN_KEYS = ("prefill_tok_s", "decode_tok_s", "prefill_cpu_ms_tok", "decode_cpu_ms_tok", "load_s",
                "prefill_s", "decode_s")
_ROUND_KEYS = (*_MEDIAN_KEYS, "peak_rss_mib")


def combine_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's figures over its rounds: medians of the rates and times, the largest peak RSS.

    Keeps every round's figures (`rounds`) so the spread is on record.
    """
    out = dict(runs[0])
    for key in _MEDIAN_KEYS:
        if all(key in r for r in runs):
            out[key] = float(np.median([r[key] for r in runs]))
    out["peak_rss_mib"] = max(r["peak_rss_mib"] for r in runs)
    out["rounds"] = [{k: r[k] for k in _ROUND_KEYS if k in r} for r in runs]
    return out


def best_of_threads(by_threads: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    """An engine's rounds at its best thread count (fastest median decode, prefill when nothing was
    decoded), combined; `threads_tried` lists the counts it ran at."""
    combined = {t: combine_rounds(rs) for t, rs in by_threads.items() if rs}

    def speed(t: int) -> float:
        c = combined[t]
        return c["decode_tok_s"] if c["decode_tok_s"] == c["decode_tok_s"] else c["prefill_tok_s"]  # nan: none

    best = max(combined, key=speed)
    return {**combined[best], "threads": best, "threads_tried": sorted(combined)}


def round_ratios(engines: dict[str, dict[str, Any]], key: str = "decode_tok_s") -> dict[str, list[float]]:
    """Per other engine, the first engine's figure over its in each round (paired in the order they ran)."""
    names = list(engines)
    first = engines[names[0]]["rounds"]
    return {o: [a[key] / b[key] for a, b in zip(first, engines[o]["rounds"]) if b.get(key)] for o in names[1:]}


def format_orders(orders: list[list[str]]) -> str:
    """Each round's order of the engines, as printed under the tables."""
    return "order by round: " + "; ".join(f"{i + 1}: {' -> '.join(o)}" for i, o in enumerate(orders))


def print_streams(name: str, results: list[dict[str, Any]], prompt_len: int, new_tokens: int) -> None:
    print(f"bench {name}: {new_tokens} greedy tokens per stream after a {prompt_len}-token prompt, "
          f"all streams submitted at once, {results[0]['rows']} rows")
    header = ["streams", "wall s", "aggregate tok/s", "per stream tok/s", "vs 1 stream", "module calls"]
    devices = results[0].get("device_busy") is not None
    if devices:
        header.append("busy cores per device")
    print(" | ".join(header))
    base = next((r["aggregate_tok_s"] for r in results if r["streams"] == 1), None)
    for r in results:
        ratio = f"{r['aggregate_tok_s'] / base:.2f}x" if base else "-"
        line = [str(r["streams"]), f"{r['wall_s']:.2f}", f"{r['aggregate_tok_s']:.1f}",
                f"{r['per_stream_tok_s']:.1f}", ratio, str(r["module_calls"])]
        if devices:
            line.append(", ".join(f"{b:.2f}" for b in r["device_busy"]))
        print(" | ".join(line))


def print_chat(name: str, engines: dict[str, dict[str, Any]], user_tokens: int, reply_tokens: int) -> None:
    """Per turn: each engine's prefilled tokens and median time to the first answer token; totals at the end,
    with their spread over the rounds."""
    names = list(engines)
    rounds = len(engines[names[0]]["rounds"])
    print(f"bench {name}: a {len(engines[names[0]]['turns'])}-turn chat, {user_tokens} new user tokens and "
          f"{reply_tokens} answer tokens per turn; time to the first answer token in ms (prefilled tokens), "
          f"median of {rounds} round(s)")
    print(" | ".join(["turn", "prompt", *names]))
    turns = zip(*(engines[n]["turns"] for n in names))
    for i, cells in enumerate(turns):
        print(" | ".join([str(i + 1), str(cells[0]["prompt"]),
                          *(f"{c['first_token_ms']:.0f} ({c['prefilled']})" for c in cells)]))
    print(" | ".join(["all turns, ms", "", *(f"{engines[n]['total_ms']:.0f}" for n in names)]))
    first = engines[names[0]]
    cells = [f"{engines[n]['total_ms'] / first['total_ms']:.2f}x"
             + spread([b / a for a, b in zip(first["rounds"], engines[n]["rounds"])]) for n in names]
    print(" | ".join([f"time / {names[0]}'s", "", *cells]))


def combine_chat_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One chat engine over its rounds: per turn the median times, the whole chat's median and each round's."""
    out = dict(runs[0])
    out["turns"] = [{**turns[0], "first_token_ms": float(np.median([t["first_token_ms"] for t in turns])),
                     "turn_ms": float(np.median([t["turn_ms"] for t in turns]))}
                    for turns in zip(*(r["turns"] for r in runs))]
    out["rounds"] = [sum(t["turn_ms"] for t in r["turns"]) for r in runs]
    out["total_ms"] = float(np.median(out["rounds"]))
    return out


def print_held(rows: list[tuple[int, dict[str, dict[str, Any]]]]) -> None:
    """One line per tokens-held count: each engine's decode tok/s (its threads), then foldline / engine with
    the spread over the rounds."""
    names = list(rows[0][1])
    first, others = names[0], names[1:]
    table = [["tokens held", *(f"{n} decode tok/s" for n in names), "peak RSS MiB (" + ", ".join(names) + ")",
              *(f"decode {first} / {o}" for o in others)]]
    for held, engines in rows:
        line = [str(held)]
        line += [f"{engines[n]['decode_tok_s']:.1f} ({engines[n]['threads']}t)" if n in engines else "-"
                 for n in names]
        line.append(" / ".join(f"{engines[n]['peak_rss_mib']:.0f}" if n in engines else "-" for n in names))
        line += [ratio_cell(engines[first], engines[o], "decode_tok_s") if o in engines else "-" for o in others]
        table.append(line)
    print(_aligned(table))

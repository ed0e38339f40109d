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


def format_table(engines: dict[str, dict[str, Any]], prompt_len: int, new_tokens: int) -> str:
    """One column per engine (the first is foldline), then foldline / engine for each other one."""
    names = list(engines)
    first, others = names[0], names[1:]
    table = [["", *names, *[f"{first} / {o}" for o in others]]]
    for label, key, fmt in ROWS:
        line = [label.format(prompt_len=prompt_len, new_tokens=new_tokens)]
        line += [fmt.format(engines[n][key]) for n in names]
        line += [f"{engines[first][key] / engines[o][key]:.2f}x" if engines[o][key] else "-" for o in others]
        table.append(line)
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in table)


# Figures that are a rate or a time take the median over rounds; peak RSS takes the largest round.
_MEDIAN_KEYS = ("prefill_tok_s", "decode_tok_s", "prefill_cpu_ms_tok", "decode_cpu_ms_tok", "load_s",
                "prefill_s", "decode_s")


def combine_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's figures over its rounds: medians of the rates and times, the largest peak RSS.

    Keeps every round's decode and prefill rate (`rounds`) so the spread is on record.
    """
    out = dict(runs[0])
    for key in _MEDIAN_KEYS:
        if all(key in r for r in runs):
            out[key] = float(np.median([r[key] for r in runs]))
    out["peak_rss_mib"] = max(r["peak_rss_mib"] for r in runs)
    out["rounds"] = [{"prefill_tok_s": r["prefill_tok_s"], "decode_tok_s": r["decode_tok_s"]} for r in runs]
    return out


def round_ratios(engines: dict[str, dict[str, Any]], key: str = "decode_tok_s") -> dict[str, list[float]]:
    """Per peer, foldline's figure over the peer's in each round (rounds run back to back)."""
    names = list(engines)
    first = engines[names[0]]["rounds"]
    return {o: [a[key] / b[key] for a, b in zip(first, engines[o]["rounds"]) if b[key]] for o in names[1:]}


def print_streams(name: str, results: list[dict[str, Any]], prompt_len: int, new_tokens: int) -> None:
    print(f"bench {name}: {new_tokens} greedy tokens per stream after a {prompt_len}-token prompt, "
          f"all streams submitted at once, {results[0]['rows']} rows")
    header = ["streams", "wall s", "aggregate tok/s", "per stream tok/s", "vs 1 stream", "module calls"]
    print(" | ".join(header))
    base = next((r["aggregate_tok_s"] for r in results if r["streams"] == 1), None)
    for r in results:
        ratio = f"{r['aggregate_tok_s'] / base:.2f}x" if base else "-"
        print(" | ".join([str(r["streams"]), f"{r['wall_s']:.2f}", f"{r['aggregate_tok_s']:.1f}",
                          f"{r['per_stream_tok_s']:.1f}", ratio, str(r["module_calls"])]))


def print_chat(name: str, engines: dict[str, dict[str, Any]], user_tokens: int, reply_tokens: int) -> None:
    """Per turn: each engine's prefilled tokens and time to the first answer token; totals at the end."""
    names = list(engines)
    print(f"bench {name}: a {len(engines[names[0]]['turns'])}-turn chat, {user_tokens} new user tokens and "
          f"{reply_tokens} answer tokens per turn; time to the first answer token in ms (prefilled tokens)")
    print(" | ".join(["turn", "prompt", *names]))
    turns = zip(*(engines[n]["turns"] for n in names))
    for i, cells in enumerate(turns):
        print(" | ".join([str(i + 1), str(cells[0]["prompt"]),
                          *(f"{c['first_token_ms']:.0f} ({c['prefilled']})" for c in cells)]))
    totals = {n: sum(t["turn_ms"] for t in engines[n]["turns"]) for n in names}
    print(" | ".join(["all turns, ms", "", *(f"{totals[n]:.0f}" for n in names)]))
    base = totals[names[0]]
    print(" | ".join([f"time / {names[0]}'s", "", *(f"{totals[n] / base:.2f}x" for n in names)]))


def print_held(rows: list[tuple[int, dict[str, Any], dict[str, Any] | None]]) -> None:
    """One line per tokens-held count: foldline's figures, and llama.cpp's with the decode ratio when it ran."""
    header = ["tokens held", "foldline prefill tok/s", "foldline decode tok/s", "peak RSS (MiB)"]
    if any(p for _, _, p in rows):
        header += ["llama.cpp prefill tok/s", "llama.cpp decode tok/s", "llama.cpp RSS (MiB)", "decode ratio"]
    table = [header]
    for held, ours, peer in rows:
        line = [str(held), f"{ours['prefill_tok_s']:.1f}", f"{ours['decode_tok_s']:.1f}", f"{ours['peak_rss_mib']:.0f}"]
        if peer:
            line += [f"{peer['prefill_tok_s']:.1f}", f"{peer['decode_tok_s']:.1f}", f"{peer['peak_rss_mib']:.0f}",
                     f"{ours['decode_tok_s'] / peer['decode_tok_s']:.2f}x"]
        table.append(line)
    widths = [max(len(r[i]) for r in table if i < len(r)) for i in range(len(header))]
    for r in table:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


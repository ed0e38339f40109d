"""foldline bench BUNDLE [--prompt-len 128] [--new-tokens 128] [--llama-cpp [GGUF]] [--hf [MODEL]]

Prefill and decode throughput and peak memory of a compiled bundle and, side by
side in the same run, of the engines a user would pick instead: llama.cpp and
HF transformers eager on the same checkpoint (`tools/bench_peers.py`), and
optionally foldline's own torch reference module. Each engine runs in its own
child process so its peak RSS is its own (and the runtime's process never
imports torch); all are timed by the same loop (`tools/bench_timer.py`).

`--rounds N` runs the engines in turn N times (foldline, then each peer, then
foldline again...) and reports each figure's median: on a shared 2-core host
one 128-token decode moves by 10-20% between runs of the same engine, so a
single pair of runs can rank two engines either way; alternating rounds meet
the same host load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

from .bench_timer import peak_rss_mib, time_engine
from .cli import CliError


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure prefill/decode tokens/s and peak memory of a bundle (and torch eager)")
    p.add_argument("bundle", help="bundle directory")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens to prefill (default 128)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens to decode after the prompt (default 128)")
    p.add_argument("--llama-cpp", nargs="?", const="auto", default=None, metavar="GGUF",
                   help="also time llama.cpp (llama-cpp-python) on GGUF (default: the GGUF the bundle came from)")
    p.add_argument("--llama-python", default=None, metavar="PYTHON",
                   help="interpreter that has llama-cpp-python (default: this one)")
    p.add_argument("--hf", nargs="?", const="auto", default=None, metavar="MODEL",
                   help="also time HF transformers eager on MODEL, a .gguf or HF directory "
                        "(default: the GGUF the bundle came from)")
    p.add_argument("--eager", default=None, metavar="MODEL",
                   help="also time foldline's own torch reference module on MODEL (what compiling buys; not a peer)")
    p.add_argument("--rounds", type=int, default=3,
                   help="run the engines in turn this many times and report medians (default 3)")
    p.add_argument("--threads", type=int, default=None,
                   help="threads for foldline and every peer alike (default: all cores)")
    p.add_argument("--cpu", default=None, metavar="NAME",
                   help="bench the CPU module compiled for NAME (e.g. x86-64-v3: the AVX2 kernels on any "
                        "x86 host with AVX2), beside a llama.cpp built for the same ISA (--llama-python)")
    p.add_argument("--peer-context", type=int, default=None, metavar="N",
                   help="llama.cpp's context (KV capacity; default: the bundle's max_context, so both hold "
                        "caches of the same size)")
    p.add_argument("--held", default=None, metavar="N,N,...",
                   help="instead: decode tok/s with N tokens already held, for each N (e.g. 128,1024,4096,8192): "
                        "prefill N tokens, then decode --new-tokens (default 32 here)")
    p.add_argument("--streams", default=None, metavar="N,N,...",
                   help="instead: aggregate decode tok/s with N concurrent streams through the serving scheduler "
                        "(a bundle compiled with --batch; e.g. 1,4,8; prompt 32 and 64 new tokens unless given)")
    p.add_argument("--device", default="cpu", choices=["cpu", "vulkan", "cuda"])
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt ids")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--hadamard-online", default=None, metavar="BUNDLE",
                   help="the same model compiled with --hadamard online: report the rotation's cost per decode step")
    p.set_defaults(func=run)


def prompt_ids(vocab: int, n: int, seed: int) -> list[int]:
    # Skip the low ids where vocabularies keep their control tokens.
    return np.random.default_rng(seed).integers(min(1000, vocab // 2), vocab, size=n).tolist()


def bench_compiled(bundle: str, device: str, prompt_len: int, new_tokens: int, seed: int,
                   threads: int | None = None, cpu: str | None = None) -> dict[str, Any]:
    """Runs in the child process: the embedded runtime only, on `threads` threads (None: IREE's default),
    the CPU module compiled for `cpu` (None: the best one this CPU runs)."""
    from ..runtime import Model

    t0 = time.perf_counter()
    model = Model.load(bundle, device=device, verify=False,
                       **({"threads": threads, "cpu": cpu} if device == "cpu" else {}))
    load_s = time.perf_counter() - t0
    ids = prompt_ids(model.vocab_size, prompt_len, seed)
    session = model.session()  # first calls allocate and page in the weights
    session.prefill(ids[: model.chunk])
    session.decode(ids[0])
    session.reset()  # the same buffers, zeroed: one session's state at the peak, as an app holds
    out = time_engine(session.prefill, session.decode, ids, new_tokens)
    out.update(load_s=load_s, peak_rss_mib=peak_rss_mib(), chunk=model.chunk, max_context=model.max_context,
               threads=threads or os.cpu_count(), module=model.module_key)
    return out


def bench_eager(spec: str, max_context: int, chunk: int, prompt_len: int, new_tokens: int, seed: int) -> dict[str, Any]:
    """Runs in the child process: the torch reference module, chunked like the runtime."""
    import torch

    from ..frontend.sources import load_model
    from ..testing.parity import EagerRunner

    t0 = time.perf_counter()
    loaded = load_model(spec, max_context=max_context)
    load_s = time.perf_counter() - t0
    ids = prompt_ids(loaded.config.vocab_size, prompt_len, seed)
    warm = EagerRunner(loaded.module, chunk)
    warm.prefill(ids[:chunk])
    warm.decode(ids[0])
    runner = EagerRunner(loaded.module, chunk)
    out = time_engine(runner.prefill, runner.decode, ids, new_tokens)
    out.update(load_s=load_s, peak_rss_mib=peak_rss_mib(), threads=torch.get_num_threads())
    return out


def _child(kind: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    code = (
        "import json, sys\n"
        "from foldline.tools import bench_cmd\n"
        f"out = bench_cmd.bench_{kind}(**json.loads(sys.argv[1]))\n"
        "print('BENCH ' + json.dumps(out))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(kwargs)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} benchmark failed:\n{proc.stderr.strip()[-2000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH "))
    return json.loads(line[len("BENCH ") :])


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


def _source_model(manifest, given: str) -> str:
    """The checkpoint a peer should load: the one given, else the GGUF the bundle was compiled from."""
    if given != "auto":
        return given
    source = (manifest.config.get("extra") or {}).get("gguf")
    if not source:
        raise CliError("the bundle records no source GGUF; name the model file for the peer explicitly")
    return source


def run(args) -> int:
    from ..runtime.bundle import Manifest
    from .bench_peers import PeerUnavailable, bench_hf_eager, bench_llama_cpp

    manifest = Manifest.load(args.bundle)
    if args.held is not None:
        return run_held(args, manifest)
    if args.streams is not None:
        return run_streams(args, manifest)
    if args.prompt_len < 1 or args.new_tokens < 0:
        raise CliError("--prompt-len must be >= 1 and --new-tokens >= 0")
    if args.prompt_len + args.new_tokens > manifest.max_context:
        raise CliError(
            f"--prompt-len {args.prompt_len} + --new-tokens {args.new_tokens} exceeds the bundle's "
            f"max_context {manifest.max_context}"
        )
    common = {"prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "seed": args.seed}
    ids = prompt_ids(manifest.vocab_size, args.prompt_len, args.seed)
    threads = args.threads or os.cpu_count() or 1
    if args.rounds < 1:
        raise CliError("--rounds must be >= 1")
    ours = {"bundle": str(args.bundle), "device": args.device, "threads": threads, "cpu": args.cpu, **common}
    label = f"foldline ({args.device}{', ' + args.cpu if args.cpu else ''})"
    runners = {label: lambda: _child("compiled", ours)}
    if args.llama_cpp:
        gguf = _source_model(manifest, args.llama_cpp)
        runners["llama.cpp"] = lambda: bench_llama_cpp(gguf, ids, args.new_tokens, threads, python=args.llama_python,
                                                       n_ctx=args.peer_context or manifest.max_context)
    if args.hf:
        hf_model = _source_model(manifest, args.hf)
        runners["HF eager"] = lambda: bench_hf_eager(hf_model, ids, args.new_tokens, threads)
    if args.eager:
        runners["reference eager"] = lambda: _child("eager", {"spec": args.eager, "max_context": manifest.max_context,
                                                             "chunk": manifest.prefill_chunk, **common})
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in runners}
    skipped: dict[str, str] = {}
    for r in range(args.rounds):
        for name, runner in runners.items():
            if name in skipped:
                continue
            print(f"round {r + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
            try:
                runs[name].append(runner())
            except PeerUnavailable as e:
                skipped[name] = str(e)
    engines = {name: combine_rounds(rs) for name, rs in runs.items() if rs}
    name = manifest.config.get("name", args.bundle)
    print(f"bench {name}: prompt {args.prompt_len} tokens (foldline in chunks of {manifest.prefill_chunk}), "
          f"{args.new_tokens} greedy decoded tokens, {threads} threads, load average "
          f"{os.getloadavg()[0]:.1f}, median of {args.rounds} alternating round(s)")
    print(format_table(engines, args.prompt_len, args.new_tokens))
    if args.rounds > 1:
        for peer, ratios in round_ratios(engines).items():
            print(f"decode ratio to {peer} by round: {', '.join(f'{x:.2f}x' for x in ratios)}")
    for line in skipped.values():
        print(f"skipped {line}")
    compiled = next(iter(engines.values()))
    print(f"foldline: module {compiled.get('module', '?')}, {compiled.get('threads')} threads")
    if "llama.cpp" in engines:
        settings = engines["llama.cpp"].get("settings") or {}
        print("llama.cpp " + engines["llama.cpp"].get("version", "") + ": "
              + ", ".join(f"{k}={v}" for k, v in settings.items()))
    if args.hadamard_online:
        online = _child("compiled", {**ours, "bundle": str(args.hadamard_online), "cpu": None})
        fold_ms, online_ms = (1000 * r["decode_s"] / max(args.new_tokens, 1) for r in (compiled, online))
        print(f"online Hadamard rotation: {online_ms - fold_ms:+.3f} ms per decode step "
              f"(online {online_ms:.3f} ms vs this bundle {fold_ms:.3f} ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bundle": str(args.bundle), "model": name, **common, "threads": threads,
                       "rounds": args.rounds, "engines": engines}, f, indent=2)
    return 0


def _parse_held(text: str, max_context: int, new_tokens: int) -> list[int]:
    try:
        held = [int(t) for t in text.split(",") if t.strip()]
    except ValueError as e:
        raise CliError(f"--held takes comma-separated token counts, got {text!r}") from e
    if not held or any(n < 1 or n > max_context for n in held):
        raise CliError(f"--held values must be between 1 and the bundle's max_context {max_context}")
    if new_tokens < 1 or new_tokens >= max_context:
        raise CliError(f"--new-tokens must be between 1 and max_context {max_context} with --held")
    return held


def run_streams(args, manifest) -> int:
    """Concurrent streams on the rows of a batched bundle (tools/bench_streams.py)."""
    from .bench_streams import bench_streams, parse_streams, print_streams

    streams = parse_streams(args.streams, manifest.batch)
    prompt_len = args.prompt_len if args.prompt_len != 128 else 32
    new_tokens = args.new_tokens if args.new_tokens != 128 else 64
    results = bench_streams(str(args.bundle), args.device, streams, prompt_len, new_tokens, args.seed)
    print_streams(manifest.config.get("name", args.bundle), results, prompt_len, new_tokens)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"streams": results}, f, indent=2)
    return 0


def run_held(args, manifest) -> int:
    """Decode speed as a function of the tokens held, foldline beside llama.cpp at the same positions."""
    from .bench_peers import PeerUnavailable, bench_llama_cpp

    new_tokens = args.new_tokens if args.new_tokens != 128 else 32
    held_list = _parse_held(args.held, manifest.max_context, new_tokens)
    threads = args.threads or os.cpu_count() or 1
    rows, skipped = [], None
    for held in held_list:
        prompt_len = min(held, manifest.max_context - new_tokens)  # the last decode must still fit
        ids = prompt_ids(manifest.vocab_size, prompt_len, args.seed)
        ours = _child("compiled", {"bundle": str(args.bundle), "device": args.device, "prompt_len": prompt_len,
                                   "new_tokens": new_tokens, "seed": args.seed, "threads": threads, "cpu": args.cpu})
        peer = None
        if args.llama_cpp and skipped is None:
            try:
                peer = bench_llama_cpp(_source_model(manifest, args.llama_cpp), ids, new_tokens, threads,
                                       python=args.llama_python, n_ctx=args.peer_context or manifest.max_context)
            except PeerUnavailable as e:
                skipped = str(e)
        rows.append((prompt_len, ours, peer))
    name = manifest.config.get("name", args.bundle)
    print(f"bench {name}: decode {new_tokens} greedy tokens after N tokens held (max_context "
          f"{manifest.max_context}), {threads} threads, load average {os.getloadavg()[0]:.1f}")
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
    if skipped:
        print(f"skipped {skipped}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bundle": str(args.bundle), "model": name, "new_tokens": new_tokens, "threads": threads,
                       "held": [{"held": h, "foldline": o, "llama.cpp": p} for h, o, p in rows]}, f, indent=2)
    return 0

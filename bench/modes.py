"""The kinds of `foldline bench` run, one function each; the CLI (tools/bench_cmd.py) parses and calls them.

- throughput: prefill and decode of a prompt (of each length asked), foldline
  beside its peers, at each thread count asked, in rounds of shuffled order
  (bench/rounds.py: on a shared host one 128-token decode moves between runs
  of the same engine by enough that a single pair of runs can rank two
  engines either way, docs/history.md);
- held: decode speed with N tokens already held, the same rounds;
- streams: aggregate decode of N concurrent streams through the scheduler;
- chat: a multi-turn chat, with the prompt cache on and off, in rounds.

Every mode first reads the host's load (bench/host.py) and refuses a busy
host unless `--busy-ok`.
"""

from __future__ import annotations

import json
import os
from argparse import Namespace
from pathlib import Path
from typing import Any

from ..contract.errors import BundleError
from ..contract.manifest import Manifest
from . import accuracy
from .chat import bench_chat_llama_cpp, chat_script, chat_warmup, check_fits
from .child import BenchError, run_foldline
from .engines import prompt_ids
from .host import HostLoad, check_host
from .peers import GENAI_PREFIX, PEER_BUILD_RECORD, bench_hf_eager, bench_llama_cpp, bench_ort_genai
from .progress import BenchProgress
from .rounds import RoundResults, Runner, run_rounds
from .streams import bench_streams, parse_streams
from .tables import (
    best_of_threads,
    combine_chat_rounds,
    format_orders,
    format_table,
    print_chat,
    print_held,
    print_streams,
    ratio_cell,
)

# Each mode's defaults when --prompt-len / --new-tokens are not given. 100 is no multiple of a prefill chunk,
# so foldline's last chunk is padded, as most prompts' are.
DEFAULT_PROMPT_LEN, DEFAULT_NEW_TOKENS = 100, 128


def source_model(manifest: Manifest, given: str) -> str:
    """The checkpoint a peer should load: the one given, else the GGUF the bundle was compiled from."""
    if given != "auto":
        return given
    source = (manifest.config.get("extra") or {}).get("gguf")
    if not source:
        raise BenchError("the bundle records no source GGUF; name the model file for the peer explicitly")
    return source


def _one(values: list[int] | None, option: str, default: int) -> int:
    """A count given once (modes that take no list)."""
    if values is None:
        return default
    if len(values) != 1:
        raise BenchError(f"{option} takes one value in this mode, got {len(values)}")
    return values[0]


def _thread_counts(args: Namespace) -> list[int]:
    return list(dict.fromkeys(args.threads)) if args.threads else [os.cpu_count() or 1]


def _write_json(args: Namespace, payload: dict[str, Any]) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)


def _model_name(manifest: Manifest, args: Namespace) -> str:
    return str(manifest.model_name or args.bundle)


def also_device(manifest: Manifest) -> str:
    """The device another bundle of the same run is benched on: its CPU module, else its only device."""
    devices = manifest.devices()
    return "cpu" if "cpu" in devices else devices[0]


def _compiled_runner(bundle: str, device: str, cpu: str | None, new_tokens: int, seed: int) -> Runner:
    def run(length: int, threads: int) -> dict[str, Any]:
        return run_foldline("engines", "bench_compiled", {
            "bundle": bundle, "device": device, "prompt_len": length, "new_tokens": new_tokens, "seed": seed,
            "threads": threads, "cpu": cpu})
    return run


def genai_labels(folders: list[str] | None) -> dict[str, str]:
    """Each --ort-genai folder's engine name, `ORT GenAI <folder name>`, in the order given."""
    labels: dict[str, str] = {}
    for folder in folders or []:
        label = f"{GENAI_PREFIX}{Path(folder).resolve().name}"
        if label in labels:
            raise BenchError(f"--ort-genai {labels[label]} and {folder} share the folder name "
                             f"{Path(folder).name!r}, which names them in the tables: give them distinct names")
        labels[label] = folder
    return labels


def foldline_label(args: Namespace) -> str:
    return f"foldline ({args.device}{', ' + args.cpu if args.cpu else ''})"


def also_label(bundle: str, device: str, cpu: str | None = None) -> str:
    return f"foldline ({device}{', ' + cpu if cpu else ''}) {Path(bundle).name}"


def also_cpu(bundle: str, other: Manifest, device: str, cpu: str | None) -> str | None:
    """The --cpu module an --also bundle runs: the benched bundle's, so that both run one ISA's code
    (left to the host's choice, a `--cpu x86-64-v3` run would set AVX2 code beside AVX-512 code)."""
    if device != "cpu" or cpu is None:
        return None
    from ..runtime.cpu_select import select_cpu_module

    try:
        select_cpu_module(other, None, "", cpu)  # a pinned module is found by name, whatever the host
    except BundleError as e:
        raise BenchError(f"--also {bundle}: {e}; the bundles of one run must run the same CPU's code") from e
    return cpu


def engine_runners(args: Namespace, manifest: Manifest, new_tokens: int) -> dict[str, Runner]:
    """Every engine the command line asks for, foldline first: (prompt length, threads) -> figures."""
    vocab, seed = manifest.vocab_size, args.seed
    n_ctx = args.peer_context or manifest.max_context
    runners = {foldline_label(args): _compiled_runner(str(args.bundle), args.device, args.cpu, new_tokens, seed)}
    for bundle in args.also or []:
        other = Manifest.load(bundle)
        if other.vocab_size != vocab:
            raise BenchError(f"--also {bundle}: its vocabulary ({other.vocab_size}) is not the benched bundle's")
        device = also_device(other)
        cpu = also_cpu(bundle, other, device, args.cpu)
        runners[also_label(bundle, device, cpu)] = _compiled_runner(str(bundle), device, cpu, new_tokens, seed)
    if args.llama_cpp:
        gguf = source_model(manifest, args.llama_cpp)
        runners["llama.cpp"] = lambda n, t: bench_llama_cpp(gguf, prompt_ids(vocab, n, seed), new_tokens, t,
                                                            python=args.llama_python, n_ctx=n_ctx)
    for label, folder in genai_labels(args.ort_genai).items():
        runners[label] = lambda n, t, d=folder: bench_ort_genai(d, prompt_ids(vocab, n, seed), new_tokens, t,
                                                                python=args.genai_python, n_ctx=n_ctx)
    if args.hf:
        hf_model = source_model(manifest, args.hf)
        runners["HF eager"] = lambda n, t: bench_hf_eager(hf_model, prompt_ids(vocab, n, seed), new_tokens, t)
    if args.eager:
        eager = {"spec": args.eager, "max_context": manifest.max_context, "chunk": manifest.prefill_chunk,
                 "new_tokens": new_tokens, "seed": seed}
        runners["reference eager"] = lambda n, t: run_foldline("engines", "bench_eager",
                                                               {**eager, "prompt_len": n, "threads": t})
    return runners


def best_by_length(results: RoundResults, lengths: list[int]) -> dict[int, dict[str, dict[str, Any]]]:
    """Per prompt length, each engine's figures at its best thread count."""
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for length in lengths:
        engines = {}
        for name in results.engines():
            by_threads = {t: rs for (n, ln, t), rs in results.runs.items() if n == name and ln == length}
            if by_threads:
                engines[name] = best_of_threads(by_threads)
        out[length] = engines
    return out


def _header(host: HostLoad, text: str) -> None:
    if host.busy:
        print(host.flag())
    print(text)


def _print_run_notes(results: RoundResults, by_length: dict[int, dict[str, dict[str, Any]]], what: str) -> None:
    """Under the tables: each round's order, the engines that did not run, foldline's module, each engine's
    best thread count, the peers' settings. what: what the lengths are ("prompt", "held")."""
    print(format_orders(results.orders))
    for line in results.skipped.values():
        print(f"skipped {line}")
    engines = next(iter(by_length.values()))
    compiled = next(iter(engines.values()))
    print(f"foldline: module {compiled.get('module', '?')}")
    for name in engines:
        tried = engines[name].get("threads_tried", [])
        if len(tried) > 1:
            best = ", ".join(f"{by_length[n][name]['threads']} at {what} {n}" for n in by_length if name in by_length[n])
            print(f"{name}: best of {tried} threads: {best}")
    for peer in engines:
        if peer == "llama.cpp" or peer.startswith(GENAI_PREFIX):
            settings = engines[peer].get("settings") or {}
            print(f"{peer} " + engines[peer].get("version", "") + ": "
                  + ", ".join(f"{k}={v}" for k, v in settings.items()))
            if peer.startswith(GENAI_PREFIX):
                print(f"  {genai_provenance(settings.get('model', ''))}")


def genai_provenance(folder: str) -> str:
    """How a GenAI folder was made, from the record scripts/build_ort_genai_peer.py writes beside it."""
    record = Path(folder) / PEER_BUILD_RECORD
    if not record.is_file():
        return f"made by: not recorded (no {PEER_BUILD_RECORD}: not built by scripts/build_ort_genai_peer.py; " \
               "foldline compile --target onnx-genai writes none)"
    try:
        built = json.loads(record.read_text())
        return (f"made by: {built['built_by']}, variant {built['variant']}: -p {built['precision']} "
                + " ".join(built.get("extra_options", [])))
    except (ValueError, KeyError) as e:
        return f"made by: unreadable {record} ({e})"


def _print_genai_ratios(engines: dict[str, dict[str, Any]]) -> None:
    """With several GenAI folders: the first one given against each other, decode and prefill, each ratio's
    median and spread over the rounds (the table's ratios are to foldline's bundle)."""
    genai = [n for n in engines if n.startswith(GENAI_PREFIX)]
    for other in genai[1:]:
        cells = [f"{what} {ratio_cell(engines[genai[0]], engines[other], key)}"
                 for what, key in (("decode", "decode_tok_s"), ("prefill", "prefill_tok_s"))]
        print(f"{genai[0]} / {other}: " + ", ".join(cells))


def accuracy_reference(args: Namespace, manifest: Manifest) -> accuracy.Reference:
    """What --accuracy scores against: the file given, else HF eager on the bundle's source GGUF (cached)."""
    if args.accuracy == "auto":
        return accuracy.hf_reference(source_model(manifest, "auto"))
    return accuracy.load_reference(args.accuracy)


def _add_accuracy(args: Namespace, manifest: Manifest, reference: accuracy.Reference,
                  by_length: dict[int, dict[str, dict[str, Any]]]) -> None:
    """Each engine's logits against the reference (bench/accuracy.py), once per engine after the timed rounds,
    merged into its figures at every length. Engines it does not score (llama.cpp) get none."""
    scored: dict[str, accuracy.LogitsRunner] = {
        foldline_label(args): accuracy.bundle_logits(str(args.bundle), args.device, args.cpu)}
    for bundle in args.also or []:
        other = Manifest.load(bundle)
        device = also_device(other)
        cpu = also_cpu(bundle, other, device, args.cpu)
        scored[also_label(bundle, device, cpu)] = accuracy.bundle_logits(str(bundle), device, cpu)
    for label, folder in genai_labels(args.ort_genai).items():
        scored[label] = accuracy.genai_logits(folder, args.genai_python, args.peer_context or manifest.max_context)
    ran = next(iter(by_length.values()))  # an engine that was not installed is not scored either
    scores = accuracy.measure({n: run for n, run in scored.items() if n in ran}, reference)
    for figures in by_length.values():
        for name, found in scores.items():
            if name in figures:
                figures[name].update(found)
        if "HF eager" in figures:
            figures["HF eager"]["accuracy_reference"] = True


def _check_lengths(lengths: list[int], new_tokens: int, max_context: int) -> None:
    for length in lengths:
        if length + new_tokens > max_context:
            raise BenchError(f"--prompt-len {length} + --new-tokens {new_tokens} exceeds the bundle's "
                             f"max_context {max_context}")


def _timed_rounds(args: Namespace, manifest: Manifest, lengths: list[int],
                  new_tokens: int) -> tuple[HostLoad, list[int], RoundResults, dict]:
    """The host's load (a busy host refused unless --busy-ok), the thread counts, every engine's rounds at
    every length and thread count, and each engine's best per length."""
    host = check_host(args.busy_ok)
    threads = _thread_counts(args)
    runners = engine_runners(args, manifest, new_tokens)
    with BenchProgress() as progress:
        results = run_rounds(runners, lengths, threads, args.rounds, args.seed, progress)
    return host, threads, results, best_by_length(results, lengths)


def run_throughput(args: Namespace, manifest: Manifest) -> int:
    """Prefill and decode of each prompt length: every engine at every thread count, `--rounds` shuffled
    rounds; medians, and each ratio's spread over the rounds."""
    lengths = list(dict.fromkeys(args.prompt_len or [DEFAULT_PROMPT_LEN]))
    new_tokens = args.new_tokens or DEFAULT_NEW_TOKENS
    _check_lengths(lengths, new_tokens, manifest.max_context)
    # The reference first (computed once, cached): a model it cannot score is refused before the rounds run.
    reference = accuracy_reference(args, manifest) if args.accuracy else None
    host, threads, results, by_length = _timed_rounds(args, manifest, lengths, new_tokens)
    if reference is not None:
        _add_accuracy(args, manifest, reference, by_length)
    name = _model_name(manifest, args)
    for length, engines in by_length.items():
        _header(host, f"bench {name}: prompt {length} tokens (foldline in chunks of {manifest.prefill_chunk}), "
                      f"{new_tokens} greedy decoded tokens, threads {','.join(map(str, threads))} (each engine's "
                      f"best), {host.describe()}, median of {args.rounds} shuffled round(s), ratios' "
                      f"(min-max) over rounds")
        print(format_table(engines, length, new_tokens))
    first = by_length[lengths[0]]
    _print_genai_ratios(first)
    _print_run_notes(results, by_length, "prompt")
    wall = _print_memory_wall(args, manifest, next(iter(first.values())), lengths[0] + new_tokens // 2, {})
    if args.hadamard_online:
        compiled = next(iter(first.values()))
        online = run_foldline("engines", "bench_compiled", {
            "bundle": str(args.hadamard_online), "device": args.device, "prompt_len": lengths[0],
            "new_tokens": new_tokens, "seed": args.seed, "threads": compiled["threads"], "cpu": None})
        fold_ms, online_ms = (1000 * r["decode_s"] / max(new_tokens, 1) for r in (compiled, online))
        print(f"online Hadamard rotation: {online_ms - fold_ms:+.3f} ms per decode step "
              f"(online {online_ms:.3f} ms vs this bundle {fold_ms:.3f} ms)")
    if args.plot:
        from .plot import plot_throughput

        plot_throughput(args.plot, name + (" (HOST BUSY)" if host.busy else ""), by_length)
    _write_json(args, {"bundle": str(args.bundle), "model": name, "new_tokens": new_tokens, "seed": args.seed,
                       "threads": threads, "rounds": args.rounds, "orders": results.orders, "host_load": host.load,
                       "host_busy": host.busy, "prompt_len": lengths[0], "engines": first,
                       "prompt_lengths": [{"prompt_len": n, "engines": e} for n, e in by_length.items()],
                       "memory_wall": wall})
    return 0


def _print_memory_wall(args: Namespace, manifest: Manifest, compiled: dict[str, Any], held: int,
                       probes: dict[int, list[float]]) -> dict | None:
    """foldline's decode against the host's read bandwidth at its best thread count (bench/memory_wall.py),
    measured once per thread count in a run (`probes` keeps them); CPU bundles only."""
    if args.device != "cpu" or not compiled.get("module"):
        return None
    from .memory_wall import host_read_gb_s, measure_wall

    threads = int(compiled["threads"])
    if threads not in probes:
        probes[threads] = host_read_gb_s(threads)
    wall = measure_wall(manifest, compiled["module"], compiled["decode_tok_s"], held, threads, probes[threads])
    for line in wall.lines():
        print(line)
    return wall.as_json()


def parse_held(text: str, max_context: int, new_tokens: int) -> list[int]:
    try:
        held = [int(t) for t in text.split(",") if t.strip()]
    except ValueError as e:
        raise BenchError(f"--held takes comma-separated token counts, got {text!r}") from e
    if not held or any(n < 1 or n > max_context for n in held):
        raise BenchError(f"--held values must be between 1 and the bundle's max_context {max_context}")
    if new_tokens < 1 or new_tokens >= max_context:
        raise BenchError(f"--new-tokens must be between 1 and max_context {max_context} with --held")
    return held


def run_held(args: Namespace, manifest: Manifest) -> int:
    """Decode speed as a function of the tokens held: every engine of the run at the same positions, in
    shuffled rounds."""
    new_tokens = args.new_tokens or 32
    held_list = parse_held(args.held, manifest.max_context, new_tokens)
    lengths = list(dict.fromkeys(min(h, manifest.max_context - new_tokens) for h in held_list))  # last decode fits
    host, threads, results, by_length = _timed_rounds(args, manifest, lengths, new_tokens)
    name = _model_name(manifest, args)
    _header(host, f"bench {name}: decode {new_tokens} greedy tokens after N tokens held (max_context "
                  f"{manifest.max_context}), threads {','.join(map(str, threads))} (each engine's best), "
                  f"{host.describe()}, median of {args.rounds} shuffled round(s), ratios' (min-max) over rounds")
    print_held(list(by_length.items()))
    _print_run_notes(results, by_length, "held")
    probes: dict[int, list[float]] = {}
    walls = [_print_memory_wall(args, manifest, next(iter(engines.values())), held + new_tokens // 2, probes)
             for held, engines in by_length.items()]
    if args.plot:
        from .plot import plot_held

        plot_held(args.plot, name + (" (HOST BUSY)" if host.busy else ""), by_length)
    _write_json(args, {"bundle": str(args.bundle), "model": name, "new_tokens": new_tokens, "threads": threads,
                       "rounds": args.rounds, "orders": results.orders, "host_load": host.load,
                       "host_busy": host.busy, "held": [{"held": h, "engines": e, "memory_wall": w}
                                                        for (h, e), w in zip(by_length.items(), walls)]})
    return 0


def run_streams(args: Namespace, manifest: Manifest) -> int:
    """Concurrent streams on the rows of a batched bundle (bench/streams.py)."""
    streams = parse_streams(args.streams, manifest.batch)
    prompt_len = _one(args.prompt_len, "--prompt-len", 32)
    new_tokens = args.new_tokens or 64
    host = check_host(args.busy_ok)
    results = bench_streams(str(args.bundle), args.device, streams, prompt_len, new_tokens, args.seed)
    _header(host, host.describe())
    print_streams(_model_name(manifest, args), results, prompt_len, new_tokens)
    _write_json(args, {"streams": results, "host_load": host.load, "host_busy": host.busy})
    return 0


def run_chat(args: Namespace, manifest: Manifest) -> int:
    """A multi-turn chat: foldline's prompt cache on and off, beside llama.cpp's prefix reuse (bench/chat.py),
    in `--rounds` shuffled rounds."""
    user_tokens = _one(args.prompt_len, "--prompt-len", 32)
    reply_tokens = args.new_tokens or 16
    threads = _one(args.threads, "--threads", os.cpu_count() or 1)
    script = chat_script(manifest.vocab_size, args.chat, user_tokens, reply_tokens, args.seed)
    check_fits(script, manifest.max_context)
    warmup = chat_warmup(manifest.vocab_size, user_tokens, args.seed)
    host = check_host(args.busy_ok)
    runners: dict[str, Runner] = {}
    for label, cache in (("foldline", True), ("foldline, no cache", False)):
        chat_args = {"bundle": str(args.bundle), "device": args.device, "script": script, "warmup": warmup,
                     "prompt_cache": cache, "threads": threads, "cpu": args.cpu}
        runners[label] = lambda _n, _t, a=chat_args: run_foldline("chat", "bench_chat_foldline", a)
    if args.llama_cpp:
        gguf = source_model(manifest, args.llama_cpp)
        n_ctx = args.peer_context or manifest.max_context
        for label, reuse in (("llama.cpp", True), ("llama.cpp, reset", False)):
            runners[label] = lambda _n, _t, r=reuse: bench_chat_llama_cpp(gguf, script, warmup, threads, n_ctx, r,
                                                                          args.llama_python)
    with BenchProgress() as progress:
        results = run_rounds(runners, [user_tokens], [threads], args.rounds, args.seed, progress)
    engines = {n: combine_chat_rounds(results.runs[(n, user_tokens, threads)]) for n in results.engines()}
    _header(host, host.describe())
    print_chat(_model_name(manifest, args), engines, user_tokens, reply_tokens)
    print(format_orders(results.orders))
    for line in results.skipped.values():
        print(f"skipped {line}")
    _write_json(args, {"chat": engines, "rounds": args.rounds, "orders": results.orders, "host_load": host.load,
                       "host_busy": host.busy})
    return 0

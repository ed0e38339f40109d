"""The kinds of `foldline bench` run, one function each; the CLI (tools/bench_cmd.py) parses and calls them.

- throughput: prefill and decode of one prompt, foldline beside its peers, in
  alternating rounds (on a shared host one 128-token decode moves between runs
  of the same engine by enough that a single pair of runs can rank two engines
  either way, docs/history.md; alternating rounds meet the same host load);
- held: decode speed with N tokens already held;
- streams: aggregate decode of N concurrent streams through the scheduler;
- chat: a multi-turn chat, with the prompt cache on and off.
"""

from __future__ import annotations

import json
import os
import sys
from argparse import Namespace
from pathlib import Path
from typing import Any

from ..contract.manifest import Manifest
from .chat import bench_chat_llama_cpp, chat_script, check_fits
from .child import BenchError, PeerUnavailable, run_foldline
from .engines import prompt_ids
from .peers import bench_hf_eager, bench_llama_cpp, bench_ort_genai
from .streams import bench_streams, parse_streams
from .tables import (
    combine_rounds,
    format_table,
    print_chat,
    print_held,
    print_streams,
    round_ratios,
)

# The CLI's defaults; a mode that wants other ones uses them when the option was left at its default.
DEFAULT_PROMPT_LEN, DEFAULT_NEW_TOKENS = 128, 128


def source_model(manifest: Manifest, given: str) -> str:
    """The checkpoint a peer should load: the one given, else the GGUF the bundle was compiled from."""
    if given != "auto":
        return given
    source = (manifest.config.get("extra") or {}).get("gguf")
    if not source:
        raise BenchError("the bundle records no source GGUF; name the model file for the peer explicitly")
    return source


def _or_default(value: int, cli_default: int, mode_default: int) -> int:
    return value if value != cli_default else mode_default


def _threads(args: Namespace) -> int:
    return args.threads or os.cpu_count() or 1


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


def _also_runner(bundle: str, manifest: Manifest, ours: dict[str, Any]) -> dict[str, Any]:
    """`--also BUNDLE`: another compiled form of the model (an ONNX bundle beside the IREE one), same prompt.

    manifest: the benched bundle's."""
    other = Manifest.load(bundle)
    if other.vocab_size != manifest.vocab_size:
        raise BenchError(f"--also {bundle}: its vocabulary ({other.vocab_size}) is not the benched bundle's")
    device = also_device(other)
    args = {**ours, "bundle": str(bundle), "device": device, "cpu": None}
    return {f"foldline ({device}) {Path(bundle).name}": lambda: run_foldline("engines", "bench_compiled", args)}


def run_throughput(args: Namespace, manifest: Manifest) -> int:
    """Prefill and decode of one prompt: foldline, then each peer, `--rounds` times; medians."""
    if args.prompt_len < 1 or args.new_tokens < 0:
        raise BenchError("--prompt-len must be >= 1 and --new-tokens >= 0")
    if args.prompt_len + args.new_tokens > manifest.max_context:
        raise BenchError(f"--prompt-len {args.prompt_len} + --new-tokens {args.new_tokens} exceeds the bundle's "
                         f"max_context {manifest.max_context}")
    if args.rounds < 1:
        raise BenchError("--rounds must be >= 1")
    common = {"prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "seed": args.seed}
    ids = prompt_ids(manifest.vocab_size, args.prompt_len, args.seed)
    threads = _threads(args)
    ours = {"bundle": str(args.bundle), "device": args.device, "threads": threads, "cpu": args.cpu, **common}
    label = f"foldline ({args.device}{', ' + args.cpu if args.cpu else ''})"
    runners = {label: lambda: run_foldline("engines", "bench_compiled", ours)}
    for other in args.also or []:
        runners.update(_also_runner(other, manifest, ours))
    if args.llama_cpp:
        gguf = source_model(manifest, args.llama_cpp)
        runners["llama.cpp"] = lambda: bench_llama_cpp(gguf, ids, args.new_tokens, threads, python=args.llama_python,
                                                       n_ctx=args.peer_context or manifest.max_context)
    if args.ort_genai:
        runners["ORT GenAI"] = lambda: bench_ort_genai(args.ort_genai, ids, args.new_tokens, threads,
                                                       python=args.genai_python,
                                                       n_ctx=args.peer_context or manifest.max_context)
    if args.hf:
        hf_model = source_model(manifest, args.hf)
        runners["HF eager"] = lambda: bench_hf_eager(hf_model, ids, args.new_tokens, threads)
    if args.eager:
        eager = {"spec": args.eager, "max_context": manifest.max_context, "chunk": manifest.prefill_chunk, **common}
        runners["reference eager"] = lambda: run_foldline("engines", "bench_eager", eager)
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
    name = _model_name(manifest, args)
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
    for peer in ("llama.cpp", "ORT GenAI"):
        if peer in engines:
            settings = engines[peer].get("settings") or {}
            print(f"{peer} " + engines[peer].get("version", "") + ": "
                  + ", ".join(f"{k}={v}" for k, v in settings.items()))
    if args.hadamard_online:
        online = run_foldline("engines", "bench_compiled", {**ours, "bundle": str(args.hadamard_online), "cpu": None})
        fold_ms, online_ms = (1000 * r["decode_s"] / max(args.new_tokens, 1) for r in (compiled, online))
        print(f"online Hadamard rotation: {online_ms - fold_ms:+.3f} ms per decode step "
              f"(online {online_ms:.3f} ms vs this bundle {fold_ms:.3f} ms)")
    _write_json(args, {"bundle": str(args.bundle), "model": name, **common, "threads": threads,
                       "rounds": args.rounds, "engines": engines})
    return 0


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
    """Decode speed as a function of the tokens held, foldline beside llama.cpp at the same positions."""
    new_tokens = _or_default(args.new_tokens, DEFAULT_NEW_TOKENS, 32)
    held_list = parse_held(args.held, manifest.max_context, new_tokens)
    threads = _threads(args)
    rows, skipped = [], None
    for held in held_list:
        prompt_len = min(held, manifest.max_context - new_tokens)  # the last decode must still fit
        ids = prompt_ids(manifest.vocab_size, prompt_len, args.seed)
        ours = run_foldline("engines", "bench_compiled", {
            "bundle": str(args.bundle), "device": args.device, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "seed": args.seed, "threads": threads, "cpu": args.cpu})
        peer = None
        if args.llama_cpp and skipped is None:
            try:
                peer = bench_llama_cpp(source_model(manifest, args.llama_cpp), ids, new_tokens, threads,
                                       python=args.llama_python, n_ctx=args.peer_context or manifest.max_context)
            except PeerUnavailable as e:
                skipped = str(e)
        rows.append((prompt_len, ours, peer))
    name = _model_name(manifest, args)
    print(f"bench {name}: decode {new_tokens} greedy tokens after N tokens held (max_context "
          f"{manifest.max_context}), {threads} threads, load average {os.getloadavg()[0]:.1f}")
    print_held(rows)
    if skipped:
        print(f"skipped {skipped}")
    _write_json(args, {"bundle": str(args.bundle), "model": name, "new_tokens": new_tokens, "threads": threads,
                       "held": [{"held": h, "foldline": o, "llama.cpp": p} for h, o, p in rows]})
    return 0


def run_streams(args: Namespace, manifest: Manifest) -> int:
    """Concurrent streams on the rows of a batched bundle (bench/streams.py)."""
    streams = parse_streams(args.streams, manifest.batch)
    prompt_len = _or_default(args.prompt_len, DEFAULT_PROMPT_LEN, 32)
    new_tokens = _or_default(args.new_tokens, DEFAULT_NEW_TOKENS, 64)
    results = bench_streams(str(args.bundle), args.device, streams, prompt_len, new_tokens, args.seed)
    print_streams(_model_name(manifest, args), results, prompt_len, new_tokens)
    _write_json(args, {"streams": results})
    return 0


def run_chat(args: Namespace, manifest: Manifest) -> int:
    """A multi-turn chat: foldline's prompt cache on and off, beside llama.cpp's prefix reuse (bench/chat.py)."""
    if args.chat < 1:
        raise BenchError(f"--chat takes a positive number of turns, got {args.chat}")
    user_tokens = _or_default(args.prompt_len, DEFAULT_PROMPT_LEN, 32)
    reply_tokens = _or_default(args.new_tokens, DEFAULT_NEW_TOKENS, 16)
    if user_tokens < 1 or reply_tokens < 1:
        raise BenchError("a chat turn needs at least one user token and one answer token")
    script = chat_script(manifest.vocab_size, args.chat, user_tokens, reply_tokens, args.seed)
    check_fits(script, manifest.max_context)
    threads = _threads(args)
    engines = {}
    for label, cache in (("foldline", True), ("foldline, no cache", False)):
        engines[label] = run_foldline("chat", "bench_chat_foldline", {
            "bundle": str(args.bundle), "device": args.device, "script": script, "prompt_cache": cache,
            "threads": threads, "cpu": args.cpu})
    if args.llama_cpp:
        gguf = source_model(manifest, args.llama_cpp)
        n_ctx = args.peer_context or manifest.max_context
        try:
            for label, reuse in (("llama.cpp", True), ("llama.cpp, reset", False)):
                engines[label] = bench_chat_llama_cpp(gguf, script, threads, n_ctx, reuse, args.llama_python)
        except PeerUnavailable as e:
            print(f"llama.cpp skipped: {e}")
    print_chat(_model_name(manifest, args), engines, user_tokens, reply_tokens)
    _write_json(args, {"chat": engines})
    return 0

"""foldline bench BUNDLE [--prompt-len 128] [--new-tokens 128] [--eager MODEL]

Prefill and decode throughput of a compiled bundle and, side by side, of the
torch eager reference on the same weights with the same chunking. Each engine
runs in its own child process so its peak RSS is its own (and the runtime's
process never imports torch).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

import numpy as np


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure prefill/decode tokens/s and peak memory of a bundle (and torch eager)")
    p.add_argument("bundle", help="bundle directory")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens to prefill (default 128)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens to decode after the prompt (default 128)")
    p.add_argument("--eager", default=None, metavar="MODEL",
                   help="also time torch eager on MODEL (the spec the bundle was compiled from)")
    p.add_argument("--device", default="cpu", choices=["cpu", "vulkan", "cuda"])
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt ids")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--hadamard-online", default=None, metavar="BUNDLE",
                   help="the same model compiled with --hadamard online: report the rotation's cost per decode step")
    p.set_defaults(func=run)


def prompt_ids(vocab: int, n: int, seed: int) -> list[int]:
    # Skip the low ids where vocabularies keep their control tokens.
    return np.random.default_rng(seed).integers(min(1000, vocab // 2), vocab, size=n).tolist()


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def _time_engine(prefill, decode, ids: list[int], new_tokens: int) -> dict[str, float]:
    # Wall clock is what a user sees; process CPU time (all threads) tells how much
    # of it was this engine's work when other processes share the cores.
    c0, t0 = time.process_time(), time.perf_counter()
    logits = prefill(ids)
    c1, t1 = time.process_time(), time.perf_counter()
    for _ in range(new_tokens):
        logits = decode(int(np.argmax(logits)))
    c2, t2 = time.process_time(), time.perf_counter()
    return {
        "prefill_s": t1 - t0,
        "decode_s": t2 - t1,
        "prefill_tok_s": len(ids) / (t1 - t0),
        "decode_tok_s": new_tokens / (t2 - t1) if new_tokens else float("nan"),
        "prefill_cpu_ms_tok": 1000 * (c1 - c0) / len(ids),
        "decode_cpu_ms_tok": 1000 * (c2 - c1) / new_tokens if new_tokens else float("nan"),
    }


def bench_compiled(bundle: str, device: str, prompt_len: int, new_tokens: int, seed: int) -> dict[str, Any]:
    """Runs in the child process: the embedded runtime only."""
    from ..runtime import Model

    t0 = time.perf_counter()
    model = Model.load(bundle, device=device, verify=False)
    load_s = time.perf_counter() - t0
    ids = prompt_ids(model.vocab_size, prompt_len, seed)
    warm = model.session()  # first calls allocate and page in the weights
    warm.prefill(ids[: model.chunk])
    warm.decode(ids[0])
    session = model.session()
    out = _time_engine(session.prefill, session.decode, ids, new_tokens)
    out.update(load_s=load_s, peak_rss_mib=_peak_rss_mib(), chunk=model.chunk, max_context=model.max_context,
               threads=os.cpu_count())
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
    out = _time_engine(runner.prefill, runner.decode, ids, new_tokens)
    out.update(load_s=load_s, peak_rss_mib=_peak_rss_mib(), threads=torch.get_num_threads())
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


def format_table(compiled: dict[str, Any], eager: dict[str, Any] | None, prompt_len: int, new_tokens: int,
                 device: str) -> str:
    rows = [
        (f"prefill tok/s ({prompt_len} tokens)", "prefill_tok_s", "{:.1f}"),
        (f"decode tok/s ({new_tokens} tokens)", "decode_tok_s", "{:.1f}"),
        ("prefill CPU ms/token", "prefill_cpu_ms_tok", "{:.1f}"),
        ("decode CPU ms/token", "decode_cpu_ms_tok", "{:.1f}"),
        ("peak RSS (MiB)", "peak_rss_mib", "{:.0f}"),
        ("load (s)", "load_s", "{:.1f}"),
    ]
    head = ["", f"foldline ({device})"] + (["torch eager", "foldline / eager"] if eager else [])
    table = [head]
    for label, key, fmt in rows:
        line = [label, fmt.format(compiled[key])]
        if eager:
            line += [fmt.format(eager[key]), f"{compiled[key] / eager[key]:.2f}x"]
        table.append(line)
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in table)


def run(args) -> int:
    from ..runtime.bundle import Manifest

    manifest = Manifest.load(args.bundle)
    if args.prompt_len < 1 or args.new_tokens < 0:
        raise ValueError("--prompt-len must be >= 1 and --new-tokens >= 0")
    if args.prompt_len + args.new_tokens > manifest.max_context:
        raise ValueError(
            f"--prompt-len {args.prompt_len} + --new-tokens {args.new_tokens} exceeds the bundle's "
            f"max_context {manifest.max_context}"
        )
    common = {"prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "seed": args.seed}
    compiled = _child("compiled", {"bundle": str(args.bundle), "device": args.device, **common})
    eager = None
    if args.eager:
        eager = _child("eager", {"spec": args.eager, "max_context": manifest.max_context,
                                 "chunk": manifest.prefill_chunk, **common})
    name = manifest.config.get("name", args.bundle)
    print(f"bench {name}: prompt {args.prompt_len} tokens in chunks of {manifest.prefill_chunk}, "
          f"{args.new_tokens} decoded tokens, {os.cpu_count()} CPU threads")
    print(format_table(compiled, eager, args.prompt_len, args.new_tokens, args.device))
    if args.hadamard_online:
        online = _child("compiled", {"bundle": str(args.hadamard_online), "device": args.device, **common})
        fold_ms, online_ms = (1000 * r["decode_s"] / max(args.new_tokens, 1) for r in (compiled, online))
        print(f"online Hadamard rotation: {online_ms - fold_ms:+.3f} ms per decode step "
              f"(online {online_ms:.3f} ms vs this bundle {fold_ms:.3f} ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bundle": str(args.bundle), "model": name, **common, "compiled": compiled, "eager": eager}, f,
                      indent=2)
    return 0

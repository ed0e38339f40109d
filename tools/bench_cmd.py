"""foldline bench BUNDLE: the CLI of the bench package (bench/), which holds the engines, modes and tables.

    foldline bench BUNDLE [--prompt-len 16,100,1000] [--new-tokens 128] [--threads 1,2] [--rounds 3]
                          [--llama-cpp [GGUF]] [--hf [MODEL]] [--ort-genai DIR ...] [--accuracy] [--also BUNDLE]
                          [--plot FILE.png]
    foldline bench BUNDLE --held 128,1024,4096 | --streams 1,4,8 | --chat 5
"""

from __future__ import annotations

import argparse

from .cli import positive_int, require_extra


def positive_ints(text: str) -> list[int]:
    """argparse type of a comma-separated list of counts (`16,100,1000`)."""
    values = [positive_int(t.strip()) for t in text.split(",") if t.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure prefill/decode tokens/s and peak memory of a bundle (and torch eager)")
    p.add_argument("bundle", help="bundle directory")
    p.add_argument("--prompt-len", type=positive_ints, default=None, metavar="N[,N...]",
                   help="prompt tokens to prefill; several lengths give a table each (e.g. 16,100,1000; default "
                        "100, no multiple of a prefill chunk; 32 with --streams and --chat)")
    p.add_argument("--new-tokens", type=positive_int, default=None,
                   help="tokens to decode after the prompt (default 128; 32 with --held, 64 with --streams, "
                        "16 with --chat)")
    p.add_argument("--llama-cpp", nargs="?", const="auto", default=None, metavar="GGUF",
                   help="also time llama.cpp (llama-cpp-python) on GGUF (default: not timed; GGUF defaults to "
                        "the GGUF the bundle came from)")
    p.add_argument("--llama-python", default=None, metavar="PYTHON",
                   help="interpreter that has llama-cpp-python (default: this one)")
    p.add_argument("--ort-genai", action="append", default=None, metavar="DIR",
                   help="also time ONNX Runtime GenAI on DIR, a model folder of the same checkpoint: one its "
                        "builder made (scripts/build_ort_genai_peer.py) or foldline compile --target onnx-genai; "
                        "repeatable, each named by its folder; the first given is compared with the others "
                        "(default: not timed)")
    p.add_argument("--genai-python", default=None, metavar="PYTHON",
                   help="interpreter that has onnxruntime-genai (default: this one)")
    p.add_argument("--accuracy", nargs="?", const="auto", default=None, metavar="REF.npz",
                   help="also score every foldline bundle and GenAI folder against HF transformers eager (float32) "
                        "on the shipped model's fixed prompts, teacher-forced: worst and mean cosine, top-1 "
                        "agreement, once per engine after the timed rounds (REF.npz: a saved reference, else one "
                        "computed with transformers and cached; default: not scored)")
    p.add_argument("--also", action="append", default=None, metavar="BUNDLE",
                   help="also time another bundle of the same model in the same run (e.g. its --target onnx "
                        "bundle beside the CPU one); repeatable (default: none)")
    p.add_argument("--hf", nargs="?", const="auto", default=None, metavar="MODEL",
                   help="also time HF transformers eager on MODEL, a .gguf or HF directory (default: not "
                        "timed; MODEL defaults to the GGUF the bundle came from; needs torch and transformers)")
    p.add_argument("--eager", default=None, metavar="MODEL",
                   help="also time foldline's own torch reference module on MODEL (what compiling buys; not a "
                        "peer; default: not timed; needs the compiler extra)")
    p.add_argument("--rounds", type=positive_int, default=3,
                   help="run every engine this many times, in a shuffled order each round, and report medians "
                        "and the spread of each ratio (default 3)")
    p.add_argument("--threads", type=positive_ints, default=None, metavar="N[,N...]",
                   help="thread counts to run every engine at (e.g. 1,2); each engine's best is reported with its "
                        "count (default: all cores)")
    p.add_argument("--busy-ok", action="store_true",
                   help="bench even when the host's 1-minute load exceeds half its cores (the tables are then "
                        "flagged; default: refuse)")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="also plot tok/s against prompt length (or tokens held, with --held) for every engine, "
                        "the rounds' spread as error bars (needs the plot extra; default: no plot)")
    p.add_argument("--cpu", default=None, metavar="NAME",
                   help="bench the CPU module compiled for NAME (e.g. x86-64-v3: the AVX2 kernels on any "
                        "x86 host with AVX2), beside a llama.cpp built for the same ISA (--llama-python; "
                        "default: the best module this CPU runs)")
    p.add_argument("--peer-context", type=positive_int, default=None, metavar="N",
                   help="llama.cpp's context (KV capacity; default: the bundle's max_context, so both hold "
                        "caches of the same size)")
    p.add_argument("--held", default=None, metavar="N,N,...",
                   help="instead: decode tok/s with N tokens already held, for each N (e.g. 128,1024,4096,8192): "
                        "prefill N tokens, then decode --new-tokens (default 32 here; default: off)")
    p.add_argument("--streams", default=None, metavar="N,N,...",
                   help="instead: aggregate decode tok/s with N concurrent streams through the serving scheduler "
                        "(a bundle compiled with --batch; e.g. 1,4,8; prompt 32 and 64 new tokens unless given; "
                        "default: off)")
    p.add_argument("--chat", type=positive_int, default=None, metavar="TURNS",
                   help="instead: a TURNS-turn chat (32 new user tokens and 16 answer tokens per turn unless "
                        "--prompt-len / --new-tokens say otherwise): time to the first answer token with the "
                        "prompt cache on and off, beside llama.cpp with and without prefix reuse (--llama-cpp; "
                        "default: off)")
    p.add_argument("--device", default="cpu", choices=["cpu", "vulkan", "cuda", "onnxruntime"],
                   help="device the bundle runs on (default cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt ids (default 0)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON (default: not written)")
    p.add_argument("--hadamard-online", default=None, metavar="BUNDLE",
                   help="the same model compiled with --hadamard online: report the rotation's cost per decode "
                        "step (default: not measured)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.eager is not None:
        require_extra("compiler", ("torch",), what="--eager")
    if args.hf is not None:
        require_extra("compiler", ("torch", "gguf"), what="--hf")
    if args.plot is not None:
        require_extra("plot", ("matplotlib",), what="--plot")
    if args.accuracy == "auto":
        require_extra("compiler", ("torch", "gguf"), what="--accuracy (its HF reference)")
    from ..bench import modes
    from ..bench.child import BenchError
    from ..contract.manifest import Manifest

    if args.accuracy is not None and (args.held is not None or args.streams is not None or args.chat is not None):
        raise BenchError("--accuracy goes with the prompt bench (--prompt-len), not --held, --streams or --chat")
    manifest = Manifest.load(args.bundle)
    if args.held is not None:
        return modes.run_held(args, manifest)
    if args.streams is not None:
        return modes.run_streams(args, manifest)
    if args.chat is not None:
        return modes.run_chat(args, manifest)
    return modes.run_throughput(args, manifest)

"""Options `foldline generate` and `foldline chat` share: loading a bundle, sampling, a session file."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .cli import CliError, positive_int


def add_load_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", choices=["cpu", "vulkan", "cuda", "onnxruntime"],
                   help="where to run the bundle (default: %(default)s)")
    p.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="CPU threads (default: one per physical core; 1 runs on the calling thread)")
    p.add_argument("--cpu", default=None, metavar="NAME",
                   help="of a bundle with several CPU modules, load the one compiled for NAME "
                        "(default: the best one this CPU runs)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the bundle's hash check at load (default: check)")
    p.add_argument("--ort-provider", default=None, metavar="LIST",
                   help="with --device onnxruntime: ONNX Runtime's execution providers, comma-separated in order "
                        "of preference, e.g. cuda,cpu (default: cpu)")


def add_sampling_options(p: argparse.ArgumentParser, max_new_tokens: int, what: str) -> None:
    p.add_argument("--max-new-tokens", type=positive_int, default=max_new_tokens, metavar="N",
                   help=f"most tokens generated {what}, at least 1 (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature; 0 is greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="sample among the K likeliest tokens; 0: all "
                   "(default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample among the likeliest tokens whose probabilities add up to P (default: %(default)s)")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="random seed of the sampler (default: a fresh one)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when the text contains TEXT, not shown (repeatable; default: none)")


def make_sampler(args: argparse.Namespace):
    """The sampler the options ask for (checked before the bundle loads)."""
    from ..runtime import Sampler

    return Sampler(args.temperature, args.top_k, args.top_p, args.seed)


def load_model(args: argparse.Namespace):
    from ..runtime import Model

    providers = None if args.ort_provider is None else [p for p in args.ort_provider.split(",") if p.strip()]
    return Model.load(args.bundle, device=args.device, verify=not args.no_verify, threads=args.threads, cpu=args.cpu,
                      ort_providers=providers)


def check_output_file(path: str | None, option: str = "--session") -> None:
    """Refuse, before anything is generated, a file (a session, logits) that could not be written afterwards."""
    if path is None:
        return
    target = Path(path)
    if target.exists() and not target.is_file():
        raise CliError(f"{option} {path} is not a file")
    directory = target.parent
    if not directory.is_dir():
        raise CliError(f"{option} {path}: directory {directory} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise CliError(f"{option} {path}: directory {directory} is not writable")

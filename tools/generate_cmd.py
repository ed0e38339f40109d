"""foldline generate BUNDLE (--prompt TEXT | --prompt-ids 1,2,3)"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from .cli import CliError


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate from a compiled bundle")
    p.add_argument("bundle", help="bundle directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs a bundle with a tokenizer)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--device", default="cpu", choices=["cpu", "vulkan", "cuda", "onnxruntime"])
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--logits-out", default=None, help="save every generated step's logits as float32 [steps, vocab] .npy")
    p.add_argument("--no-verify", action="store_true", help="skip the bundle hash check at load")
    p.add_argument("--cpu", default=None, metavar="NAME",
                   help="of a bundle with several CPU modules, load the one compiled for NAME "
                        "(default: the best one this CPU runs)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: one per physical core; 1 runs on the calling thread)")
    p.add_argument("--session", default=None, metavar="FILE",
                   help="continue the conversation saved in FILE (if it exists) and save it there afterwards")
    p.set_defaults(func=run)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError as e:
        raise CliError(f"--prompt-ids must be comma-separated integers: {e}") from e


def run(args) -> int:
    from ..runtime import Model, Sampler

    model = Model.load(args.bundle, device=args.device, verify=not args.no_verify, threads=args.threads, cpu=args.cpu)
    resume = args.session is not None and Path(args.session).exists()
    session = model.session_from(args.session) if resume else model.session()
    base_sampler = Sampler(args.temperature, args.top_k, args.top_p, args.seed)
    sampled: list[int] = []

    def sampler(logits: np.ndarray) -> int:
        sampled.append(base_sampler(logits))
        return sampled[-1]

    logits_log: list[np.ndarray] = []
    on_logits = logits_log.append if args.logits_out else None
    t0 = time.perf_counter()
    n = 0
    if args.prompt_ids is not None:
        ids = _parse_ids(args.prompt_ids)
        out = []
        for token in session.generate_ids(ids, args.max_new_tokens, sampler, on_logits=on_logits):
            out.append(token)
            n += 1
        print(",".join(str(t) for t in out))
    else:
        prompt = args.prompt
        if args.chat:
            from ..runtime.chat import apply_chat_template

            prompt = apply_chat_template(model, prompt)
        ids = model.encode(prompt, add_bos=not args.chat and session.position == 0)
        counted = []

        def count(logits):
            counted.append(1)
            if on_logits is not None:
                on_logits(logits)

        for piece in session.stream_text(ids, args.max_new_tokens, sampler, args.stop, on_logits=count):
            sys.stdout.write(piece)
            sys.stdout.flush()
        n = len(counted)
        sys.stdout.write("\n")
    dt = time.perf_counter() - t0
    if args.session is not None:
        _save_session(session, sampled, args.session)
    print(f"[{n} tokens in {dt:.2f} s: {n / dt:.1f} tokens/s incl. prefill of {len(ids)}]", file=sys.stderr)
    if args.logits_out:
        np.save(args.logits_out, np.stack(logits_log).astype(np.float32))
    return 0


def _save_session(session, sampled: list[int], path: str) -> None:
    """Feed the last sampled token (the state lacks it) and save: the file holds every token so far."""
    if sampled and session.position < session.model.max_context:
        session.decode(sampled[-1])
    session.save(path)
    print(f"[session saved to {path}: {session.position} tokens]", file=sys.stderr)

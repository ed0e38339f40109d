"""foldline generate BUNDLE (--prompt TEXT | --prompt-ids 1,2,3) [--chat] [--session FILE]"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from .cli import CliError
from .run_options import (
    add_load_options,
    add_sampling_options,
    check_output_file,
    load_model,
    make_sampler,
)


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate from a compiled bundle",
                       description="Continue a prompt, or answer one chat turn (--chat). With --session, "
                                   "resume the sequence or conversation saved in FILE and save it there again.")
    p.add_argument("bundle", help="bundle directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="prompt text (needs a bundle with a tokenizer); "
                     "this or --prompt-ids is required")
    src.add_argument("--prompt-ids", metavar="IDS", help="comma-separated prompt token ids; the output is ids too")
    add_sampling_options(p, max_new_tokens=32, what="after the prompt")
    p.add_argument("--chat", action="store_true",
                   help="treat the prompt as a user message of a conversation in the model's chat template "
                        "(default: plain text)")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="with --chat: the system prompt of a new conversation (default: the template's own)")
    p.add_argument("--session", default=None, metavar="FILE",
                   help="continue the sequence (with --chat: the conversation) saved in FILE if it exists, "
                        "and save it there afterwards (default: none)")
    p.add_argument("--logits-out", default=None, metavar="FILE",
                   help="save every generated step's logits as float32 [steps, vocab] .npy (default: none)")
    add_load_options(p)
    p.set_defaults(func=run)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError as e:
        raise CliError(f"--prompt-ids must be comma-separated integers: {e}") from e


def run(args) -> int:
    if args.chat and args.prompt is None:
        raise CliError("--chat takes a --prompt (text), not --prompt-ids")
    if args.system is not None and not args.chat:
        raise CliError("--system needs --chat")
    ids = _parse_ids(args.prompt_ids) if args.prompt_ids is not None else None
    check_output_file(args.session)
    check_output_file(args.logits_out, "--logits-out")
    sampler = make_sampler(args)
    model = load_model(args)
    resume = args.session is not None and Path(args.session).exists()
    logits_log: list[np.ndarray] = []
    on_logits = logits_log.append if args.logits_out else None
    if args.chat:
        conversation = _open_conversation(args, model, resume)
        session, save = conversation.session, conversation.save
        stream = conversation.send(args.prompt, args.max_new_tokens, sampler, args.stop, on_logits=on_logits)
    else:
        session = model.session_from(args.session) if resume else model.session()
        save = session.save
        if ids is not None:
            stream = session.generate_ids(ids, args.max_new_tokens, sampler, on_logits=on_logits)
        else:
            stream = session.generate(args.prompt, args.max_new_tokens, sampler, args.stop, on_logits=on_logits)
    t0 = time.perf_counter()
    if args.prompt_ids is not None:
        print(",".join(str(t) for t in stream))
    else:
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
    sys.stdout.flush()  # the text before the stats line on stderr, also through a pipe
    dt = time.perf_counter() - t0
    usage = stream.usage
    print(f"[{usage.completion_tokens} tokens ({stream.finish_reason}) in {dt:.2f} s: "
          f"{usage.completion_tokens / dt:.1f} tokens/s incl. prefill of {usage.fed_tokens}]", file=sys.stderr)
    if args.session is not None:
        save(args.session)
        print(f"[session saved to {args.session}: {session.position} tokens]", file=sys.stderr)
    if args.logits_out:
        np.save(args.logits_out, np.stack(logits_log).astype(np.float32))
    return 0


def _open_conversation(args, model, resume: bool):
    """The conversation in --session FILE, or a new one."""
    from ..runtime import Conversation

    conversation = Conversation(model, system=args.system)
    if resume:
        conversation.load(args.session)
        if args.system is not None and args.system != conversation.system:
            raise CliError(f"--system: {args.session} holds a conversation with another system prompt "
                           "(it applies to a new conversation only)")
    return conversation

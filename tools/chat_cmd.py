"""foldline chat BUNDLE: talk with a chat model in the terminal, on runtime/conversation.py."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator

from ..errors import FoldlineError
from .run_options import (
    add_load_options,
    add_sampling_options,
    check_output_file,
    load_model,
    make_sampler,
)

HELP = """commands:
  /reset        forget the conversation (the system prompt stays)
  /save FILE    save the conversation (FILE and FILE.messages.json)
  /load FILE    continue a saved conversation
  /help         this list
  /exit         leave (also Ctrl-D, or Ctrl-C twice at the prompt)
Ctrl-C during an answer stops it; the conversation goes on."""


def add_parser(sub) -> None:
    p = sub.add_parser("chat", help="chat with a compiled chat model in the terminal",
                       description="An interactive chat on a bundle with a chat template: answers stream as "
                                   "they are generated, the conversation is kept (each turn feeds only its new "
                                   "tokens). Type /help for the commands.")
    p.add_argument("bundle", help="bundle directory (of a chat model: one with a chat template)")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="the system prompt (default: the template's own, if it has one)")
    p.add_argument("--load", default=None, metavar="FILE",
                   help="start from the conversation saved in FILE by /save (default: a new one)")
    add_sampling_options(p, max_new_tokens=512, what="per answer")
    add_load_options(p)
    p.set_defaults(func=run)


@contextlib.contextmanager
def _interrupts_call(handler: Callable[[], None]) -> Iterator[None]:
    """Within the block, Ctrl-C calls `handler` instead of raising KeyboardInterrupt."""
    previous = signal.signal(signal.SIGINT, lambda _sig, _frame: handler())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class ChatRepl:
    """The read-answer loop: one line in, a streamed answer out."""

    def __init__(self, conversation, args, out=sys.stdout, err=sys.stderr):
        self.conversation, self.args, self.out, self.err = conversation, args, out, err
        self.sampler = make_sampler(args)

    def say(self, text: str) -> None:
        print(text, file=self.err, flush=True)

    def loop(self, read: Callable[[str], str] = input) -> int:
        self.say(f"foldline chat: {self.args.bundle}. /help for commands; Ctrl-C stops an answer, Ctrl-D exits.")
        # Python leaves SIGINT ignored when it started so (a parent that ignores it, as a test runner's worker
        # may): Ctrl-C at the prompt must still reach the REPL.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.default_int_handler)
        interrupted = False
        while True:
            try:
                line = read("> ")
            except EOFError:
                print(file=self.out)
                return 0
            except KeyboardInterrupt:
                if interrupted:
                    print(file=self.out)
                    return 0
                interrupted = True
                self.say("\n(Ctrl-C again, /exit or Ctrl-D to leave)")
                continue
            interrupted = False
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                if self.command(text) == "exit":
                    return 0
                continue
            self.answer(text)

    def answer(self, text: str) -> None:
        stream = self.conversation.send(text, self.args.max_new_tokens, self.sampler, self.args.stop)
        try:
            with _interrupts_call(stream.cancel):
                for piece in stream:
                    self.out.write(piece)
                    self.out.flush()
        except FoldlineError as e:  # a full context, say: the conversation stays as it was
            self.say(f"\nerror: {e}")
            return
        self.out.write("\n")
        self.out.flush()
        if stream.finish_reason == "cancelled":
            self.say("[stopped]")
        elif stream.finish_reason == "length":
            self.say(f"[cut at {self.args.max_new_tokens} tokens: --max-new-tokens]")

    def command(self, text: str) -> str | None:
        name, _, arg = text.partition(" ")
        arg = arg.strip()
        if name in ("/exit", "/quit"):
            return "exit"
        if name == "/help":
            self.say(HELP)
        elif name == "/reset":
            self.conversation.reset()
            self.say("[conversation cleared]")
        elif name in ("/save", "/load"):
            if not arg:
                self.say(f"{name} needs a file name: {name} FILE")
                return None
            try:
                if name == "/save":
                    check_output_file(arg, "/save")
                    self.conversation.save(arg)
                    self.say(f"[saved to {arg}: {self.conversation.session.position} tokens, "
                             f"{len(self.conversation.messages)} messages]")
                else:
                    self.conversation.load(arg)
                    self.say(f"[loaded {arg}: {len(self.conversation.messages)} messages]")
            except (FoldlineError, OSError) as e:
                self.say(f"error: {e}")
        else:
            self.say(f"unknown command {name}; /help lists them")
        return None


def run(args) -> int:
    from ..runtime import Conversation

    make_sampler(args)  # bad sampling options are refused before the bundle loads
    model = load_model(args)
    with Conversation(model, system=args.system) as conversation:
        if args.load is not None:
            conversation.load(args.load)
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
        return ChatRepl(conversation, args).loop()

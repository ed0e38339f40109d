"""A chat on one session: messages in, streamed text out, each turn feeding only what is new.

The session holds the conversation's tokens. A turn renders the whole
conversation with the chat template (held messages + new ones, generation
prompt on) and encodes it (`chat.encode_messages`: message text stays text).
When those ids extend the ones the session holds, which is the rule for
templates like ChatML, only the extension is fed. When they do not (a template
that drops earlier turns, an answer cut by a stop string), the session keeps
the longest prefix its state serves exactly and feeds the rest: full caches
keep the prefix their prefill computed, rings and recurrent state start again
from zero (`Session.rewind_for`, the prompt cache's rules). Either way the
state is that of the template's tokens, never an approximation.

After an answer the session holds its tokens exactly as generated plus the
template's end-of-turn token (`<|im_end|>`), fed even when the answer was cut
by the token limit or cancelled, so the next turn's rendering extends it.

A saved conversation is two files: the session file (`Session.save`) and,
beside it, `<file>.messages.json` with the messages and a hash of the tokens
they belong to, so a messages file is never paired with another session file.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ..contract.errors import BundleError
from ..errors import FoldlineError
from .chat import ChatTemplateError, check_messages, encode_messages, end_of_turn_id
from .checks import ClosedOnExit, ContextFullError
from .generation import Generation
from .sampling import Sampler
from .session_file import write_private_atomically

MESSAGES_FORMAT = "foldline-conversation"
MESSAGES_VERSION = 1


class ConversationFileError(FoldlineError, ValueError):
    """A saved conversation whose messages file is missing, unreadable or belongs to another session file."""


def messages_path(path: str | Path) -> Path:
    """Where the messages of the conversation saved in `path` are kept."""
    path = Path(path)
    return path.with_name(path.name + ".messages.json")


def _tokens_sha256(tokens: Sequence[int]) -> str:
    return hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()


class Conversation(ClosedOnExit):
    """A chat with a loaded Model that has a chat template.

    ```python
    chat = Conversation(model, system="Be brief.")
    for piece in (answer := chat.send("My name is Ada.", max_new_tokens=64)):
        print(piece, end="")
    answer.finish_reason, answer.usage   # "stop" / "length" / "cancelled"; token counts
    chat.save("chat.session"); chat.load("chat.session")
    ```

    allow_control_tokens: encode control-token text typed in a message as control tokens
    (trusted callers only); by default it stays text.
    """

    def __init__(self, model: Any, system: str | None = None, *, allow_control_tokens: bool = False,
                 session: Any = None):
        if not model.manifest.chat_template:
            raise BundleError(f"bundle {model.manifest.root} has no chat template: it is a base model, "
                              "not a chat model; prompt it with `foldline generate` (without --chat)")
        self.model = model
        self.session = session if session is not None else model.session()
        self.system = system
        self.allow_control_tokens = allow_control_tokens
        self.end_of_turn = end_of_turn_id(model)
        self.messages: list[dict[str, str]] = self._opening()

    def _opening(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system}] if self.system else []

    def close(self) -> None:
        """Free the session's state buffers."""
        self.session.close()

    # ---- turns -----------------------------------------------------------------------------------
    def encode(self, new_messages: list[dict[str, str]]) -> list[int]:
        """The token ids of the conversation with `new_messages` added and the assistant's turn opened."""
        return encode_messages(self.model, self.messages + new_messages, add_generation_prompt=True,
                               allow_control_tokens=self.allow_control_tokens)

    def send(self, message: str | dict[str, str] | list[dict[str, str]], max_new_tokens: int = 256,
             sampler: Sampler | None = None, stop_strings: Sequence[str] = (), on_logits=None) -> Generation[str]:
        """Add a user message (a string) or messages, and stream the assistant's answer.

        The returned generation yields text pieces; once it ends (or is closed or cancelled) the
        new messages and the answer are in `messages`, and it carries `finish_reason` and `usage`
        (prompt_tokens: the whole conversation so far; cached_tokens: those not fed again).
        on_logits: called with each step's logits before its token is sampled.
        """
        if isinstance(message, str):
            message = {"role": "user", "content": message}
        new = check_messages([message] if isinstance(message, dict) else message)
        if not new:
            raise ChatTemplateError("send() needs at least one message")
        prompt = self.encode(new)
        held = self.session.tokens
        if self.session.broken or self.session.pending_token is not None or prompt[: len(held)] != held \
                or len(prompt) == len(held):
            self.session.rewind_for(prompt)
        stops = set(self.model.eos_token_ids) | ({self.end_of_turn} if self.end_of_turn is not None else set())
        answer = self.session.stream_text(prompt[self.session.position :], max_new_tokens, sampler, stop_strings,
                                          on_logits=on_logits, stop_ids=tuple(stops))

        def run(gen: Generation[str]) -> Iterator[str]:
            pieces: list[str] = []
            try:
                for piece in answer:
                    pieces.append(piece)
                    yield piece
            finally:
                answer.close()
                if answer.usage.prompt_tokens:  # the prompt went in: the turn happened
                    gen.finish_reason = answer.finish_reason or "cancelled"  # or closed before its end
                    self._end_turn(new, "".join(pieces))

        return Generation(run, inner=answer)

    def _end_turn(self, new: list[dict[str, str]], answer: str) -> None:
        """Record the turn and close it in the session with the end-of-turn token."""
        self.messages += [*new, {"role": "assistant", "content": answer}]
        session = self.session
        if session.broken or session.closed:
            return  # the next turn starts the session again from its messages
        pending = session.pending_token
        if pending is not None and pending != self.end_of_turn and pending in self.model.eos_token_ids:
            session.drop_pending()  # another stop token: the template closes the turn with its own
        try:
            if self.end_of_turn is None or session.pending_token == self.end_of_turn:
                session.feed_pending()
            else:
                session.decode(self.end_of_turn)
        except ContextFullError:
            pass  # no room for it: the next turn says the context is full

    # ---- whole conversations ---------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every turn (the system prompt stays)."""
        self.session.reset()
        self.messages = self._opening()

    def save(self, path: str | Path) -> Path:
        """Store the conversation: the session in `path`, the messages in `<path>.messages.json`."""
        path = self.session.save(path)
        record = {"format": MESSAGES_FORMAT, "version": MESSAGES_VERSION, "messages": self.messages,
                  "tokens_sha256": _tokens_sha256(self.session.tokens)}
        text = json.dumps(record, ensure_ascii=False, indent=1).encode()
        write_private_atomically(messages_path(path), lambda f: f.write(text))  # owner-only, as the session file
        return path

    def load(self, path: str | Path) -> None:
        """Continue the conversation saved in `path` (by `save`); refuses files of another model."""
        messages = read_messages(path)
        snap = self.model.read_snapshot(path)
        if messages[1] != _tokens_sha256(snap.tokens):
            raise ConversationFileError(f"{messages_path(path)} holds the messages of another session than {path}")
        self.session.restore(snap)
        self.messages = messages[0]
        system = [m["content"] for m in self.messages[:1] if m["role"] == "system"]
        self.system = system[0] if system else None


def read_messages(path: str | Path) -> tuple[list[dict[str, str]], str]:
    """The messages saved beside session file `path` and the hash of the tokens they belong to."""
    target = messages_path(path)
    if not Path(path).is_file():
        raise ConversationFileError(f"conversation file {path} does not exist")
    if not target.is_file():
        raise ConversationFileError(f"{path} holds no conversation: {target} is missing "
                                    "(a session saved by a plain generate, not a chat)")
    try:
        record = json.loads(target.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversationFileError(f"{target} is not a readable conversation file: {e}") from e
    if not isinstance(record, dict) or record.get("format") != MESSAGES_FORMAT:
        raise ConversationFileError(f"{target} is not a foldline conversation file")
    if record.get("version") != MESSAGES_VERSION:
        raise ConversationFileError(f"{target} has conversation format version {record.get('version')}; "
                                    f"this runtime reads version {MESSAGES_VERSION}")
    try:
        messages = check_messages(record.get("messages"))
    except ChatTemplateError as e:
        raise ConversationFileError(f"{target}: {e}") from e
    return messages, str(record.get("tokens_sha256"))

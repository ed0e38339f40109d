"""A chat loop: each line on standard input is a user turn; answers stream as they are generated."""

import sys

from foldline.runtime import Conversation, Model

bundle = sys.argv[1] if len(sys.argv) > 1 else "bundles/smollm2-135m"

with Model.load(bundle) as model:
    chat = Conversation(model, system="You are a helpful assistant. Answer in one sentence.")
    for line in sys.stdin:
        if not line.strip():
            continue
        answer = chat.send(line.strip(), max_new_tokens=48)
        for piece in answer:
            print(piece, end="", flush=True)
        print()
        # why it ended ("stop": end of turn; "length": the token limit) and what it cost
        print(f"[{answer.finish_reason}: {answer.usage.fed_tokens} tokens fed, "
              f"{answer.usage.completion_tokens} generated]", file=sys.stderr)
    print(f"{len(chat.messages)} messages, {chat.session.position} tokens held", file=sys.stderr)

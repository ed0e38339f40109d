"""Stream text with stop strings and sampling; no part of a stop string is ever printed."""

import sys

from foldline.runtime import Model, Sampler

bundle = sys.argv[1] if len(sys.argv) > 1 else "bundles/smollm2-135m"

with Model.load(bundle) as model:
    session = model.session()
    sampler = Sampler(temperature=0.7, top_k=40, top_p=0.95, seed=1)
    pieces = session.generate("Count: 1, 2, 3,", max_new_tokens=40, sampler=sampler, stop_strings=[" 7", "\n"])
    text = ""
    for piece in pieces:  # exact UTF-8 pieces as they become complete
        text += piece
        print(piece, end="", flush=True)
    print()
    assert " 7" not in text and "\n" not in text
    print(f"finish_reason={pieces.finish_reason} completion_tokens={pieces.usage.completion_tokens}",
          file=sys.stderr)

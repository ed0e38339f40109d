"""Embed the runtime in an app: load a bundle, generate, save the session and resume it later."""

import sys
import tempfile
from pathlib import Path

from foldline.runtime import Model

bundle = sys.argv[1] if len(sys.argv) > 1 else "bundles/smollm2-135m"

with Model.load(bundle, device="cpu") as model:
    session = model.session()  # owns its state buffers on the device
    first = "".join(session.generate("The capital of France is", max_new_tokens=8))
    print("first:", first)

    path = Path(tempfile.mkdtemp()) / "app.session"
    session.save(path)  # only the positions held: a few MB for a chat
    more = "".join(session.generate(" It is also", max_new_tokens=8))  # continues the same sequence

    resumed = model.session_from(path)  # e.g. after the app restarts
    again = "".join(resumed.generate(" It is also", max_new_tokens=8))
    assert again == more, (again, more)  # greedy: the resumed session continues exactly
    print("continued:", more)

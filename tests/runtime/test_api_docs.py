"""docs/api.md: generated from the runtime's docstrings, never stale; its examples run as written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "docs" / "examples"


def test_api_reference_is_current() -> None:
    """The committed docs/api.md equals what the generator writes from today's docstrings."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_api_docs.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_api_reference_covers_the_runtime() -> None:
    """Every public name of foldline.runtime that an app calls is documented, with its examples inlined."""
    text = (ROOT / "docs" / "api.md").read_text()
    for name in ("Model", "Session", "Batch", "Conversation", "Sampler", "Generation", "Usage", "stream_pieces"):
        assert f"### `{name}`" in text, name
    for example in EXAMPLES.glob("*.py"):
        assert example.read_text().rstrip() in text, example.name


def _run_example(name: str, bundle: Path, tmp_path: Path, stdin: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ""}
    return subprocess.run([sys.executable, str(EXAMPLES / name), str(bundle)], input=stdin, capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=600)


@pytest.mark.slow
@pytest.mark.realmodel
def test_examples_run_as_written(gguf_bundles, tmp_path: Path) -> None:
    """Each example of docs/api.md, run unchanged on the SmolLM2 bundle, finishes and says what it claims."""
    bundle = gguf_bundles("smollm2-135m")

    embed = _run_example("embed.py", bundle, tmp_path)
    assert embed.returncode == 0, embed.stderr
    assert embed.stdout.startswith("first: ") and "continued: " in embed.stdout

    chat = _run_example("chat_loop.py", bundle, tmp_path, "My name is Ada.\n\nWhat is my name?\n")
    assert chat.returncode == 0, chat.stderr
    outcomes = [line for line in chat.stderr.splitlines() if line.startswith("[")]
    assert len(outcomes) == 2 and all(o.split(":")[0] in ("[stop", "[length") for o in outcomes), chat.stderr
    assert "5 messages" in chat.stderr  # system + two user turns + two answers
    fed = [int(o.split(": ")[1].split(" tokens fed")[0]) for o in outcomes]
    assert fed[1] < fed[0], outcomes  # the second turn fed its own message, not the conversation again

    stream = _run_example("stream_stop.py", bundle, tmp_path)
    assert stream.returncode == 0, stream.stderr
    assert "finish_reason=" in stream.stderr

"""Real GGUF models: prompts, cached bundles and HF transformers reference outputs.

Compiling a real model and loading it into HF transformers take minutes on a
small CPU, so both are cached on disk under $FOLDLINE_CACHE (default
~/.cache/foldline):

- compiled/<key>: the compile cache (backends/compile_cache.py), keyed by the
  model file, the options and every foldline source file that shapes the
  bundle, so any change to the compiler rebuilds it;
- reference/<model>-<hash>.npz: HF's tokens and logits, keyed by the model
  file, the transformers version and the prompts. FOLDLINE_REFRESH_REFERENCE=1
  recomputes them.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from foldline.bench.prompts import LONG_TEXT, PROMPTS  # noqa: F401  (one list for the tests and the bench)

REPO = Path(__file__).resolve().parents[2]
N_NEW = 16

TOKENIZER_TEXTS = [
    "The capital of France is",
    "Hello, world! How are you?",
    "  leading, trailing and   repeated spaces  ",
    "naïve café, 東京 and Zürich 🙂 with émoji",
    "numbers 12345 and 3.14159, year 2024; 1,000,000",
    "line one\nline two\n\n\ttabbed\r\nwindows",
    "<start_of_turn>user\nhi<end_of_turn>\n<|im_start|>assistant\nyo<|im_end|>",
    "def f(x):\n    return x**2  # squared",
    "Ünïcödé ß ﬁ \u00a0non-breaking \u2581 lower-one-eighth block",
]


def _digest(*parts: Any) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(repr(part).encode())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    from foldline.frontend.shipped import cache_dir

    return cache_dir()


def model_file_key(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return (path.name, st.st_size, int(st.st_mtime))


def compiled_bundle(name: str, loaded: Any, out: Path) -> Path:
    """The default bundle of a shipped model in `out`, from the compile cache when its inputs are unchanged."""
    from foldline.backends.build import BuildOptions, compile_model
    from foldline.backends.compile_cache import CompileCache

    return compile_model(loaded, out, BuildOptions(), progress=lambda _msg: None, cache=CompileCache())


def _hf_dir_and_file(name: str) -> tuple[str, str]:
    from foldline.frontend.shipped import locate_shipped

    path = locate_shipped(name)
    return str(path.parent), path.name


def hf_tokenizer(name: str) -> Any:
    from transformers import AutoTokenizer

    directory, fname = _hf_dir_and_file(name)
    return AutoTokenizer.from_pretrained(directory, gguf_file=fname)


def hf_reference(name: str, get_tokenizer: Callable[[str], Any]) -> dict[str, Any]:
    """HF transformers eager (fp32) on each prompt: prompt ids, greedy ids, logits at every greedy step."""
    from foldline.frontend.shipped import locate_shipped

    prompts = PROMPTS[name]
    key = _digest(model_file_key(locate_shipped(name)), metadata.version("transformers"), prompts, N_NEW)
    path = cache_root() / "reference" / f"{name}-{key}.npz"
    if path.is_file() and not os.environ.get("FOLDLINE_REFRESH_REFERENCE"):
        with np.load(path) as z:
            meta = json.loads(str(z["meta"]))
            return {"prompts": meta, "logits": [z[f"logits{i}"] for i in range(len(meta))]}

    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = get_tokenizer(name)
    directory, fname = _hf_dir_and_file(name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=fname, dtype=torch.float32).eval()
    meta, logits = [], []
    with torch.no_grad():
        for text in prompts:
            ids = tokenizer(text, add_special_tokens=True)["input_ids"]
            out = model(torch.tensor([ids]), use_cache=True)
            steps = [out.logits[0, -1].float().numpy()]
            greedy: list[int] = []
            for _ in range(N_NEW):
                token = int(np.argmax(steps[-1]))
                greedy.append(token)
                out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
                steps.append(out.logits[0, -1].float().numpy())
            meta.append({"text": text, "ids": ids, "greedy": greedy})
            logits.append(np.stack(steps[:N_NEW]))  # logits that chose each greedy token
    del model
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, meta=json.dumps(meta), **{f"logits{i}": arr for i, arr in enumerate(logits)})
    return {"prompts": meta, "logits": logits}


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return float(a64 @ b64 / (np.linalg.norm(a64) * np.linalg.norm(b64)))

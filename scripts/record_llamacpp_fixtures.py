"""Record llama.cpp's outputs on foldline's fixed prompts as small JSON test fixtures.

Run with a Python that has llama-cpp-python (CI does not build it; the
fixtures are the record):

    /opt/llamacpp-venv/bin/python scripts/record_llamacpp_fixtures.py \\
        --gguf smollm2-135m=PATH/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --gguf gemma3-270m=PATH/gemma-3-270m-q4_k_m.gguf

Print a shipped model's path with
`python -c 'from foldline.frontend.shipped import locate_shipped as l; print(l("gemma3-270m"))'`.

For every prompt of tests/helpers/gguf_reference.py it stores llama.cpp's prompt
tokenization (BOS as the file asks), its greedy continuation, and for the last
prompt position and each continuation step the top-1 id plus the top-5 ids and
logits. tests/e2e/test_gguf_models.py feeds the same tokens to a compiled bundle.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import time
from pathlib import Path

import numpy as np
from llama_cpp import Llama, __version__

REPO = Path(__file__).resolve().parent.parent
TOP = 5


def _reference_module():
    spec = importlib.util.spec_from_file_location("gguf_reference", REPO / "tests" / "helpers" / "gguf_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record(name: str, path: Path, prompts: list[str], n_new: int, threads: int) -> dict:
    n_ctx = 1024 if name.startswith("gemma") else 512
    llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                logits_all=True, verbose=False, seed=0)
    out = {
        "model": name,
        "gguf": path.name,
        "llama_cpp_python": __version__,
        "machine": platform.machine(),
        "threads": threads,
        "prompts": [],
    }
    for text in prompts:
        llm.reset()
        ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
        t0 = time.perf_counter()
        llm.eval(ids)
        steps = [np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)]
        continuation: list[int] = []
        for _ in range(n_new):
            token = int(np.argmax(steps[-1]))
            continuation.append(token)
            if len(continuation) == n_new:
                break
            llm.eval([token])
            steps.append(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32))
        order = [np.argsort(s)[::-1][:TOP] for s in steps]
        out["prompts"].append({
            "text": text,
            "ids": [int(t) for t in ids],
            "continuation": continuation,
            "continuation_text": llm.detokenize(continuation).decode("utf-8", errors="replace"),
            "top1": [int(o[0]) for o in order],
            "top_ids": [[int(i) for i in o] for o in order],
            "top_logits": [[round(float(s[i]), 4) for i in o] for s, o in zip(steps, order)],
            "seconds": round(time.perf_counter() - t0, 2),
        })
        print(f"{name}: {len(ids)} prompt tokens -> {out['prompts'][-1]['continuation_text']!r}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", action="append", required=True, metavar="NAME=PATH",
                        help="shipped model name and its GGUF file (repeat)")
    parser.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    ref = _reference_module()
    args.out.mkdir(parents=True, exist_ok=True)
    for item in args.gguf:
        name, _, file = item.partition("=")
        if name not in ref.PROMPTS:
            parser.error(f"unknown model {name!r}; known: {', '.join(ref.PROMPTS)}")
        data = record(name, Path(file), ref.PROMPTS[name], ref.N_NEW, args.threads)
        target = args.out / f"llamacpp_{name}.json"
        target.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How close ONNX Runtime GenAI's own export of a shipped model stays to HF transformers eager.

    .venv/bin/python scripts/ort_genai_accuracy.py MODEL GENAI_DIR --genai-python PYTHON

MODEL is a shipped model (smollm2-135m, gemma3-270m), GENAI_DIR the folder
scripts/build_ort_genai_peer.py made of it. GenAI's generator is fed the HF
reference's prompt ids, then its greedy tokens one at a time (teacher forcing),
and its logits at every step are held to HF eager's float32 logits with the
measures foldline's golden tests use (tests/e2e/test_gguf_models.py): the worst
cosine and on how many steps the top-1 agrees. The HF reference is the one the
tests cache (tests/helpers/gguf_reference.py); the bench compares speed, this compares
what the speed buys.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from helpers.gguf_reference import cosine, hf_reference, hf_tokenizer  # noqa: E402

# Runs in the GenAI interpreter: the logits after the prompt, then after each forced token.
_GENAI = """
import json, sys
import numpy as np
import onnxruntime_genai as og
args = json.loads(sys.argv[1])
model = og.Model(args["model"])
params = og.GeneratorParams(model)
params.set_search_options(max_length=args["max_length"], do_sample=False)
out = {}
for i, (ids, forced) in enumerate(args["prompts"]):
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    steps = [np.asarray(gen.get_logits()).reshape(-1)]
    for token in forced:
        gen.append_tokens([token])
        steps.append(np.asarray(gen.get_logits()).reshape(-1))
    out[f"logits{i}"] = np.stack(steps)
np.savez(args["out"], **out)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a shipped model: smollm2-135m or gemma3-270m")
    ap.add_argument("genai_dir", type=Path, help="the folder scripts/build_ort_genai_peer.py wrote")
    ap.add_argument("--genai-python", default=sys.executable, help="interpreter with onnxruntime-genai")
    a = ap.parse_args()
    ref = hf_reference(a.model, hf_tokenizer)
    prompts = [(p["ids"], p["greedy"][:-1]) for p in ref["prompts"]]
    longest = max(len(ids) + len(forced) for ids, forced in prompts)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "genai.npz"
        args = {"model": str(a.genai_dir), "prompts": prompts, "out": str(out),
                "max_length": max(1024, longest + 8)}  # Gemma's window layers need a window's capacity
        done = subprocess.run([a.genai_python, "-c", _GENAI, json.dumps(args)], capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return done.returncode
        with np.load(out) as z:
            ours = [z[f"logits{i}"] for i in range(len(prompts))]
    worst, agree, total = 1.0, 0, 0
    for i, (genai, hf) in enumerate(zip(ours, ref["logits"])):
        for x, y in zip(genai, hf):
            worst = min(worst, cosine(x, y))
            agree += int(np.argmax(x)) == int(np.argmax(y))
            total += 1
        print(f"prompt {i} ({len(prompts[i][0])} tokens): worst cosine so far {worst:.4f}")
    print(f"ONNX Runtime GenAI ({a.genai_dir}) against HF eager on {a.model}: worst cosine {worst:.4f}, "
          f"top-1 agrees on {agree}/{total} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`foldline bench --accuracy`: how close each engine's logits stay to HF transformers eager (float32).

Measured once per engine, outside the timed rounds: every engine is fed the
reference's prompt ids, then the reference's greedy tokens one at a time
(teacher forcing, so one engine's miss does not change what the next step
sees), and its logits at every step are held to HF eager's with the golden
tests' measures: the worst and mean cosine, and on how many steps the top-1
token agrees. The prompts are the shipped models' fixed prompts
(bench/prompts.py); the reference is computed once per model file and
transformers version and cached under $FOLDLINE_CACHE/reference, or read from
a file given to `--accuracy`.

Each engine runs in a child process (bench/child.py) and writes its logits to
an .npz file; ONNX Runtime GenAI's are read with `Generator.get_output("logits")`.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from ..frontend.shipped import SHIPPED, cache_dir
from .child import BenchError, run_foldline, run_script
from .prompts import PROMPTS

# Greedy tokens per prompt: steps scored per prompt (the prompt's own logits, then one per forced token).
NEW_TOKENS = 16

# A reference: per prompt its ids and HF's greedy tokens, and HF's logits at each step.
Reference = dict[str, Any]
# An engine's logits: (prompts: [(ids, forced tokens)], out .npz path) -> writes logits0, logits1, ...
LogitsRunner = Callable[[list[tuple[list[int], list[int]]], str], None]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The cosine of two logit vectors, in float64."""
    a64, b64 = np.asarray(a, np.float64).reshape(-1), np.asarray(b, np.float64).reshape(-1)
    return float(a64 @ b64 / (np.linalg.norm(a64) * np.linalg.norm(b64)))


def score(reference: list[np.ndarray], logits: list[np.ndarray]) -> dict[str, Any]:
    """An engine's logits (per prompt, [steps, vocab]) against the reference's: worst and mean cosine, top-1
    agreement. A prompt with a different step count or vocabulary is refused: it would score other steps."""
    if len(reference) != len(logits):
        raise BenchError(f"accuracy: {len(logits)} prompts' logits against {len(reference)} in the reference")
    cosines, agree = [], 0
    for i, (ref, ours) in enumerate(zip(reference, logits)):
        if ref.shape != ours.shape:
            raise BenchError(f"accuracy: prompt {i} gave logits of shape {tuple(ours.shape)}, the reference "
                             f"{tuple(ref.shape)}")
        for x, y in zip(ours, ref):
            cosines.append(cosine(x, y))
            agree += int(np.argmax(x) == np.argmax(y))
    return {"cosine_worst": min(cosines), "cosine_mean": float(np.mean(cosines)), "top1_agree": agree,
            "steps": len(cosines)}


def shipped_name(gguf: str) -> str | None:
    """The shipped model a GGUF file is, by its file name (None: not a shipped model)."""
    return next((n for n, m in SHIPPED.items() if Path(gguf).name == m.filename), None)


def teacher_forced(reference: Reference) -> list[tuple[list[int], list[int]]]:
    """What every engine is fed: each prompt's ids, then HF's greedy tokens but the last (whose logits are not
    scored)."""
    return [(p["ids"], p["greedy"][:-1]) for p in reference["prompts"]]


def save_reference(path: Path, reference: Reference) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, meta=json.dumps(reference["prompts"]),
             **{f"logits{i}": np.asarray(a, np.float32) for i, a in enumerate(reference["logits"])})


def load_reference(path: str | Path) -> Reference:
    """A reference file: `meta` (JSON: per prompt `ids` and `greedy`) and `logits0`, `logits1`, ... [steps, vocab],
    one step per greedy token."""
    try:
        with np.load(path) as z:
            prompts = json.loads(str(z["meta"]))
            logits = [z[f"logits{i}"] for i in range(len(prompts))]
    except (OSError, KeyError, ValueError) as e:
        raise BenchError(f"--accuracy {path}: not a reference file (meta and logits0, ... as bench/accuracy.py "
                         f"writes): {e}") from e
    for i, (p, steps) in enumerate(zip(prompts, logits)):
        if not p.get("ids") or steps.ndim != 2 or steps.shape[0] != len(p.get("greedy", [])):
            raise BenchError(f"--accuracy {path}: prompt {i} needs ids and one logits row per greedy token")
    return {"prompts": prompts, "logits": logits}


_HF_REFERENCE = '''
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

path = Path(args["gguf"])
tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
meta, out = [], {}
with torch.no_grad():
    for i, text in enumerate(args["texts"]):
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        result = model(torch.tensor([ids]), use_cache=True)
        steps, greedy = [result.logits[0, -1].float().numpy()], []
        for _ in range(args["new_tokens"]):
            greedy.append(int(np.argmax(steps[-1])))
            result = model(torch.tensor([[greedy[-1]]]), past_key_values=result.past_key_values, use_cache=True)
            steps.append(result.logits[0, -1].float().numpy())
        meta.append({"text": text, "ids": ids, "greedy": greedy})
        out[f"logits{i}"] = np.stack(steps[:-1])  # the logits that chose each greedy token
np.savez(args["out"], meta=json.dumps(meta), **out)
print("BENCH " + json.dumps({"prompts": len(meta)}))
'''


def hf_reference(gguf: str) -> Reference:
    """HF transformers eager (float32) on a shipped model's prompts: cached per model file and transformers
    version; computed in a child process (the bench's own process never imports torch)."""
    name = shipped_name(gguf)
    if name is None:
        raise BenchError(f"--accuracy: {Path(gguf).name} is not a shipped model ({', '.join(SHIPPED)}), whose "
                         "prompts it scores; give a reference file: --accuracy REF.npz")
    try:
        transformers = metadata.version("transformers")
    except metadata.PackageNotFoundError as e:
        raise BenchError("--accuracy computes its HF reference with transformers, which is not installed: "
                         "pip install 'foldline[compiler]' transformers, or give a reference file") from e
    st = Path(gguf).stat()
    key = hashlib.sha256(repr((Path(gguf).name, st.st_size, int(st.st_mtime), transformers, PROMPTS[name],
                               NEW_TOKENS)).encode()).hexdigest()[:16]
    path = cache_dir() / "reference" / f"bench-{name}-{key}.npz"
    if not path.is_file():
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "reference.npz"
            run_script(_HF_REFERENCE, {"gguf": str(gguf), "texts": PROMPTS[name], "new_tokens": NEW_TOKENS,
                                       "out": str(out)}, "HF eager (accuracy reference)")
            reference = load_reference(out)
        save_reference(path, reference)
    return load_reference(path)


_GENAI_LOGITS = '''
import onnxruntime_genai as og

config = og.Config(args["model"])
model = og.Model(config)
params = og.GeneratorParams(model)
params.set_search_options(max_length=args["max_length"], do_sample=False)
out = {}

def last(logits):
    logits = np.asarray(logits)
    return logits.reshape(-1, logits.shape[-1])[-1].astype(np.float32)  # [batch, tokens, vocab]: the last token's

for i, (ids, forced) in enumerate(args["prompts"]):
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    steps = [last(gen.get_output("logits"))]
    for token in forced:
        gen.append_tokens([token])
        steps.append(last(gen.get_output("logits")))
    out[f"logits{i}"] = np.stack(steps)
    del gen
np.savez(args["out"], **out)
print("BENCH " + json.dumps({"prompts": len(out)}))
'''


def genai_logits(model_dir: str, python: str | None, max_length: int) -> LogitsRunner:
    """ONNX Runtime GenAI on a model folder: its logits by `Generator.get_output("logits")`."""
    def run(prompts: list[tuple[list[int], list[int]]], out: str) -> None:
        longest = max(len(ids) + len(forced) for ids, forced in prompts)
        run_script(_GENAI_LOGITS, {"model": model_dir, "prompts": prompts, "out": out,
                                   "max_length": max(max_length, longest + 8)},
                   "ONNX Runtime GenAI (accuracy)", python, peer=True)
    return run


def bundle_logits(bundle: str, device: str, cpu: str | None) -> LogitsRunner:
    """A foldline bundle through the runtime, in a child process."""
    def run(prompts: list[tuple[list[int], list[int]]], out: str) -> None:
        run_foldline("accuracy", "write_bundle_logits", {"bundle": bundle, "device": device, "cpu": cpu,
                                                         "prompts": prompts, "out": out})
    return run


def write_bundle_logits(bundle: str, device: str, cpu: str | None, prompts: list[tuple[list[int], list[int]]],
                        out: str) -> dict[str, Any]:
    """Runs in the child process: each prompt in a fresh session, its logits after the prompt and each forced
    token, to `out`."""
    from ..runtime import Model

    model = Model.load(bundle, device=device, verify=False, **({"cpu": cpu} if device == "cpu" and cpu else {}))
    arrays = {}
    for i, (ids, forced) in enumerate(prompts):
        session = model.session()
        steps = [np.asarray(session.prefill(ids), np.float32).reshape(-1)]
        steps += [np.asarray(session.decode(t), np.float32).reshape(-1) for t in forced]
        arrays[f"logits{i}"] = np.stack(steps)
    model.close()
    np.savez(out, **arrays)
    return {"prompts": len(arrays)}


def measure(runners: dict[str, LogitsRunner], reference: Reference) -> dict[str, dict[str, Any]]:
    """Each engine's scores against the reference, one engine after the other (not timed)."""
    prompts = teacher_forced(reference)
    scores = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, run in runners.items():
            out = str(Path(tmp) / f"{len(scores)}.npz")
            run(prompts, out)
            with np.load(out) as z:
                logits = [z[f"logits{i}"] for i in range(len(prompts))]
            scores[name] = score(reference["logits"], logits)
    return scores

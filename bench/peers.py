"""The engines `foldline bench` measures foldline against, each in its own child process.

- llama.cpp on the same GGUF, through llama-cpp-python. It is not a foldline
  dependency: `--llama-python` names an interpreter that has it (its own venv,
  built without AMX on hosts where llama.cpp's AMX path crashes; see
  docs/benchmarks.md). The child script imports nothing from foldline.
- HF transformers eager on the same GGUF (`from_pretrained(..., gguf_file=...)`,
  dequantized to float32) or HF directory.
- ONNX Runtime GenAI on model folders of the same checkpoint: those its own
  builder made (scripts/build_ort_genai_peer.py: its graphs, its fused ops and
  its KV buffer shared between past and present) and foldline's
  `--target onnx-genai` export, one engine per folder. Like llama-cpp-python
  it is not a foldline dependency: `--genai-python` names an interpreter that
  has it.

Every engine gets the same prompt ids and the same warm-up, prefills them at
once, then decodes greedily one token at a time (bench/timer.run_engine);
wall-clock and process CPU time are taken around each phase, and peak RSS is
the child's own VmHWM (bench/child.py). Whatever starts a conversation (a
reset cache, GenAI's generator) is done before the timer starts. The scripts
import nothing from foldline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .child import run_script

_LLAMA_CPP = '''
import ctypes
import inspect
from importlib.metadata import version

import llama_cpp
import numpy as np
from llama_cpp import Llama

ids, new_tokens, threads = args["ids"], args["new_tokens"], args["threads"]
t0 = time.perf_counter()
needed = len(ids) + new_tokens + 8
# The context the bundle was compiled for, so both engines hold caches of the same capacity.
n_ctx = max(args.get("n_ctx") or needed, needed)
# As llama-server runs it: flash attention on, and sliding-window layers holding only their window
# (swa_full off). llama-cpp-python defaults to neither; versions name the switches differently.
params = inspect.signature(Llama.__init__).parameters
settings = {}
if "flash_attn" in params:
    settings["flash_attn"] = True
if "swa_full" in params:
    settings["swa_full"] = False
llm = Llama(model_path=args["gguf"], n_ctx=n_ctx, n_batch=needed, n_ubatch=min(needed, 512), n_threads=threads,
            n_threads_batch=threads, logits_all=False, verbose=False, **settings)
load_s = time.perf_counter() - t0
n_vocab = llm.n_vocab()

def last_logits():
    # The logits of the last evaluated token, read from the context (with logits_all off, Llama.eval
    # does not copy them into Llama.scores).
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,)).copy()

def prefill(tokens):
    llm.eval(tokens)
    return last_logits()

def decode(token):
    llm.eval([token])
    return last_logits()

llm.reset()
out = run_engine(prefill, decode, llm.reset, ids, new_tokens)  # reset: the cache emptied past position 0
out.update(load_s=load_s, **peak_rss(), threads=threads, version=version("llama-cpp-python"),
           settings={**settings, "n_ctx": n_ctx, "logits": "llama_get_logits_ith"})
print("BENCH " + json.dumps(out))
'''

_HF_EAGER = '''
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

ids, new_tokens, threads = args["ids"], args["new_tokens"], args["threads"]
torch.set_num_threads(threads)
path = Path(args["model"])
t0 = time.perf_counter()
if path.suffix == ".gguf":
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
else:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
model.eval()
load_s = time.perf_counter() - t0
state = {}

@torch.no_grad()
def prefill(tokens):
    out = model(torch.tensor([tokens]), past_key_values=state.get("past"), use_cache=True)
    state["past"] = out.past_key_values
    return out.logits[0, -1].float().numpy()

@torch.no_grad()
def decode(token):
    out = model(torch.tensor([[token]]), past_key_values=state["past"], use_cache=True)
    state["past"] = out.past_key_values
    return out.logits[0, -1].float().numpy()

out = run_engine(prefill, decode, state.clear, ids, new_tokens)
out.update(load_s=load_s, **peak_rss(), threads=threads, version=transformers.__version__)
print("BENCH " + json.dumps(out))
'''

_ORT_GENAI = '''
import gc
from importlib.metadata import version

import onnxruntime_genai as og

ids, new_tokens, threads = args["ids"], args["new_tokens"], args["threads"]
t0 = time.perf_counter()
config = og.Config(args["model"])
# The same thread count as every engine's.
config.overlay(json.dumps({"model": {"decoder": {"session_options": {
    "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
model = og.Model(config)
params = og.GeneratorParams(model)
# The KV capacity of the bundle's context, as llama.cpp's n_ctx: GenAI allocates max_length slots.
n_ctx = max(args.get("n_ctx") or 0, len(ids) + new_tokens + 8)
params.set_search_options(max_length=n_ctx, do_sample=False)
load_s = time.perf_counter() - t0
state = {}

def fresh():
    # A generator allocates (and zeroes) its max_length cache: set-up, built before the timer starts, and the
    # previous one freed first, so one cache counts toward the peak RSS, as one conversation holds.
    state.pop("gen", None)
    gc.collect()
    state["gen"] = og.Generator(model, params)

def prefill(tokens):
    state["gen"].append_tokens(tokens)
    return np.asarray(state["gen"].get_logits()).reshape(-1)

def decode(token):
    state["gen"].append_tokens([token])
    return np.asarray(state["gen"].get_logits()).reshape(-1)

fresh()
out = run_engine(prefill, decode, fresh, ids, new_tokens)
out.update(load_s=load_s, **peak_rss(), threads=threads, version=version("onnxruntime-genai"),
           settings={"max_length": n_ctx, "model": args["model"]})
print("BENCH " + json.dumps(out))
'''


# Every ONNX Runtime GenAI folder's engine name starts with this (`ORT GenAI int8`), and the record
# scripts/build_ort_genai_peer.py writes beside a folder it built says how.
GENAI_PREFIX = "ORT GenAI "
PEER_BUILD_RECORD = "peer_build.json"


def bench_llama_cpp(gguf: str | Path, ids: list[int], new_tokens: int, threads: int,
                    python: str | None = None, n_ctx: int | None = None) -> dict[str, Any]:
    """llama.cpp on `gguf`; n_ctx: its context (KV capacity), by default just what the run needs."""
    if not Path(gguf).is_file():
        raise FileNotFoundError(f"llama.cpp needs a GGUF file; {gguf} does not exist")
    return run_script(_LLAMA_CPP, {"gguf": str(gguf), "ids": ids, "new_tokens": new_tokens, "threads": threads,
                                   "n_ctx": n_ctx}, "llama.cpp", python, peer=True)


def bench_hf_eager(model: str | Path, ids: list[int], new_tokens: int, threads: int) -> dict[str, Any]:
    return run_script(_HF_EAGER, {"model": str(model), "ids": ids, "new_tokens": new_tokens, "threads": threads},
                      "HF eager", peer=True)


def bench_ort_genai(model_dir: str | Path, ids: list[int], new_tokens: int, threads: int,
                    python: str | None = None, n_ctx: int | None = None) -> dict[str, Any]:
    """ONNX Runtime GenAI on the folder its model builder wrote (genai_config.json beside model.onnx)."""
    if not (Path(model_dir) / "genai_config.json").is_file():
        raise FileNotFoundError(f"{model_dir} has no genai_config.json: build it with "
                                "scripts/build_ort_genai_peer.py (docs/onnx.md)")
    return run_script(_ORT_GENAI, {"model": str(model_dir), "ids": ids, "new_tokens": new_tokens,
                                   "threads": threads, "n_ctx": n_ctx}, "ONNX Runtime GenAI", python, peer=True)

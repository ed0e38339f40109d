"""Build ONNX Runtime GenAI's own model of a GGUF checkpoint, the peer `foldline bench --ort-genai` times.

    .venv/bin/python scripts/build_ort_genai_peer.py GGUF OUT [--genai-python PYTHON] [--precision int4]

GenAI's model builder (`python -m onnxruntime_genai.models.builder`) takes a
Hugging Face folder, or a GGUF file only in float16 / float32: its GGUF loader
reads every tensor as a float array (`loaders/gguf.py`), so a Q4_1 or Q4_K_M
file is not accepted. This script therefore makes the folder first: HF
transformers dequantizes the GGUF to float32 (as the HF eager peer loads it)
and saves config, weights and tokenizer to OUT/hf. The builder then quantizes
those weights itself (`-p int4`, the default here: round-to-nearest int4
blocks of 32, every linear layer and the head as MatMulNBits) with int8 activations
(`int4_accuracy_level=4`, as foldline's `--activations int8`) for the CPU
execution provider, into OUT.

`--precision int8` keeps 8-bit blocks instead: int4 round-to-nearest from the
dequantized GGUF is far less accurate than the GGUF itself (scripts/ort_genai_accuracy.py
measures it against HF eager; docs/onnx.md has the figures).

The builder runs in PYTHON, an interpreter with onnxruntime-genai, torch and
transformers (docs/onnx.md, "Against ONNX Runtime GenAI"); this interpreter
needs transformers and torch (foldline's dev extra).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path


def save_hf_folder(gguf: Path, out: Path) -> None:
    """The GGUF as a float32 HF folder (config, safetensors, tokenizer), dequantized by transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # Loaded from GGUF, transformers marks the model quantized and refuses to save it; its weights are
    # plain float32 tensors by now.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))


# The builder, run with one fix: onnxruntime-genai 0.18's Gemma 3 builder reads the local layers' RoPE
# base as `config.rope_local_base_freq` and the global one from a flat `rope_parameters`; transformers 5
# keeps both in `rope_parameters`, one entry per layer type. Other configs pass through unchanged.
RUN_BUILDER = """
import runpy, sys
import transformers
load = transformers.AutoConfig.from_pretrained.__func__
def from_pretrained(cls, *args, **kwargs):
    config = load(cls, *args, **kwargs)
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and {"sliding_attention", "full_attention"} <= rope.keys():
        object.__setattr__(config, "rope_local_base_freq", rope["sliding_attention"]["rope_theta"])
        object.__setattr__(config, "rope_parameters", dict(rope["full_attention"]))
    return config
transformers.AutoConfig.from_pretrained = classmethod(from_pretrained)
sys.argv = ["builder", *sys.argv[1:]]
runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__")
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", type=Path, help="the checkpoint foldline compiled (a .gguf file)")
    ap.add_argument("out", type=Path, help="folder for GenAI's model (genai_config.json, model.onnx, ...)")
    ap.add_argument("--genai-python", default=sys.executable, help="interpreter with onnxruntime-genai")
    ap.add_argument("--precision", default="int4", choices=["int4", "int8", "fp32"], help="the builder's -p")
    a = ap.parse_args()
    if not a.gguf.is_file():
        ap.error(f"{a.gguf} is not a file")
    hf = a.out / "hf"
    t0 = time.perf_counter()
    print(f"[1/2] {a.gguf.name} -> {hf} (float32, HF transformers)", flush=True)
    save_hf_folder(a.gguf, hf)
    print(f"[2/2] ONNX Runtime GenAI's builder: -p {a.precision} -e cpu, int8 activations", flush=True)
    cmd = [a.genai_python, "-c", RUN_BUILDER, "-i", str(hf), "-o", str(a.out),
           "-p", a.precision, "-e", "cpu", "-c", str(a.out / "cache"), "--extra_options", "int4_accuracy_level=4"]
    done = subprocess.run(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        return done.returncode
    print(f"GenAI model in {a.out} ({time.perf_counter() - t0:.0f} s); bench it with "
          f"foldline bench BUNDLE --ort-genai {a.out} --genai-python {a.genai_python}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

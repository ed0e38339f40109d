"""Build ONNX Runtime GenAI's own models of a GGUF checkpoint, the peers `foldline bench --ort-genai` times.

    .venv/bin/python scripts/build_ort_genai_peer.py GGUF OUT [--variant NAME ...] [--genai-python PYTHON]
    .venv/bin/python scripts/build_ort_genai_peer.py --list

GenAI's model builder (`python -m onnxruntime_genai.models.builder`) takes a
Hugging Face folder, or a GGUF file only in float16 / float32: its GGUF loader
reads every tensor as a float array (`loaders/gguf.py`), so a Q4_1 or Q4_K_M
file is not accepted. This script therefore makes the folder first: HF
transformers dequantizes the GGUF to float32 (as the HF eager peer loads it)
and saves config, weights and tokenizer to OUT/hf. The builder then quantizes
those weights itself, once per variant (VARIANTS below: its precisions, its
int4 algorithms, symmetric or not, an 8-bit head), for the CPU execution
provider, into OUT/<variant>; every variant multiplies with int8 activations
(accuracy level 4, as foldline's `--activations int8`).

By default it builds the builder's most accurate settings (DEFAULT_VARIANTS).
A variant the builder refuses or fails on is reported in one line and skipped;
OUT/<variant>/peer_build.json records how each built one was made, which
`foldline bench` prints under its table.

The builder runs in PYTHON, an interpreter with onnxruntime-genai, torch and
transformers (docs/onnx.md, "Against ONNX Runtime GenAI"); this interpreter
needs transformers and torch (foldline's dev extra).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# name -> (the builder's -p, its --extra_options). accuracy_level=4: int8 activations on every variant.
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "int4": ("int4", ["accuracy_level=4"]),  # the builder's default: symmetric round-to-nearest int4, head too
    "int4-kquant-asym-head8": ("int4", ["accuracy_level=4", "algo_config=k_quant", "is_symmetric=false",
                                        "matmul_mixed_precision=last_matmul:int8"]),
    "int4-kquant-asym-mixed8": ("int4", ["accuracy_level=4", "algo_config=k_quant", "is_symmetric=false",
                                         "matmul_mixed_precision=last_matmul:int8,mixed_layers:int8"]),
    "int4-rtn-asym-head8": ("int4", ["accuracy_level=4", "algo_config=rtn", "is_symmetric=false",
                                     "matmul_mixed_precision=last_matmul:int8"]),
    "int8": ("int8", ["accuracy_level=4"]),
    "int8-asym": ("int8", ["accuracy_level=4", "is_symmetric=false"]),
    "fp32": ("fp32", []),
}
DEFAULT_VARIANTS = ["int4-kquant-asym-head8", "int4-kquant-asym-mixed8", "int8", "int8-asym"]
RECORD = "peer_build.json"


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


def builder_error(stderr: str) -> str:
    """The line of the builder's failure that says why: its last exception line, else its last line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.split(":")[0].endswith(("Error", "Exception"))]
    return (errors or lines or ["no output"])[-1][:300]


def build_variant(name: str, hf: Path, out: Path, python: str) -> str | None:
    """One variant into `out`; None when built, else why not in one line."""
    precision, extra = VARIANTS[name]
    cmd = [python, "-c", RUN_BUILDER, "-i", str(hf), "-o", str(out), "-p", precision, "-e", "cpu",
           "-c", str(out.parent / "cache"), *(["--extra_options", *extra] if extra else [])]
    done = subprocess.run(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
    if done.returncode != 0 or not (out / "genai_config.json").is_file():
        shutil.rmtree(out, ignore_errors=True)
        return builder_error(done.stderr)
    version = subprocess.run([python, "-c", "from importlib.metadata import version; "
                              "print(version('onnxruntime-genai'))"], capture_output=True, text=True).stdout.strip()
    record = {"built_by": f"onnxruntime_genai.models.builder {version}", "variant": name, "precision": precision,
              "extra_options": extra, "source": str(hf)}
    (out / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", type=Path, nargs="?", help="the checkpoint foldline compiled (a .gguf file)")
    ap.add_argument("out", type=Path, nargs="?", help="folder for the HF folder and one GenAI model per variant")
    ap.add_argument("--variant", action="append", choices=list(VARIANTS), default=None,
                    help=f"a variant to build; repeatable (default: {', '.join(DEFAULT_VARIANTS)})")
    ap.add_argument("--genai-python", default=sys.executable, help="interpreter with onnxruntime-genai")
    ap.add_argument("--list", action="store_true", help="print each variant's builder options and exit")
    a = ap.parse_args()
    if a.list:
        for name, (precision, extra) in VARIANTS.items():
            print(f"{name}: -p {precision} {' '.join(extra)}")
        return 0
    if a.gguf is None or a.out is None:
        ap.error("GGUF and OUT are required")
    if not a.gguf.is_file():
        ap.error(f"{a.gguf} is not a file")
    variants = list(dict.fromkeys(a.variant or DEFAULT_VARIANTS))
    hf = a.out / "hf"
    t0 = time.perf_counter()
    if not (hf / "config.json").is_file():
        print(f"{a.gguf.name} -> {hf} (float32, HF transformers)", flush=True)
        save_hf_folder(a.gguf, hf)
    built = []
    for name in variants:
        target = a.out / name
        if (target / "genai_config.json").is_file():
            print(f"{name}: already in {target}", flush=True)
            built.append(target)
            continue
        t1 = time.perf_counter()
        why = build_variant(name, hf, target, a.genai_python)
        if why is None:
            print(f"{name}: built in {target} ({time.perf_counter() - t1:.0f} s)", flush=True)
            built.append(target)
        else:
            print(f"{name}: the builder cannot build it: {why}", flush=True)
    print(f"{len(built)} of {len(variants)} variants in {a.out} ({time.perf_counter() - t0:.0f} s)")
    if built:
        print("bench them with: foldline bench BUNDLE " + " ".join(f"--ort-genai {b}" for b in built)
              + f" --genai-python {a.genai_python}")
    return 0 if built else 1


if __name__ == "__main__":
    sys.exit(main())

"""Build a tiny random Qwen3.5, convert it with llama.cpp's converter, record HF and llama.cpp logits.

The fixture lets CI check foldline's qwen35 GGUF loader against two independent
implementations without either being installed:

- HF transformers eager logits (the model's definition);
- llama.cpp's logits on the very same GGUF file.

Run from the repository root with the project venv (it needs torch and
transformers 5.23); the llama.cpp step re-runs this script under a Python that
has llama-cpp-python:

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/lcp_src
    tar xzf /tmp/lcp_src/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcp_src
    python scripts/record_llamacpp_qwen35.py \\
        --llama-cpp-src /tmp/lcp_src/llama_cpp_python-0.3.36/vendor/llama.cpp \\
        --llamacpp-python /opt/llamacpp-venv/bin/python

Writes tests/fixtures/qwen35-tiny.gguf and tests/fixtures/qwen35_llamacpp.json.

The converter refuses BPE vocabularies whose pre-tokenizer hash it does not
know. The tiny byte-level BPE vocabulary trained here has no such hash, so the
conversion declares it "qwen2" (the regex Qwen3.5's own tokenizer uses). Only
token ids are fed to the models, so tokenization never affects the logits.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
GGUF_NAME = "qwen35-tiny.gguf"
JSON_NAME = "qwen35_llamacpp.json"
SEED = 0
VOCAB = 320
DECODE_STEPS = 8
PROMPT_LENGTHS = (40, 5)  # 40 > two 16-token chunks (the last padded); 5 < one chunk

TRAIN_TEXT = (
    "The old lighthouse keeper kept a ledger of every ship that passed the point. In spring the fishing boats "
    "came first, low in the water and loud with gulls, and after them the grain barges from the river towns. "
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
)


def prompts() -> list[list[int]]:
    """Fixed random token ids (tokenization plays no part in the comparison)."""
    rng = np.random.default_rng(3)
    return [rng.integers(0, VOCAB, size=n).tolist() for n in PROMPT_LENGTHS]


# ---------------------------------------------------------------------------
# HF side (project venv)
# ---------------------------------------------------------------------------


def build_hf_model(seed: int = SEED) -> Any:
    """A seeded Qwen3_5ForCausalLM at sizes where every convention shows (see tests/e2e/test_hf_parity.py)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-6,
        bos_token_id=None, eos_token_id=0,  # <|endoftext|>, the tokenizer's only special token
    )
    model = transformers.Qwen3_5ForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.05, 3.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.4)
            elif "norm" in name:
                plain = name.endswith("linear_attn.norm.weight")  # every other norm is (1 + w)
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if plain else 0.0))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return model


def write_tokenizer(out: Path) -> None:
    """A byte-level BPE vocabulary of exactly VOCAB entries with Qwen2's pre-tokenizer regex."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    qwen2_regex = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(qwen2_regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TRAIN_TEXT] * 4, trainer)
    if tok.get_vocab_size() != VOCAB:
        raise SystemExit(f"trained vocabulary has {tok.get_vocab_size()} entries, wanted {VOCAB}")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": None,
        "add_bos_token": False, "model_max_length": 256,
    }, indent=1))


def hf_logits(model: Any, ids: list[int], continuation: list[int]) -> list[np.ndarray]:
    """HF eager logits after the prompt and after each continuation token (HF's own cache)."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
        logits = [out.logits[0, -1].float().numpy()]
        cache = out.past_key_values
        for tok in continuation:
            out = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits.append(out.logits[0, -1].float().numpy())
    return logits


def greedy_continuation(model: Any, ids: list[int], steps: int) -> list[int]:
    """HF's greedy tokens; all three implementations are then fed this same sequence."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
        cache, tokens = out.past_key_values, []
        for _ in range(steps):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
    return tokens


def convert(hf_dir: Path, gguf: Path, llama_cpp_src: Path) -> None:
    """llama.cpp's convert_hf_to_gguf.py (f32, no MTP) with the tiny vocabulary declared qwen2."""
    code = (
        "import sys\n"
        "import convert_hf_to_gguf as c\n"
        "from conversion.base import TextModel\n"
        "TextModel.get_vocab_base_pre = lambda self, tokenizer: 'qwen2'\n"
        f"sys.argv = ['convert_hf_to_gguf.py', {str(hf_dir)!r}, '--outfile', {str(gguf)!r}, '--outtype', 'f32',"
        " '--no-mtp']\n"
        "c.main()\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(llama_cpp_src / "gguf-py"), str(llama_cpp_src)]),
               NO_LOCAL_GGUF="1")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=llama_cpp_src, env=env)


# ---------------------------------------------------------------------------
# llama.cpp side (a Python with llama-cpp-python; no torch needed)
# ---------------------------------------------------------------------------


def llamacpp_logits(gguf: Path, sequences: list[list[int]], n_prompt: list[int], threads: int,
                    f32_kv: bool) -> dict:
    """llama.cpp logits after each prompt and each continuation token, fed as token ids.

    llama.cpp's default KV cache is f16, which alone moves these logits by ~2e-4;
    f32_kv stores K and V in f32 so the comparison measures the model's math.
    """
    from llama_cpp import Llama, __version__

    kv = {"type_k": 0, "type_v": 0} if f32_kv else {}  # 0 = GGML_TYPE_F32
    llm = Llama(model_path=str(gguf), n_ctx=128, n_batch=64, n_threads=threads, n_threads_batch=threads,
                logits_all=True, verbose=False, seed=0, **kv)
    runs = []
    for seq, n in zip(sequences, n_prompt):
        llm.reset()
        llm.eval(seq[:n])  # prompt as one batch
        steps = [np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)]
        for tok in seq[n:]:
            llm.eval([tok])  # then one token at a time
            steps.append(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32))
        runs.append([s.tolist() for s in steps])
    return {"llama_cpp_python": __version__, "logits": runs}


def _llamacpp_main(args: argparse.Namespace) -> int:
    request = json.loads(Path(args.llamacpp_request).read_text())
    result = {
        name: llamacpp_logits(Path(request["gguf"]), request["sequences"], request["n_prompt"], request["threads"],
                              f32_kv=name == "f32_kv")
        for name in ("f32_kv", "f16_kv")
    }
    Path(request["out"]).write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------------------------


def _rounded(x: np.ndarray) -> list[float]:
    return [round(float(v), 6) for v in x]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp-src", type=Path, help="llama.cpp source tree (convert_hf_to_gguf.py, gguf-py)")
    parser.add_argument("--llamacpp-python", default="/opt/llamacpp-venv/bin/python",
                        help="a Python with llama-cpp-python")
    parser.add_argument("--out", type=Path, default=FIXTURES)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llamacpp-request", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.llamacpp_request:
        return _llamacpp_main(args)
    if args.llama_cpp_src is None:
        parser.error("--llama-cpp-src is required")

    model = build_hf_model()
    work = Path(tempfile.mkdtemp(prefix="qwen35-tiny-"))
    hf_dir = work / "hf"
    model.save_pretrained(hf_dir)
    write_tokenizer(hf_dir)
    gguf = work / GGUF_NAME
    convert(hf_dir, gguf, args.llama_cpp_src.resolve())

    runs = []
    for ids in prompts():
        cont = greedy_continuation(model, ids, DECODE_STEPS)
        runs.append({"ids": ids, "continuation": cont, "hf": hf_logits(model, ids, cont)})

    request = work / "request.json"
    result_path = work / "llamacpp.json"
    request.write_text(json.dumps({
        "gguf": str(gguf), "sequences": [r["ids"] + r["continuation"] for r in runs],
        "n_prompt": [len(r["ids"]) for r in runs], "threads": args.threads, "out": str(result_path),
    }))
    subprocess.run([args.llamacpp_python, str(Path(__file__).resolve()), "--llamacpp-request", str(request)],
                   check=True)
    lcpp = json.loads(result_path.read_text())

    import transformers

    fixture = {
        "gguf": GGUF_NAME,
        "seed": SEED,
        "transformers": transformers.__version__,
        "llama_cpp_python": lcpp["f32_kv"]["llama_cpp_python"],
        "llamacpp_kv_cache": "f32",
        "machine": platform.machine(),
        "threads": args.threads,
        "runs": [],
    }
    for run, lc, lc16 in zip(runs, lcpp["f32_kv"]["logits"], lcpp["f16_kv"]["logits"]):
        hf = run["hf"]
        lc = [np.array(x, dtype=np.float32) for x in lc]
        lc16 = [np.array(x, dtype=np.float32) for x in lc16]
        gap = max(float(np.abs(a - b).max()) for a, b in zip(hf, lc))
        gap16 = max(float(np.abs(a - b).max()) for a, b in zip(hf, lc16))
        print(f"prompt of {len(run['ids'])}: llama.cpp vs HF worst |logit diff| {gap:.3e} (f16 KV cache: "
              f"{gap16:.3e}), top-1 agree {[int(a.argmax()) == int(b.argmax()) for a, b in zip(hf, lc)]}")
        fixture["runs"].append({
            "ids": run["ids"],
            "continuation": run["continuation"],
            "hf_logits": [_rounded(x) for x in hf],
            "llamacpp_logits": [_rounded(x) for x in lc],
            "llamacpp_top1": [int(x.argmax()) for x in lc],
            "llamacpp_f16_kv_top1": [int(x.argmax()) for x in lc16],
            "llamacpp_f16_kv_max_abs_vs_hf": round(gap16, 8),
        })
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(gguf, args.out / GGUF_NAME)
    (args.out / JSON_NAME).write_text(json.dumps(fixture) + "\n")
    print(f"wrote {args.out / GGUF_NAME} ({gguf.stat().st_size} bytes) and {args.out / JSON_NAME}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

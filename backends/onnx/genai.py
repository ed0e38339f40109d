"""`--target onnx-genai`: a model directory that ONNX Runtime GenAI loads and generates with.

GenAI runs one graph for prefill and decode, named by its own conventions
(its model builder's, onnxruntime_genai/models/builder.py): `input_ids`
[batch, sequence], `attention_mask` [batch, total], `past_key_values.N.key`
and `.value` in, `present.N.key` and `.value` and `logits` [batch, sequence,
vocabulary] out, the caches one buffer each that it binds as both the past
and the present (`past_present_share_buffer`), and `genai_config.json` beside
it. foldline's graph for it is the `step` function (frontend/export.py: any
number of tokens, every position's logits) after the default passes, its
attention GroupQueryAttention as in the `onnx` target's one-row functions
(windowed layers over window-sized caches, `sliding_window_cache`, as the
builder emits them for the CPU), its products MatMulNBits; `to_genai_graph`
then renames its inputs and outputs and computes foldline's `start_pos` and
`n_valid` from GenAI's inputs in the graph.

What GenAI's graph cannot hold is refused before any work (`refusal`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from ...contract.entry_points import INPLACE_STATE_KEY, NEXT_SUFFIX
from ...contract.state import StateBuffer
from ...errors import FoldlineError
from ...frontend.config import ModelConfig
from ...passes.manager import CompileUnit, TargetPasses
from .export import DATA_FILE, SharedWeights, export_function
from .gqa import ATTENTION_OPS, GQA_PASS, RING_OPS, WINDOW_CACHES
from .graph_rewrites import MAX_OPSET

GRAPH_FILE = "model.onnx"
CONFIG_FILE = "genai_config.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# The step function's inputs as exported, before to_genai_graph gives them GenAI's names.
STEP_INPUTS = ("tokens", "start_pos", "n_valid")
# GenAI's model type for each family whose own type it runs as a plain decoder; others run as llama.
GENAI_TYPES = {"gemma3": "gemma3_text", "llama": "llama"}
KV_SUFFIXES = {"k": "key", "v": "value"}


class GenaiExportError(FoldlineError, ValueError):
    """A model, or a compile option, that an ONNX Runtime GenAI model cannot express."""


def refusal(cfg: ModelConfig, batch: int, devices: int, kv_dtype: str) -> str | None:
    """Why GenAI cannot run this model as foldline exports it, in one line; None when it can."""
    if "gdn" in cfg.layer_types:
        return (f"{cfg.name}: --target onnx-genai cannot hold gated delta net layers: foldline maps only "
                "attention caches to GenAI's past_key_values, not their recurrent and convolution state")
    if cfg.kv_mapping != "blocked":
        return (f"{cfg.name}: --target onnx-genai needs blocked KV heads (GroupQueryAttention's mapping); "
                f"this model's are {cfg.kv_mapping}")
    partial = [d for d in (cfg.rotary_dim_local, cfg.rotary_dim_global) if d is not None and d != cfg.head_dim]
    if partial:
        return (f"{cfg.name}: --target onnx-genai needs rotary over the whole head (GroupQueryAttention's "
                f"do_rotary); this model rotates {partial[0]} of {cfg.head_dim} dimensions")
    if batch != 1:
        return f"--target onnx-genai takes --batch 1 (GenAI batches the rows itself), not --batch {batch}"
    if devices != 1:
        return f"--target onnx-genai runs on one device, not --devices {devices}"
    if kv_dtype not in ("float32", "float16"):
        return f"--target onnx-genai holds float32 or float16 caches, not {kv_dtype}"
    return None


def check(cfg: ModelConfig, batch: int, devices: int, kv_dtype: str) -> None:
    """Raise the refusal, if any."""
    reason = refusal(cfg, batch, devices, kv_dtype)
    if reason is not None:
        raise GenaiExportError(reason)


def _genai_state_name(buffer: StateBuffer, present: bool) -> str:
    """layer3.k -> past_key_values.3.key (present.3.key for its next value)."""
    suffix = KV_SUFFIXES[buffer.name.rsplit(".", 1)[1]]
    layer = buffer.layers[0]
    return f"present.{layer}.{suffix}" if present else f"past_key_values.{layer}.{suffix}"


def _rename(graph: onnx.GraphProto, old: str, new: str) -> None:
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new
        for i, name in enumerate(node.output):
            if name == old:
                node.output[i] = new
    for value in (*graph.input, *graph.output):
        if value.name == old:
            value.name = new


def _set_dims(value: onnx.ValueInfoProto, dims: list[int | str]) -> None:
    shape = value.type.tensor_type.shape
    del shape.dim[:]
    for d in dims:
        dim = shape.dim.add()
        if isinstance(d, int):
            dim.dim_value = d
        else:
            dim.dim_param = d


def to_genai_graph(model: onnx.ModelProto, state: list[StateBuffer], windowed: set[str]) -> None:
    """The step graph with GenAI's inputs and outputs (in place).

    input_ids is the step's tokens; start_pos and n_valid are computed from the
    attention mask (the positions held, ones) and the token count, as the builder
    computes GroupQueryAttention's seqlens_k; each cache is renamed and its length
    left free (GenAI allocates them: `max_length` positions, or a windowed layer's
    window); logits keep every position. windowed: the state names of window-sized caches.
    """
    graph = model.graph
    inplace = {p.key: p.value for p in model.metadata_props}.get(INPLACE_STATE_KEY, "").split(",")
    copied = [s.name for s in state if s.name not in inplace]
    if copied:
        raise GenaiExportError(f"GenAI shares each cache between past and present, but {', '.join(copied)} "
                               "would be written as a new tensor: its attention is not GroupQueryAttention")
    _rename(graph, "tokens", "input_ids")
    computed = {"start_pos", "n_valid"}
    kept = [i for i in graph.input if i.name not in computed]
    del graph.input[:]
    graph.input.extend(kept)
    graph.input[0].CopyFrom(helper.make_tensor_value_info("input_ids", TensorProto.INT64,
                                                          ["batch_size", "sequence_length"]))
    graph.input.insert(1, helper.make_tensor_value_info("attention_mask", TensorProto.INT64,
                                                        ["batch_size", "total_sequence_length"]))
    steps = [
        helper.make_node("Shape", ["input_ids"], ["n_valid"], start=1, end=2, name="genai/n_valid"),
        helper.make_node("Constant", [], ["genai/axis1"], value_ints=[1], name="genai/axis1"),
        helper.make_node("ReduceSum", ["attention_mask", "genai/axis1"], ["genai/held"], keepdims=0,
                         name="genai/held"),
        helper.make_node("Sub", ["genai/held", "n_valid"], ["start_pos"], name="genai/start_pos"),
    ]
    for node in reversed(steps):
        graph.node.insert(0, node)
    for buffer in state:
        length = "sliding_length" if buffer.name in windowed else "sequence_length"
        past, present = _genai_state_name(buffer, False), _genai_state_name(buffer, True)
        _rename(graph, buffer.name, past)
        _rename(graph, buffer.name + NEXT_SUFFIX, present)
        for value, dim in ((next(i for i in graph.input if i.name == past), f"past_{length}"),
                           (next(o for o in graph.output if o.name == present), f"total_{length}")):
            _set_dims(value, ["batch_size", buffer.shape[1], dim, buffer.shape[3]])
    logits = next(o for o in graph.output if o.name == "logits")
    _set_dims(logits, ["batch_size", "sequence_length", logits.type.tensor_type.shape.dim[-1].dim_value])
    del graph.value_info[:]  # the export's shapes of the fixed-length caches; ONNX Runtime infers them again
    props = {p.key: p.value for p in model.metadata_props if p.key != INPLACE_STATE_KEY}
    del model.metadata_props[:]
    helper.set_model_props(model, props)


def genai_config(cfg: ModelConfig, windowed_layers: list[int]) -> dict:
    """genai_config.json, with the fields GenAI's model builder writes for a decoder over GroupQueryAttention
    (bos_token_id only where the model has one)."""
    eos = list(cfg.eos_token_ids)
    decoder = {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
        "filename": GRAPH_FILE,
        "head_size": cfg.head_dim,
        "hidden_size": cfg.hidden_size,
        "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                   "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
        "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value"},
        "num_attention_heads": cfg.num_heads,
        "num_hidden_layers": cfg.num_layers,
        "num_key_value_heads": cfg.num_kv_heads,
    }
    if windowed_layers:
        decoder["sliding_window"] = {"window_size": cfg.sliding_window, "slide_key_value_cache": False,
                                     "slide_inputs": False, "layers": windowed_layers, "cache_slack": 0}
    config = {
        "model": {
            "context_length": cfg.max_context,
            "decoder": decoder,
            "eos_token_id": eos[0] if len(eos) == 1 else eos,  # none (a preset): generation runs to max_length
            "pad_token_id": eos[0] if eos else 0,
            "type": GENAI_TYPES.get(cfg.family, "llama"),
            "vocab_size": cfg.vocab_size,
        },
        "search": {
            "diversity_penalty": 0.0, "do_sample": False, "early_stopping": True, "length_penalty": 1.0,
            "max_length": cfg.max_context, "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
            "num_return_sequences": 1, "past_present_share_buffer": True, "repetition_penalty": 1.0,
            "temperature": 1.0, "top_k": 50, "top_p": 1.0,
        },
    }
    if cfg.bos_token_id is not None:  # GenAI's tokenizer adds none here: the caller prepends it
        config["model"]["bos_token_id"] = cfg.bos_token_id
    return config


def tokenizer_config(tokenizer_json: str, cfg: ModelConfig, chat_template: str | None) -> dict:
    """tokenizer_config.json beside tokenizer.json: the special tokens GenAI's tokenizer reads by name."""
    vocab = {}
    document = json.loads(tokenizer_json)
    for token in document.get("added_tokens", []):
        vocab[token["id"]] = token["content"]
    model_vocab = document.get("model", {}).get("vocab", {})
    if isinstance(model_vocab, dict):
        vocab.update({i: t for t, i in model_vocab.items() if i not in vocab})
    config: dict = {"model_max_length": cfg.max_context, "tokenizer_class": "PreTrainedTokenizerFast"}
    if cfg.bos_token_id is not None and cfg.bos_token_id in vocab:
        config["bos_token"] = vocab[cfg.bos_token_id]
    if cfg.eos_token_ids and cfg.eos_token_ids[0] in vocab:
        config["eos_token"] = vocab[cfg.eos_token_ids[0]]
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config


def export_genai(unit: CompileUnit, out: Path, activations: str, tokenizer_json: str | None,
                 chat_template: str | None, progress: Callable[[str], None] = print,
                 dump_after: dict[str, Path] | None = None, opset: int = MAX_OPSET) -> list[str]:
    """unit's `step` program as GenAI's model directory in `out`; the files written.

    unit: after the default passes, its one program `step` (frontend/export.export_step).
    activations: what MatMulNBits multiplies the codes by ("int8" or "f32", export_function).
    opset: the highest opset the graph may use (`--onnx-opset`).
    """
    t0 = time.time()
    (name, program), = unit.programs.items()
    window_caches = any(n.op == "call_function" and n.target in RING_OPS for n in program.graph.nodes)
    program = TargetPasses(unit, [GQA_PASS], dump_after, options={WINDOW_CACHES: window_caches}).run(name, program)
    left = sorted({str(n.target) for n in program.graph.nodes
                   if n.op == "call_function" and n.target in (*ATTENTION_OPS, *RING_OPS)})
    if left:
        raise GenaiExportError(f"{unit.config.name}: attention left as {', '.join(left)}, not GroupQueryAttention: "
                               "GenAI shares each cache between past and present, which only it updates in place")
    model = export_function(program, name, 1, unit.state_specs, activations, steps=STEP_INPUTS,
                            gather_block_quantized=True, opset=opset)
    windowed = {s.name for s in unit.state_specs if window_caches and s.kind == "local_kv"}
    to_genai_graph(model, unit.state_specs, windowed)
    weights = SharedWeights(out / DATA_FILE)
    try:
        weights.externalize(model)
    finally:
        weights.close()
    onnx.save_model(model, out / GRAPH_FILE)
    onnx.checker.check_model(str(out / GRAPH_FILE), full_check=True)
    windowed_layers = sorted({s.layers[0] for s in unit.state_specs if s.name in windowed})
    (out / CONFIG_FILE).write_text(json.dumps(genai_config(unit.config, windowed_layers), indent=4) + "\n")
    files = [GRAPH_FILE, DATA_FILE, CONFIG_FILE]
    if tokenizer_json is not None:
        (out / "tokenizer.json").write_text(tokenizer_json)
        config = tokenizer_config(tokenizer_json, unit.config, chat_template)
        (out / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        files += ["tokenizer.json", TOKENIZER_CONFIG_FILE]
    opset = max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    progress(f"      {GRAPH_FILE}: {len(model.graph.node)} nodes, opset {opset}, {time.time() - t0:.0f} s")
    return files

"""`--target onnx-genai`: the model directory ONNX Runtime GenAI loads, run by the real onnxruntime-genai.

Against the eager reference over a three-chunk prompt and 60 decode steps
(gemma3-tiny's 16-position windows passed six times over; llama-tiny's full
caches; llama-tiny with q8 blocks kept as MatMulNBits), with the bounds of
tests/backends/test_onnx.py; GenAI's greedy tokens against foldline's own ONNX Runtime
device and IREE CPU bundle; the directory's layout; the refusal of a model
GenAI's graph cannot hold.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from foldline.runtime import Model
from foldline.testing.parity import (
    SCALED_TOL_F16,
    SCALED_TOL_FP32,
    EagerRunner,
    ParityReport,
    compare_logits,
)

og = pytest.importorskip("onnxruntime_genai")
pytestmark = pytest.mark.slow
PROMPT = list(range(3, 43))  # what tests/backends/test_onnx.py feeds: three chunks of foldline's prefill
STEPS = 60  # gemma3-tiny's 16-position windows wrap six times


@pytest.fixture(scope="module")
def genai_models(tmp_path_factory):
    """name -> (eager reference module, GenAI model directory), compiled once."""
    from foldline.backends.build import BuildOptions, compile_model
    from foldline.backends.targets import make_target
    from foldline.frontend.sources import load_model

    from kernels.test_quant_compile import _blocked

    cache = {}

    def get(name: str):
        if name not in cache:
            base = name.removesuffix("-f16")  # -f16: float16 compute and caches, as GenAI runs on CUDA
            loaded = _blocked("llama-tiny", "q8") if base == "llama-tiny-q8" else load_model(base)
            out = tmp_path_factory.mktemp(name) / "genai"
            # f32 activations: the q8 blocks' products exact, so the fp32 bound holds
            dtypes = {"dtype": "float16"} if name.endswith("-f16") else {}
            options = BuildOptions(targets=[make_target("onnx-genai")], activations="f32", **dtypes)
            compile_model(loaded, out, options, progress=lambda _m: None)
            cache[name] = (loaded.module, out)
        return cache[name]

    return get


def genai_generator(directory, length: int):
    model = og.Model(str(directory))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=length)
    return og.Generator(model, params)


def genai_greedy(directory, prompt: list[int], steps: int) -> list[int]:
    """GenAI's own greedy search, as a user runs it: the prompt, then generate_next_token until done."""
    generator = genai_generator(directory, len(prompt) + steps)
    generator.append_tokens(prompt)
    tokens = []
    while not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    return tokens


def foldline_greedy(model: Model, prompt: list[int], steps: int) -> list[int]:
    session = model.session()
    tokens = [int(np.argmax(session.prefill(prompt)))]
    while len(tokens) < steps:
        tokens.append(int(np.argmax(session.decode(tokens[-1]))))
    return tokens


@pytest.mark.parametrize("name", ["llama-tiny", "gemma3-tiny", "llama-tiny-q8", "gemma3-tiny-f16",
                                  "llama-tiny-q8-f16"])
def test_genai_matches_eager(name, genai_models):
    """float16 (`--dtype f16`) against the float32 reference within float16's bound: its caches float16,
    the tied q8 table read through the head's float16 scales."""
    module, directory = genai_models(name)
    eager = EagerRunner(module, 16)
    generator = genai_generator(directory, len(PROMPT) + STEPS + 1)
    generator.append_tokens(PROMPT)
    genai_logits = np.asarray(generator.get_logits()).reshape(-1)
    eager_logits = eager.prefill(PROMPT)
    report = ParityReport()
    for step in range(STEPS + 1):
        compare_logits(report, genai_logits, eager_logits, eager.term_scale())
        report.eager_tokens.append(int(eager_logits.argmax()))
        report.compiled_tokens.append(int(genai_logits.argmax()))
        if step == STEPS:
            break
        eager_logits = eager.decode(report.eager_tokens[-1])
        generator.append_tokens([report.compiled_tokens[-1]])
        genai_logits = np.asarray(generator.get_logits()).reshape(-1)
    assert report.steps == STEPS + 1
    assert report.tokens_agree, report.summary()
    assert report.worst_scaled_error <= (SCALED_TOL_F16 if name.endswith("-f16") else SCALED_TOL_FP32), report.summary()
    if name.endswith("-f16"):
        graph = onnx.load(str(directory / "model.onnx"), load_external_data=False).graph
        caches = [i for i in graph.input if i.name.startswith("past_key_values")]
        assert caches and all(i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 for i in caches)


@pytest.mark.parametrize("name", ["llama-tiny", "gemma3-tiny"])
def test_genai_generates_the_tokens_of_foldlines_onnx_device(name, genai_models, bundle_factory):
    _module, directory = genai_models(name)
    expected = foldline_greedy(Model.load(bundle_factory(name, target="onnx"), device="onnxruntime"), PROMPT, STEPS)
    assert genai_greedy(directory, PROMPT, STEPS) == expected


def test_genai_generates_the_tokens_of_the_iree_bundle(genai_models, bundle_factory):
    _module, directory = genai_models("llama-tiny")
    assert genai_greedy(directory, PROMPT, STEPS) == foldline_greedy(Model.load(bundle_factory("llama-tiny")),
                                                                      PROMPT, STEPS)


def test_the_directory_is_one_graph_named_as_genai_names_it(genai_models):
    """GenAI's input and output names, one graph over one data file, the windowed layers' caches declared
    to GenAI and attended by GroupQueryAttention over window-sized caches."""
    _module, directory = genai_models("gemma3-tiny")
    assert sorted(p.name for p in directory.iterdir()) == ["genai_config.json", "model.onnx", "model.onnx.data"]
    config = json.loads((directory / "genai_config.json").read_text())
    decoder = config["model"]["decoder"]
    local = [0, 1, 2, 3, 4, 6, 7]  # gemma3-tiny: layer 5 is global
    assert decoder["sliding_window"]["layers"] == local and decoder["sliding_window"]["window_size"] == 16
    assert config["search"]["past_present_share_buffer"] is True
    assert "bos_token_id" not in config["model"] and config["model"]["eos_token_id"] == []  # the preset has neither
    model = onnx.load(directory / "model.onnx", load_external_data=False)
    caches = [f"past_key_values.{i}.{kv}" for i in range(8) for kv in ("key", "value")]
    assert [i.name for i in model.graph.input] == ["input_ids", "attention_mask", *caches]
    assert sorted(o.name for o in model.graph.output) == sorted(
        ["logits", *(f"present.{i}.{kv}" for i in range(8) for kv in ("key", "value"))])
    attention = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(attention) == 8
    windows = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in attention]
    assert [w["local_window_size"] for w in windows] == [16 if i in local else -1 for i in range(8)]
    assert [w.get("sliding_window_cache", 0) for w in windows] == [int(i in local) for i in range(8)]
    assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) == 23


def test_what_the_layers_share_is_computed_once(genai_models):
    """Every GroupQueryAttention reads one seqlens_k and one total length, computed once from GenAI's inputs,
    not a copy per layer; the step function has no padded rows, so no mask zeroes any."""
    _module, directory = genai_models("gemma3-tiny")
    graph = onnx.load(directory / "model.onnx", load_external_data=False).graph
    attention = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert len(attention) == 8
    assert len({n.input[5] for n in attention}) == 1 and len({n.input[6] for n in attention}) == 1
    assert "Where" not in {n.op_type for n in graph.node}


def test_q8_blocks_stay_matmulnbits_and_the_tied_table_is_read_from_the_heads(genai_models):
    """Products as MatMulNBits; the embedding tied to the q8 head one GatherBlockQuantized over the head's
    blocks (no copy of the table), 8 bits in groups of 32; attention fed the q/k/v product packed."""
    _module, directory = genai_models("llama-tiny-q8")
    graph = onnx.load(directory / "model.onnx", load_external_data=False).graph
    ops = {n.op_type for n in graph.node}
    assert "MatMulNBits" in ops
    assert "MatMul" not in ops  # no weight multiplied as floats
    lookup, = [n for n in graph.node if n.op_type == "GatherBlockQuantized"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in lookup.attribute}
    assert (attrs["bits"], attrs["block_size"], attrs["gather_axis"], attrs["quantize_axis"]) == (8, 32, 0, 1)
    assert lookup.input[1] == "input_ids"
    head = next(n for n in graph.node if n.op_type == "MatMulNBits" and "embed_tokens" in n.input[1])
    reshape = next(n for n in graph.node if lookup.input[0] in n.output)
    assert reshape.op_type == "Reshape" and reshape.input[0] == head.input[1]
    assert not any("embed_tokens" in t.name and t.data_type == onnx.TensorProto.INT8 for t in graph.initializer)
    # the fused q/k/v product feeds each attention whole, as GroupQueryAttention's packed query
    attention = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert attention and all(n.input[1] == n.input[2] == "" for n in attention)
    assert all(next(p for p in graph.node if n.input[0] in p.output).op_type == "MatMulNBits" for n in attention)


def test_gated_delta_net_is_refused_before_any_work(tmp_path):
    from foldline.backends.build import BuildOptions, compile_model
    from foldline.backends.onnx.genai import GenaiExportError
    from foldline.backends.targets import make_target
    from foldline.frontend.sources import load_model

    out = tmp_path / "genai"
    with pytest.raises(GenaiExportError, match="gated delta net"):
        compile_model(load_model("qwen35-tiny"), out, BuildOptions(targets=[make_target("onnx-genai")]),
                      progress=lambda _m: None)
    assert not out.exists()


def test_what_genai_cannot_hold_is_refused_in_one_line():
    from dataclasses import replace

    from foldline.backends.onnx.genai import refusal
    from foldline.frontend.arch import PRESETS

    llama = PRESETS["llama-tiny"]()
    assert refusal(llama, 1, 1, "float32") is None
    assert "interleaved" in refusal(replace(llama, kv_mapping="interleaved"), 1, 1, "float32")
    assert "rotates 8 of 16" in refusal(replace(llama, rotary_dim_global=8), 1, 1, "float32")
    assert "--batch 2" in refusal(llama, 2, 1, "float32")
    assert "--devices 2" in refusal(llama, 1, 2, "float32")
    assert "bfloat16" in refusal(llama, 1, 1, "bfloat16")

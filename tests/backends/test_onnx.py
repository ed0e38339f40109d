"""ONNX out (`--target onnx`): the bundle's functions as ONNX graphs run by a stock onnxruntime.

Against the eager reference, every tiny preset: rings wrapped several times
(gemma3-tiny), gated delta-net state with q4 blocks kept as codes (qwen35-tiny,
its linear and embedding weights exactly their blocks' dequantization, its
products MatMulNBits with float activations), GQA over full caches
(llama-tiny) and Ripple's value residual beside its windows (ripple-tiny),
each over a prompt of three chunks and 60 decode steps. tests/backends/test_onnx_nbits.py checks MatMulNBits per block type, with
int8 activations too.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import helper

from foldline.contract.errors import BundleError
from foldline.runtime import Model
from foldline.testing.parity import SCALED_TOL_F16, SCALED_TOL_FP32, run_parity

pytestmark = pytest.mark.slow
PROMPT = list(range(3, 43))  # three prefill chunks of 16, the last padded
STEPS = 60  # past the 128-slot context's middle: gemma3-tiny's 16-slot rings wrap six times


@pytest.fixture(scope="module")
def onnx_bundles(tmp_path_factory):
    """preset -> (eager reference module, ONNX bundle), compiled once."""
    from foldline.backends.build import BuildOptions, compile_model
    from foldline.backends.compile_cache import CompileCache
    from foldline.backends.targets import make_target
    from foldline.frontend.sources import load_model
    from foldline.passes.manager import default_pipeline

    from kernels.test_quant_compile import _blocked

    cache = {}

    def get(name: str):
        if name not in cache:
            half = name.endswith("-f16")  # float16 compute and caches (CUDA's GroupQueryAttention takes float16)
            name_f32 = name.removesuffix("-f16")
            blocked = {"qwen35-tiny-q4": ("qwen35-tiny", "q4"), "llama-tiny-q8": ("llama-tiny", "q8"),
                       "llama-tiny-q4": ("llama-tiny", "q4")}
            passes = None
            if name == "gemma3-tiny-full-windows":  # window layers as full caches: GroupQueryAttention's local window
                loaded = load_model("gemma3-tiny")
                passes = [p for p in default_pipeline() if p != "ring-buffer-swa"]
            elif name in ("gemma3-tiny-batch2", "gemma3-tiny-opset20"):  # batch2: rings, attended decomposed
                loaded = load_model("gemma3-tiny")
            else:
                loaded = _blocked(*blocked[name_f32]) if name_f32 in blocked else load_model(name_f32)
            batch = 2 if name == "gemma3-tiny-batch2" else 1
            out = tmp_path_factory.mktemp(name) / "bundle"
            dtypes = {"dtype": "float16", "kv_dtype": "float16"} if half else {"kv_dtype": "float32"}
            options = BuildOptions(targets=[make_target("onnx")], activations="f32", passes=passes, batch=batch,
                                   onnx_opset=20 if name.endswith("opset20") else 23, **dtypes)
            compile_model(loaded, out, options, progress=lambda _m: None, cache=CompileCache())
            cache[name] = (loaded.module, out)
        return cache[name]

    return get


@pytest.mark.parametrize("name", ["gemma3-tiny", "qwen35-tiny-q4", "llama-tiny-q8", "ripple-tiny",
                                  "gemma3-tiny-full-windows", "gemma3-tiny-opset20"])
def test_onnxruntime_matches_eager(name, onnx_bundles):
    module, bundle = onnx_bundles(name)
    model = Model.load(bundle, device="onnxruntime")
    assert model.module_key == "onnxruntime"
    report = run_parity(module, model, PROMPT, steps=STEPS)
    assert report.steps == STEPS + 1
    assert report.tokens_agree, report.summary()
    assert report.worst_scaled_error <= SCALED_TOL_FP32, report.summary()


@pytest.mark.parametrize("name", ["gemma3-tiny-f16", "llama-tiny-q4-f16"])
def test_float16_graphs_match_eager_and_give_cuda_its_kernels(name, onnx_bundles):
    """`--dtype f16`: the graphs compute in float16 over float16 caches, as CUDA's GroupQueryAttention
    requires. Against the float32 eager reference within float16's rounding (a few units of 2^-11 of the
    terms); each attention is one GroupQueryAttention rotating q and k itself (Gemma's rings and per-head
    norms too), each q4 product one MatMulNBits with float16 scales, and against ONNX Runtime's CUDA
    kernel table neither op falls back, where the float32 export's attention does."""
    from foldline.backends.onnx.providers import module_gaps

    module, bundle = onnx_bundles(name)
    model = Model.load(bundle, device="onnxruntime")
    assert {b.dtype for b in model.manifest.state} == {"float16"}
    report = run_parity(module, model, PROMPT, steps=STEPS)
    assert report.tokens_agree, report.summary()
    assert report.worst_scaled_error <= SCALED_TOL_F16, report.summary()

    graphs = [onnx.load(str(g), load_external_data=False) for g in sorted(bundle.glob("*.onnx"))]
    layers = len(module.cfg.layer_types)
    for graph in graphs:
        attention = [n for n in graph.graph.node if n.op_type == "GroupQueryAttention"]
        assert len(attention) == layers
        assert all(helper.get_attribute_value(a) == 1 for n in attention for a in n.attribute if a.name == "do_rotary")
        products = [n for n in graph.graph.node if n.op_type == "MatMulNBits"]
        scales = {t.name: t.data_type for t in graph.graph.initializer}
        assert all(scales[n.input[2]] == onnx.TensorProto.FLOAT16 for n in products)
        if name.startswith("llama-tiny-q4"):
            assert len(products) >= 4 * layers  # qkv, o, gate/up, down a layer
    cuda = module_gaps(graphs)["cuda"]
    assert not {gap for gap in cuda if gap.startswith(("GroupQueryAttention", "MatMulNBits"))}, cuda
    f32_graphs = [onnx.load(str(g), load_external_data=False) for g in sorted(onnx_bundles(name[:-4])[1].glob("*.onnx"))]
    assert any(gap.startswith("GroupQueryAttention") for gap in module_gaps(f32_graphs)["cuda"])


def test_the_graphs_are_standard_onnx_over_one_weights_file(onnx_bundles):
    """Standard ops but MatMulNBits, the checker's full check passes, and the graphs share one
    external-data file holding the q4 codes as 4-bit blocks (two per byte), not a float copy."""
    _module, bundle = onnx_bundles("qwen35-tiny-q4")
    graphs = sorted(bundle.glob("*.onnx"))
    assert [g.name for g in graphs] == ["model.decode.onnx", "model.prefill.onnx"]
    assert Model.load(bundle, device="onnxruntime").manifest.modules["onnxruntime"].activations == "f32"
    locations = set()
    for path in graphs:
        onnx.checker.check_model(str(path), full_check=True)
        model = onnx.load(str(path), load_external_data=False)
        custom = {(n.domain, n.op_type) for n in model.graph.node if n.domain not in ("", "ai.onnx")}
        assert custom == {("com.microsoft", "MatMulNBits"), ("com.microsoft", "GroupQueryAttention"),
                          ("com.microsoft", "SkipSimplifiedLayerNormalization")}
        # every RMS norm is one node (backends/onnx/norms.py): no mean of a power is left
        powers = {n.output[0] for n in model.graph.node if n.op_type == "Pow"}
        assert not [n.name for n in model.graph.node if n.op_type == "ReduceMean" and n.input[0] in powers]
        assert any(n.op_type == "RMSNormalization" for n in model.graph.node)
        products = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
        inits = {t.name: t for t in model.graph.initializer}
        assert products and all(inits[n.input[1]].data_type == onnx.TensorProto.UINT8 for n in products)
        assert all(helper.get_attribute_value(a) == 4 for n in products for a in n.attribute if a.name == "bits")
        # no weight multiplied as floats: a MatMul by a constant is an offset's term (backends/onnx/nbits.py)
        assert all(n.input[1].endswith(".offsets_t") for n in model.graph.node
                   if n.op_type == "MatMul" and n.input[1] in inits)
        locations |= {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {"model.onnx.data"}
    # each distinct tensor is stored once: the file holds one graph's weights, not both graphs'
    lengths = [sum(int(e.value) for t in onnx.load(str(g), load_external_data=False).graph.initializer
                   for e in t.external_data if e.key == "length") for g in graphs]
    assert max(lengths) <= (bundle / "model.onnx.data").stat().st_size < sum(lengths)


def test_plain_onnxruntime_runs_the_prefill_graph(onnx_bundles):
    """What docs/onnx.md shows: the graph run from onnxruntime alone gives the runtime's logits."""
    import onnxruntime as ort

    _module, bundle = onnx_bundles("gemma3-tiny")
    model = Model.load(bundle, device="onnxruntime")
    expected = model.session().prefill(PROMPT[:16])

    session = ort.InferenceSession(str(bundle / "model.prefill.onnx"))
    feeds = {"tokens": np.array([PROMPT[:16]], np.int64), "start_pos": np.array([0], np.int64),
             "n_valid": np.array([16], np.int64), "kv_tiles": np.empty((0, 1), np.int8)}
    for buf in model.manifest.state:
        feeds[buf.name] = np.zeros(buf.shape, buf.host_dtype)
    outputs = session.run(None, feeds)
    names = [o.name for o in session.get_outputs()]
    assert names[-1] == "logits" and names[0] == model.manifest.state[0].name + ".next"
    np.testing.assert_array_equal(outputs[-1][0], expected)


@pytest.mark.parametrize("name", ["llama-tiny", "gemma3-tiny", "qwen35-tiny-q4"])
def test_attention_caches_are_updated_in_place(name, onnx_bundles, capsys):
    """One GroupQueryAttention per attention layer in prefill and decode (none for GDN): a global layer's
    over its full cache, a windowed layer's over its ring held in window order (`sliding_window_cache`,
    recorded as the module's window_order); every cache listed for the runtime to bind in place. A
    decode step writes the token's slot into a global cache's own array and nothing else there, and a
    plain `session.run` of the graph, which copies its caches, gives the same logits and caches."""
    import onnxruntime as ort

    module, bundle = onnx_bundles(name)
    layers = module.cfg.layer_types
    attending = [i for i, t in enumerate(layers) if t in ("global", "local")]
    decode = onnx.load(str(bundle / "model.decode.onnx"), load_external_data=False)
    prefill = onnx.load(str(bundle / "model.prefill.onnx"), load_external_data=False)
    for graph in (decode, prefill):
        attention = [n for n in graph.graph.node if n.op_type == "GroupQueryAttention"]
        assert len(attention) == len(attending)
        windowed = [helper.get_attribute_value(a) for n in attention for a in n.attribute if a.name == "sliding_window_cache"]
        assert sorted(windowed) == sorted(int(layers[i] == "local") for i in attending)
    model = Model.load(bundle, device="onnxruntime")
    assert model.manifest.modules["onnxruntime"].window_order == ("recent" if "local" in layers else None)
    from foldline.tools.cli import main

    main(["inspect", str(bundle)])
    assert ("windowed caches held in 'recent' order" in capsys.readouterr().out) == ("local" in layers)
    caches = {b.name for b in model.manifest.state if b.kind in ("global_kv", "local_kv")}
    full = {b.name for b in model.manifest.state if b.kind == "global_kv"}
    assert len(caches) == 2 * len(attending)
    assert model.ctx.inplace["decode"] == model.ctx.inplace["prefill"] == caches

    session = model.session()
    session.prefill(PROMPT[:20])  # past gemma3-tiny's 16-token window
    names = [b.name for b in model.manifest.state]
    before = {n: a.copy() for n, a in zip(names, session.buffers)}
    feeds = {"tokens": np.array([[7]], np.int64), "pos": np.array([20], np.int64),
             "pos_shape": np.empty((0, 20), np.int8), **before}
    plain = ort.InferenceSession(str(bundle / "model.decode.onnx")).run(None, feeds)
    logits = session.decode(7)
    np.testing.assert_allclose(logits, plain[-1][0], rtol=0, atol=1e-5)
    for name, after, copied in zip(names, session.buffers, plain):
        if name in full:
            changed = np.flatnonzero((after != before[name]).any(axis=(0, 1, 3)))
            assert set(changed) <= {20}, (name, changed)
            np.testing.assert_array_equal(after[:, :, 20], copied[:, :, 20])
            np.testing.assert_array_equal(after[:, :, :20], before[name][:, :, :20])
        elif name in caches:  # the window's 16 most recent positions, in order, the token's last
            np.testing.assert_array_equal(after, copied)
            np.testing.assert_array_equal(after[:, :, :15], before[name][:, :, 1:])


def test_a_batched_bundle_keeps_its_rings_in_every_function(onnx_bundles):
    """A batched bundle's batched functions attend over rings decomposed, and its one-row functions share
    their state: none of its graphs holds a windowed layer's cache in window order, its module records
    rings, and its one-row prefill and decode still match eager past the window."""
    module, bundle = onnx_bundles("gemma3-tiny-batch2")
    model = Model.load(bundle, device="onnxruntime")
    assert model.manifest.modules["onnxruntime"].window_order is None
    graphs = sorted(bundle.glob("model.*.onnx"))
    assert len(graphs) == 4  # prefill and decode, for one row and for two
    for path in graphs:
        graph = onnx.load(str(path), load_external_data=False).graph
        assert not [n.name for n in graph.node for a in n.attribute
                    if a.name == "sliding_window_cache" and helper.get_attribute_value(a)], path.name
    report = run_parity(module, model, PROMPT, steps=20)
    assert report.tokens_agree and report.worst_scaled_error <= SCALED_TOL_FP32, report.summary()


@pytest.mark.parametrize("name", ["llama-tiny", "gemma3-tiny"])
def test_group_query_attention_rotates_q_and_k(name, onnx_bundles):
    """Each GroupQueryAttention rotates its q and k itself (backends/onnx/rope.py), over one pair of tables
    per rotation (gemma3-tiny's windowed and global layers have two); llama-tiny then computes no other
    sine or cosine. The q and k
    norms of gemma3-tiny stay in the graph as RMSNormalization, which ONNX Runtime's CPU attention does
    not do. (test_onnxruntime_matches_eager holds the rotated graphs to eager.)"""
    module, bundle = onnx_bundles(name)
    for function in ("decode", "prefill"):
        graph = onnx.load(str(bundle / f"model.{function}.onnx"), load_external_data=False).graph
        attention = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
        assert attention
        assert all(helper.get_attribute_value(a) == 1 for n in attention for a in n.attribute if a.name == "do_rotary")
        assert all(n.input[7] and n.input[8] for n in attention)
        rotations = {module.cfg.rope_for(kind) for kind in set(module.cfg.layer_types)}
        assert len({(n.input[7], n.input[8]) for n in attention}) == len(rotations)  # one pair per rotation
        ops = [n.op_type for n in graph.node]
        if name == "llama-tiny":
            assert ops.count("Sin") == ops.count("Cos") == 1
        else:
            assert ops.count("RMSNormalization") >= 2 * len(attention)


def test_a_changed_graph_is_refused_at_load(onnx_bundles, tmp_path):
    _module, bundle = onnx_bundles("gemma3-tiny")
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    graph = copy / "model.decode.onnx"
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0xFF
    graph.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="model.decode.onnx does not match the manifest's sha256"):
        Model.load(copy, device="onnxruntime")
    with pytest.raises(BundleError, match="has no module for device 'cpu'"):
        Model.load(bundle, device="cpu")


def test_bench_times_the_onnx_bundle_beside_the_cpu_bundle_in_one_run(onnx_bundles, bundle_factory, tmp_path, capsys):
    """`foldline bench ONNX --device onnxruntime --also CPU`: both forms of the model, same prompt, one table."""
    from foldline.tools.cli import main

    _module, onnx_bundle = onnx_bundles("llama-tiny-q8")
    cpu_bundle = bundle_factory("llama-tiny")
    out = tmp_path / "bench.json"
    rc = main(["bench", str(onnx_bundle), "--device", "onnxruntime", "--also", str(cpu_bundle), "--prompt-len", "20",
               "--new-tokens", "8", "--rounds", "1", "--busy-ok", "--json", str(out)])
    assert rc == 0
    also = f"foldline (cpu) {cpu_bundle.name}"
    assert f"foldline (onnxruntime) / {also}" in capsys.readouterr().out
    engines = json.loads(out.read_text())["engines"]
    assert engines["foldline (onnxruntime)"]["module"] == "onnxruntime"
    assert engines[also]["module"].startswith("cpu")  # the other bundle ran on its IREE CPU module
    for figures in engines.values():
        assert figures["prefill_tok_s"] > 0 and figures["decode_tok_s"] > 0 and figures["threads"] >= 1


def test_a_table_tied_to_a_q8_head_is_held_once(onnx_bundles):
    """llama-tiny's embedding is its head: the lookup reads the head's MatMulNBits blocks (u = q + 128,
    reshaped to [N, K]) and the int8 table is gone from both graphs; the parity test above holds the
    values to eager."""
    _module, bundle = onnx_bundles("llama-tiny-q8")
    for graph in sorted(bundle.glob("*.onnx")):
        model = onnx.load(graph, load_external_data=False)
        inits = {t.name: t for t in model.graph.initializer}
        reshapes = [n for n in model.graph.node if n.op_type == "Reshape" and n.name.endswith(".from_blocks")]
        assert len(reshapes) == 1, graph.name
        blocks = inits[reshapes[0].input[0]]
        assert blocks.data_type == onnx.TensorProto.UINT8 and blocks.dims[0] == 512  # the vocabulary's rows
        heads = [n for n in model.graph.node if n.op_type == "MatMulNBits" and n.input[1] == blocks.name]
        assert len(heads) == 1, graph.name
        tables = [t.name for t in inits.values() if t.data_type == onnx.TensorProto.INT8 and t.dims[:1] == [512]]
        assert tables == [], f"{graph.name} still holds an int8 table: {tables}"


def test_windowed_layers_holding_full_caches_run_as_group_query_attention(onnx_bundles):
    """Without ring-buffer-swa, gemma3-tiny's window layers hold full caches: their one-row attention is
    GroupQueryAttention with a local window of W keys, the global layer's without; the parity test
    above holds every position to eager, the window crossed several times."""
    from foldline.backends.onnx.gqa import local_window
    from foldline.frontend.arch.gemma3 import gemma3_tiny

    cfg = gemma3_tiny()
    windows = sorted(local_window(cfg.sliding_window if t == "local" else 0) for t in cfg.layer_types)
    _module, bundle = onnx_bundles("gemma3-tiny-full-windows")
    model = onnx.load(bundle / "model.decode.onnx", load_external_data=False)
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    got = sorted(next(a.i for a in n.attribute if a.name == "local_window_size") for n in gqa)
    assert got == windows and -1 in got and cfg.sliding_window in got


def test_a_saved_session_holding_its_windows_in_order_resumes_to_the_bit(onnx_bundles, tmp_path):
    """gemma3-tiny's windowed caches in window order (the module's window_order): a session file stores
    their filled rows, before the window fills and after, and a session resumed from it, fresh or over a
    longer conversation, gives the uninterrupted logits to the bit (tests/runtime/test_session_file.py: rings)."""
    from foldline.runtime.session_file import held_nbytes

    _module, bundle = onnx_bundles("gemma3-tiny")
    rng = np.random.default_rng(2)
    path = tmp_path / "chat.session"
    with Model.load(bundle, device="onnxruntime") as model:
        assert model.identity()["window_order"] == "recent"
        for prompt_length in (7, 40):
            prompt, other, later = (rng.integers(1, model.vocab_size, n).tolist() for n in (prompt_length, 90, 20))
            with model.session() as uninterrupted:
                uninterrupted.prefill(prompt)
                uninterrupted.decode(5)
                uninterrupted.save(path)
                want = [uninterrupted.decode(9), uninterrupted.prefill(later)]
            assert path.stat().st_size < held_nbytes(model.row_layout(), prompt_length + 1) + (16 << 10)
            with model.session_from(path) as fresh, model.session() as used:
                used.prefill(other)
                used.restore(model.read_snapshot(path))
                for session in (fresh, used):
                    got = [session.decode(9), session.prefill(later)]
                    assert all(np.array_equal(w, g) for w, g in zip(want, got)), prompt_length


def test_the_manifest_names_the_nodes_each_gpu_provider_leaves_to_the_next(onnx_bundles, capsys):
    """The compile checks its graphs against ONNX Runtime's kernel table: for CUDA and DirectML, the nodes no
    kernel of theirs takes, as `foldline inspect` prints them. Against the CPU provider's table the check
    finds no gap in any graph of these bundles, which ONNX Runtime ran on its CPU provider above."""
    from foldline.backends.onnx.providers import module_gaps, provider_gaps
    from foldline.contract.manifest import Manifest
    from foldline.tools.cli import main

    for name in ("gemma3-tiny", "qwen35-tiny-q4", "llama-tiny-q8", "ripple-tiny", "gemma3-tiny-full-windows"):
        _module, bundle = onnx_bundles(name)
        entry = Manifest.load(bundle).modules["onnxruntime"]
        graphs = [onnx.load(bundle / part.file, load_external_data=False) for part in entry.parts.values()]
        assert all(not provider_gaps(graph, "cpu") for graph in graphs), name
        assert entry.provider_gaps == module_gaps(graphs) and set(entry.provider_gaps) == {"cuda", "dml"}, name
    _module, bundle = onnx_bundles("qwen35-tiny-q4")
    gaps = Manifest.load(bundle).modules["onnxruntime"].provider_gaps
    assert main(["inspect", str(bundle)]) == 0
    out = capsys.readouterr().out
    for provider, ops in gaps.items():
        line = f"under {provider}: " + (f"{sum(ops.values())} nodes have no {provider} kernel" if ops
                                        else "every node has a kernel")
        assert line in out, (line, out)


def test_an_opset_20_export_leaves_directml_no_gap_from_its_opset(onnx_bundles):
    """`--onnx-opset 20`: graphs at opset 20, the norms that follow no residual add in plain ops (gemma3-tiny's
    q/k and post norms), every other norm still one SkipSimplifiedLayerNormalization. Against DirectML's kernel
    table the shape ops the opset 23 export left without a kernel (Reshape, Cast, Transpose, ...) all have one.
    It matches eager in test_onnxruntime_matches_eager."""
    from foldline.contract.manifest import Manifest

    graphs = {}
    for name in ("gemma3-tiny", "gemma3-tiny-opset20"):
        _module, bundle = onnx_bundles(name)
        entry = Manifest.load(bundle).modules["onnxruntime"]
        graphs[name] = (entry, [onnx.load(bundle / part.file, load_external_data=False) for part in entry.parts.values()])
    (new_entry, low), (old_entry, high) = graphs["gemma3-tiny-opset20"], graphs["gemma3-tiny"]
    for graph in low:
        assert {o.version for o in graph.opset_import if o.domain == ""} == {20}
        ops = [n.op_type for n in graph.graph.node]
        assert "RMSNormalization" not in ops and "ReduceMean" in ops and "SkipSimplifiedLayerNormalization" in ops
    assert all({o.version for o in g.opset_import if o.domain == ""} == {23} for g in high)
    shape_ops = {"Reshape", "Cast", "Transpose", "Unsqueeze", "Shape"}

    def kinds(gaps: dict[str, int]) -> set[str]:  # "Reshape (int64)" -> "Reshape"
        return {kind.split(" ")[0] for kind in gaps}

    assert shape_ops & kinds(old_entry.provider_gaps["dml"]), old_entry.provider_gaps["dml"]
    assert not shape_ops & kinds(new_entry.provider_gaps["dml"]), new_entry.provider_gaps["dml"]
    assert sum(new_entry.provider_gaps["dml"].values()) < sum(old_entry.provider_gaps["dml"].values()) / 4
    assert "opset 20" in new_entry.description


def test_onnx_opset_is_for_onnx_targets(tmp_path, capsys):
    from foldline.contract.manifest import Manifest
    from foldline.tools.cli import main

    assert main(["compile", "llama-tiny", "-o", str(tmp_path / "b"), "--onnx-opset", "21"]) == 2
    assert "--onnx-opset is for --target onnx or onnx-genai" in capsys.readouterr().err
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())
    assert main(["compile", "llama-tiny", "-o", str(tmp_path / "b"), "--target", "onnx", "--onnx-opset", "19"]) == 2
    assert "--onnx-opset takes 20, 21, 22, 23, not 19" in capsys.readouterr().err
    assert main(["compile", "llama-tiny", "-o", str(tmp_path / "onnx"), "--target", "onnx", "--onnx-opset", "20"]) == 0
    assert "opset 20" in Manifest.load(tmp_path / "onnx").modules["onnxruntime"].description


"""ONNX out: the bundle's functions as ONNX graphs that a stock onnxruntime runs.

Each function (prefill, decode and the row variants of a batched bundle)
becomes one graph, `model.<function>.onnx`, exported from its post-pass
program: the Hadamard rotations folded, the windowed caches as rings, the
weights in their block formats. foldline's custom ops are decomposed into
core aten first, by the decompositions they register (the portable form the
GPU targets compile), so the graphs hold standard ONNX ops only and need no
custom-op library. The quantized products become ONNX Runtime's
MatMulNBits (backends/onnx/nbits.py): the blocks stay 4- or 8-bit codes with
their scales, multiplied without a float copy; a product MatMulNBits cannot take
(another dtype, a group that is not a power of two) is dequantized in the graph.

State is explicit. Inputs: the step inputs by their entry-point names, then
the state buffers by their manifest names. Outputs: each buffer's next value
(`<name>.next`), then `logits`. The graphs' weights are one external-data
file, `model.onnx.data`, in which bytes that several graphs hold are stored
once.
"""

from __future__ import annotations

import hashlib
import logging
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import onnx
import torch
from onnx.external_data_helper import set_external_data
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind, OutputSpec
from torch.utils import _pytree as pytree

from ...contract.entry_points import NEXT_SUFFIX, takes_position_shape
from ...contract.manifest import FileEntry, ModuleEntry
from ...contract.state import StateBuffer
from ...errors import FoldlineError
from ...frontend import quant  # noqa: F401  (registers foldline::qlinear's decomposition)
from ...frontend.op_registry import DECOMPOSITIONS
from ...frontend.quant import QEMBEDDING, QLINEAR
from ...passes.manager import CompileUnit, TargetPasses
from ..lowering import KEPT_OPS, Lowering
from ..targets import ONNX_DEVICE
from .common_subexpressions import COMMON_SUBEXPRESSIONS_GRAPH_REWRITE
from .gqa import (
    GQA_ATTENTION,
    GQA_GRAPH_REWRITE,
    GQA_PASS,
    GQA_ROPE_ATTENTION,
    RING_OPS,
    WINDOW_CACHES,
    WINDOW_ORDER,
)
from .gqa import translation as gqa_translation
from .graph_rewrites import MAX_OPSET, GraphSettings, run_graph_rewrites
from .nbits import (
    NBITS_GRAPH_REWRITE,
    embedding_fits,
    embedding_translation,
    fits,
    placeholder_translation,
)
from .norms import NORMS_GRAPH_REWRITE
from .packed_qkv import PACKED_QKV_GRAPH_REWRITE
from .providers import module_gaps

DATA_FILE = "model.onnx.data"
EXTERNAL_MIN_BYTES = 1024  # smaller initializers stay in their graph
# The step inputs of each entry point, in order (contract/entry_points.py).
STEP_INPUTS = {"prefill": ("tokens", "start_pos", "n_valid", "kv_tiles"), "decode": ("tokens", "pos", "pos_shape"),
               "decode_rows": ("tokens", "pos", "n_valid")}


class OnnxExportError(FoldlineError, ValueError):
    """A program the ONNX export cannot express."""


def graph_file(function: str) -> str:
    return f"model.{function}.onnx"


def step_inputs(function: str, rows: int) -> tuple[str, ...]:
    """The step inputs of `function` (prefill, decode, prefill_rows2, ...); batched decode takes n_valid
    where one row takes pos_shape."""
    if function.startswith("prefill"):
        return STEP_INPUTS["prefill"]
    return STEP_INPUTS["decode" if takes_position_shape(rows) else "decode_rows"]


# The ONNX graph rewrites (graph_rewrites.py) each exported graph takes, in order: the placeholders
# become ONNX Runtime's operators (attention fed its packed q/k/v where it can be) before the norms are
# matched around them; the per-layer copies are merged last, once nothing is matched by name any more.
GRAPH_REWRITE_ORDER = (GQA_GRAPH_REWRITE, PACKED_QKV_GRAPH_REWRITE, NBITS_GRAPH_REWRITE, NORMS_GRAPH_REWRITE,
                       COMMON_SUBEXPRESSIONS_GRAPH_REWRITE)


def _lowering() -> Lowering:
    """backends/lowering.py's node-by-node decomposition; of the ops the IREE targets keep for their
    kernels, the quantized products MatMulNBits fits stay (nbits.fits), the rest decompose."""
    lowering = Lowering()
    for op in KEPT_OPS:
        lowering.table[op] = DECOMPOSITIONS[op]
    return lowering


def _keeps_product(_name: str, node) -> bool:
    return node.target == QLINEAR and fits(node)


def _keeps_product_and_lookup(name: str, node) -> bool:
    """_keeps_product, and the q8 embedding lookups GatherBlockQuantized takes (nbits.embedding_fits)."""
    return _keeps_product(name, node) or (node.target == QEMBEDDING and embedding_fits(node))


def _with_fused_attention(gqa: TargetPasses, function: str, program: ExportedProgram) -> ExportedProgram:
    """A one-row program through the onnx-gqa pass: its caches' writes and attention as
    foldline::gqa_attention (the rings' too, with window caches: then none may be left, since the graphs
    share their state)."""
    program = gqa.run(function, program)
    if gqa.options[WINDOW_CACHES]:
        left = sorted({str(n.target) for n in program.graph.nodes if n.op == "call_function" and n.target in RING_OPS})
        if left:
            raise OnnxExportError(f"{', '.join(left)} left beside window-ordered caches: a ring would be read in "
                                  "the wrong order")
    return program


def _functional(program: ExportedProgram, n_state: int, lookups: bool = False) -> ExportedProgram:
    """The program in core aten, its state updates as outputs: (next state..., logits).

    An exported entry point writes its state buffers in place (input mutations);
    ONNX has no in-place update, so each mutation becomes an output, in the
    order of the state inputs. lookups: q8 embedding lookups are kept too (GatherBlockQuantized).
    """
    program = _lowering().program("", program, keep=_keeps_product_and_lookup if lookups else _keeps_product)
    left = sorted({str(n.target) for n in program.graph.nodes
                   if n.op == "call_function" and str(n.target).startswith("foldline.")
                   and n.target not in (QLINEAR, QEMBEDDING, GQA_ATTENTION, GQA_ROPE_ATTENTION)})
    if left:
        raise OnnxExportError(f"no decomposition for {', '.join(left)}: ONNX has no form of these ops")
    sig = program.graph_signature
    state_inputs = list(sig.user_inputs[len(sig.user_inputs) - n_state:])
    mutated = [o.target for o in sig.output_specs if o.kind == OutputKind.USER_INPUT_MUTATION]
    if mutated != state_inputs:
        raise OnnxExportError(f"the program updates {mutated}, not each of its state inputs {state_inputs} in order")
    sig.output_specs[:] = [OutputSpec(OutputKind.USER_OUTPUT, o.arg, None)
                           if o.kind == OutputKind.USER_INPUT_MUTATION else o for o in sig.output_specs]
    program._module_call_graph[0].signature.out_spec = pytree.tree_flatten(tuple(range(len(sig.output_specs))))[1]
    return program


def export_function(program: ExportedProgram, function: str, rows: int, state: list[StateBuffer],
                    activations: str = "f32", steps: tuple[str, ...] | None = None,
                    gather_block_quantized: bool = False, opset: int = MAX_OPSET) -> onnx.ModelProto:
    """One function as an ONNX model, its inputs and outputs named as the module's contract names them.

    program: after the target passes (a one-row program's attention as GroupQueryAttention's op).
    activations: what MatMulNBits multiplies the codes by, "int8" (per block, ONNX Runtime's accuracy
    level 4) or "f32". steps: the step inputs' names (default: the entry point's, step_inputs).
    gather_block_quantized: q8 embedding lookups as ONNX Runtime's GatherBlockQuantized (nbits.py).
    opset: the highest default-domain opset the graph may use (graph_rewrites.GraphSettings).
    """
    functional = _functional(program, len(state), gather_block_quantized)
    lookups = {QEMBEDDING: embedding_translation()} if gather_block_quantized else {}
    inputs = [*(steps if steps is not None else step_inputs(function, rows)), *(s.name for s in state)]
    outputs = [*(s.name + NEXT_SUFFIX for s in state), "logits"]
    # The exporter logs a line per torchvision op it cannot register and pytree deprecations: noise to a user.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        exported = torch.onnx.export(functional, dynamo=True, verbose=False, input_names=inputs,
                                     output_names=outputs, optimize=False,
                                     custom_translation_table={QLINEAR: placeholder_translation(), **lookups,
                                                               **gqa_translation()})
    model = exported.model_proto
    run_graph_rewrites(model, GRAPH_REWRITE_ORDER, GraphSettings(activations, opset))
    for node in model.graph.node:  # the exporter's per-node Python stack traces: most of the graph's bytes
        node.ClearField("metadata_props")
        node.ClearField("doc_string")
    got = [i.name for i in model.graph.input]
    if got != inputs:
        raise OnnxExportError(f"the {function} graph takes {got}, expected {inputs}")
    return model


class SharedWeights:
    """One external-data file for several graphs: each distinct initializer's bytes written once."""

    def __init__(self, path: Path):
        self.path = path
        self.offsets: dict[str, tuple[int, int]] = {}  # sha256 of the bytes -> (offset, length)
        self._file = open(path, "wb")

    def externalize(self, model: onnx.ModelProto) -> None:
        """Move the model's large initializers into the shared file (in place)."""
        for tensor in model.graph.initializer:
            if not tensor.HasField("raw_data") or len(tensor.raw_data) < EXTERNAL_MIN_BYTES:
                continue
            raw = tensor.raw_data
            key = hashlib.sha256(raw).hexdigest()
            if key not in self.offsets:
                offset = -(-self._file.tell() // 64) * 64  # aligned, so the runtime may map it
                self._file.seek(offset)
                self._file.write(raw)
                self.offsets[key] = (offset, len(raw))
            offset, length = self.offsets[key]
            set_external_data(tensor, self.path.name, offset, length)
            tensor.ClearField("raw_data")
            tensor.data_location = onnx.TensorProto.EXTERNAL

    def close(self) -> None:
        self._file.close()


def export_module(unit: CompileUnit, rows: dict[str, int], out: Path, progress: Callable[[str], None] = print,
                  activations: str = "f32", dump_after: dict[str, Path] | None = None,
                  opset: int = MAX_OPSET) -> ModuleEntry:
    """Every function as `model.<function>.onnx` over one shared `model.onnx.data`; the manifest's entry.

    unit: the post-pass programs by function name, their state and config (the context bounds the
    positions the rotation tables cover). rows: the rows each function computes. activations: "int8" or
    "f32", for the quantized products (export_function). dump_after: `--dump-after` for the onnx-gqa pass,
    which runs on each one-row function. opset: the highest opset the graphs may use (`--onnx-opset`).

    A bundle whose functions all compute one row keeps its windowed layers' caches in window order,
    as GroupQueryAttention's `sliding_window_cache` does (docs/onnx.md); a batched one keeps rings,
    which its batched functions attend over decomposed. The entry's `window_order` records it.
    """
    window_caches = all(rows[function] == 1 for function in unit.programs) and any(
        n.op == "call_function" and n.target in RING_OPS for program in unit.programs.values()
        for n in program.graph.nodes)
    gqa = TargetPasses(unit, [GQA_PASS], dump_after, options={WINDOW_CACHES: window_caches})
    weights = SharedWeights(out / DATA_FILE)
    parts: dict[str, FileEntry] = {}
    opsets: set[int] = set()
    graphs: list[onnx.ModelProto] = []
    try:
        for function, program in unit.programs.items():
            t0 = time.time()
            if rows[function] == 1:
                program = _with_fused_attention(gqa, function, program)
            model = export_function(program, function, rows[function], unit.state_specs, activations, opset=opset)
            graphs.append(model)
            weights.externalize(model)
            path = out / graph_file(function)
            onnx.save_model(model, path)
            onnx.checker.check_model(str(path), full_check=True)
            opsets |= {o.version for o in model.opset_import if o.domain in ("", "ai.onnx")}
            parts[function] = FileEntry.of(path)
            progress(f"      {path.name}: {len(model.graph.node)} nodes, opset {max(opsets)}, "
                     f"{time.time() - t0:.0f} s")
    finally:
        weights.close()
    entry = FileEntry.of(out / DATA_FILE)
    gaps = module_gaps(graphs)
    nodes = sum(len(graph.graph.node) for graph in graphs)
    for provider, ops in gaps.items():
        most = sorted(ops.items(), key=lambda item: -item[1])
        more = len(most) - 4
        listed = ", ".join(f"{n} {op}" for op, n in most[:4]) + (
            f" and {more} more kind{'s' if more > 1 else ''} (foldline inspect lists them)" if more > 0 else "")
        progress(f"      under {provider}: {sum(ops.values())} of {nodes} nodes have no {provider} kernel"
                 + (f" and would run on the next provider: {listed}" if ops else ""))
    return ModuleEntry(entry.file, entry.sha256, entry.size, device=ONNX_DEVICE,
                       description=f"ONNX opset {max(opsets)} for ONNX Runtime", executable_formats=["onnx"],
                       activations=activations, parts=parts, window_order=WINDOW_ORDER if window_caches else None,
                       provider_gaps=gaps)

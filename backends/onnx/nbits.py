"""foldline's quantized products as ONNX Runtime's MatMulNBits, their blocks kept.

ONNX Runtime's `com.microsoft.MatMulNBits` multiplies by 4- or 8-bit block codes
without a float copy of the weight, with int8-activation kernels for AVX2,
AVX-512 and NEON. The export emits each foldline::qlinear it keeps as a
`foldline.QLinear` placeholder over the codes, scales and mins initializers
(the schema is registered here, so the exporter can build it); `to_matmul_nbits`
then rewrites every placeholder into MatMulNBits, the codes repacked to its
layout and no placeholder left behind.

The repacking is exact. MatMulNBits computes s * (u - z) with the default zero
point z (8 for 4 bits, 128 for 8 bits), u the unsigned code:
- q4: u is foldline's code (0..15), so w = s * u + m = s * (u - 8) + (m + 8 s);
- q8: u = q + 128, so w = s * q + m = s * (u - 128) + m.
Where the offset (m + 8 s, or m) is zero in every group (GGUF Q4_0, Q8_0, Q6_K),
MatMulNBits is the whole product; otherwise the graph adds the offset's term,
each group's sum of x times its offset (a product 1/group the size of the main
one).

An embedding table tied to a q8 head is held once: the lookup gathers its rows
from the head's blocks (u = q + 128) and takes the 128 off the gathered rows.
Where the export keeps a q8 lookup as a `foldline.QEmbedding` placeholder
(`--target onnx-genai`), it becomes one `com.microsoft.GatherBlockQuantized`
over the same blocks and scales (8 bits, its default zero point 128), the head's
when the table is tied to it.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.defs import OpSchema
from torch.fx import Node

from ...contract.block_formats import row_length
from ...errors import FoldlineError
from ...frontend.quant import QuantizedTensor, unpack_q4
from .graph_rewrites import GraphIndex, GraphSettings, register_graph_rewrite

PLACEHOLDER_DOMAIN = "foldline"
ORT_DOMAIN = "com.microsoft"
BITS = {"q4": 4, "q8": 8}
DEFAULT_ZERO = {"q4": 8, "q8": 128}  # MatMulNBits' zero point when none is given
NBITS_GRAPH_REWRITE = "matmul-nbits"
ACCURACY_LEVEL = {"int8": 4, "f32": 0}  # 4: int8 activations per block (where the CPU has a kernel); 0: float


class MatMulNBitsError(FoldlineError, ValueError):
    """A quantized product the MatMulNBits rewrite cannot express."""


def register_placeholder() -> None:
    """Register `foldline.QLinear` (x, codes, scales, mins?) -> y with attributes fmt and group, once."""
    if onnx.defs.has("QLinear", PLACEHOLDER_DOMAIN):
        return
    param = OpSchema.FormalParameter
    onnx.defs.register_schema(OpSchema(
        "QLinear", PLACEHOLDER_DOMAIN, 1,
        inputs=[param("x", "T"), param("codes", "C"), param("scales", "S"),
                param("mins", "S", param_option=OpSchema.FormalParameterOption.Optional)],
        outputs=[param("y", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], ""),
                          ("C", ["tensor(uint8)", "tensor(int8)"], ""),
                          ("S", ["tensor(float)", "tensor(float16)"], "")],
        attributes=[OpSchema.Attribute("fmt", OpSchema.AttrType.STRING, ""),
                    OpSchema.Attribute("group", OpSchema.AttrType.INT, "")],
    ))


def register_embedding_placeholder() -> None:
    """Register `foldline.QEmbedding` (codes, scales, ids) -> rows with attributes fmt and group, once."""
    if onnx.defs.has("QEmbedding", PLACEHOLDER_DOMAIN):
        return
    param = OpSchema.FormalParameter
    onnx.defs.register_schema(OpSchema(
        "QEmbedding", PLACEHOLDER_DOMAIN, 1,
        inputs=[param("codes", "C"), param("scales", "S"), param("ids", "I")],
        outputs=[param("rows", "T")],
        type_constraints=[("T", ["tensor(float)"], ""), ("C", ["tensor(uint8)", "tensor(int8)"], ""),
                          ("S", ["tensor(float)", "tensor(float16)"], ""), ("I", ["tensor(int64)"], "")],
        attributes=[OpSchema.Attribute("fmt", OpSchema.AttrType.STRING, ""),
                    OpSchema.Attribute("group", OpSchema.AttrType.INT, "")],
    ))


def embedding_translation():
    """The exporter's translation of foldline::qembedding: the placeholder node, rewritten after export."""
    import onnxscript

    register_embedding_placeholder()
    ops = onnxscript.values.Opset(PLACEHOLDER_DOMAIN, 1)

    def qembedding(codes, scales, mins, ids, fmt: str = "q8", group: int = 32):
        return ops.QEmbedding(codes, scales, ids, fmt=fmt, group=group)

    return qembedding


def embedding_fits(node: Node) -> bool:
    """Whether a foldline::qembedding node becomes GatherBlockQuantized: q8 blocks without mins that are
    program inputs, in a group it takes (a power of two >= 16)."""
    codes, scales, mins, _ids, fmt, group = node.args
    weights_are_inputs = all(isinstance(a, Node) and a.op == "placeholder" for a in (codes, scales))
    return fmt == "q8" and mins is None and weights_are_inputs and group >= 16 and group & (group - 1) == 0


def placeholder_translation():
    """The exporter's translation of foldline::qlinear: the placeholder node, rewritten after export."""
    import onnxscript

    register_placeholder()
    ops = onnxscript.values.Opset(PLACEHOLDER_DOMAIN, 1)

    def qlinear(x, codes, scales, mins=None, fmt: str = "q8", group: int = 32):
        return ops.QLinear(x, codes, scales, mins, fmt=fmt, group=group)

    return qlinear


def fits(node: Node) -> bool:
    """Whether a foldline::qlinear node becomes MatMulNBits: float32 or float16 activations, weights that
    are program inputs (initializers once exported), and a group MatMulNBits takes (a power of two >= 16)."""
    x, codes, scales, mins, _fmt, group = node.args
    weights_are_inputs = all(a is None or (isinstance(a, Node) and a.op == "placeholder") for a in (codes, scales, mins))
    x_val = x.meta.get("val") if isinstance(x, Node) else None
    return (weights_are_inputs and x_val is not None and str(x_val.dtype) in ("torch.float32", "torch.float16")
            and group >= 16 and group & (group - 1) == 0)


def _blocks(fmt: str, codes: np.ndarray, group: int) -> np.ndarray:
    """foldline codes -> MatMulNBits' B [N, blocks, group * bits / 8]: 4-bit element 2j in byte j's low nibble."""
    n = codes.shape[0]
    if fmt == "q4":
        q = unpack_q4(codes, group)  # [N, blocks, group], element order
        return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    return (codes.astype(np.int16) + 128).astype(np.uint8).reshape(n, -1, group)


def _offsets(fmt: str, scales: np.ndarray, mins: np.ndarray | None) -> np.ndarray | None:
    """Each group's w - s * (u - z) (module docstring), float32 [N, blocks]; None where all are zero."""
    if fmt == "q4":
        offset = mins + np.float32(DEFAULT_ZERO["q4"]) * scales
    elif mins is not None:
        offset = mins
    else:
        return None
    return None if not np.any(offset) else offset


class _Rewrite:
    """One graph's placeholders into MatMulNBits nodes and their initializers."""

    def __init__(self, model: onnx.ModelProto, accuracy_level: int):
        self.graph = model.graph
        self.inits = {t.name: t for t in self.graph.initializer}
        self.accuracy_level = accuracy_level
        self.new_inits: list[onnx.TensorProto] = []
        self.q8_blocks: dict[str, tuple[str, int, int]] = {}  # q8 codes -> (their MatMulNBits blocks, N, K)
        self.index = GraphIndex(model)

    def float_type(self, name: str) -> type:
        """The numpy type of a product's activations (float16 compute, else float32): MatMulNBits takes its
        scales, and the offset's term its table, in the activations' type."""
        return np.float16 if self.index.types.get(name) == onnx.TensorProto.FLOAT16 else np.float32

    def array(self, name: str, what: str) -> np.ndarray:
        if name not in self.inits:
            raise MatMulNBitsError(f"the {what} {name!r} of a quantized product is computed in the graph, "
                                   "not a weight: MatMulNBits needs it constant")
        return numpy_helper.to_array(self.inits[name])

    def constant(self, name: str, value: np.ndarray) -> str:
        self.new_inits.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def nodes_for(self, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        fmt, group = attrs["fmt"].decode() if isinstance(attrs["fmt"], bytes) else attrs["fmt"], attrs["group"]
        if fmt not in (*BITS, "q5"):
            raise MatMulNBitsError(f"block format {fmt!r} has no MatMulNBits form; expected one of "
                                   f"{sorted((*BITS, 'q5'))}")
        x, codes_name, scales_name, mins_name = (list(node.input) + [""] * 4)[:4]
        codes = self.array(codes_name, "codes")
        scales = self.array(scales_name, "scales").astype(np.float32)
        mins = self.array(mins_name, "mins").astype(np.float32) if mins_name else None
        shared = fmt == "q8"  # q8 tables may also be read by an embedding lookup (_read_tied_tables_from_blocks)
        if fmt == "q5":  # MatMulNBits has no 5-bit blocks: the codes as 8-bit ones, exactly (Q5_0: q - 16)
            k = row_length("q5", codes.shape[1])
            wide = QuantizedTensor("q5", (codes.shape[0], k), group, codes.view(np.uint8), scales, mins).as_q8()
            codes, mins, fmt = wide.codes, wide.mins, "q8"
        b = _blocks(fmt, codes, group)
        n, blocks = b.shape[0], b.shape[1]
        base = node.output[0]
        dtype = self.float_type(x)
        if shared and codes_name not in self.q8_blocks:
            self.q8_blocks[codes_name] = (f"{codes_name}.nbits", n, blocks * group)
        out = [helper.make_node(
            "MatMulNBits", [x, self.constant(f"{codes_name}.nbits", b), self.constant(f"{scales_name}.nbits",
                                                                                      scales.reshape(-1).astype(dtype))],
            [base + ".nbits"], name=base + ".nbits", domain=ORT_DOMAIN,
            K=blocks * group, N=n, bits=BITS[fmt], block_size=group, accuracy_level=self.accuracy_level)]
        offsets = _offsets(fmt, scales, mins)
        if offsets is None:
            out[0].output[0] = base
            return out
        # y += (x summed per group) @ offsets^T
        axes = self.constant(f"{base}.last_axis", np.array([-1], np.int64))
        off_t = self.constant(f"{mins_name or scales_name}.offsets_t", offsets.T.astype(dtype))
        rank = self.index.rank(x)
        if rank:  # x's leading dims kept by Reshape's 0s: no node computes the shape
            grouped = self.constant(f"{base}.grouped_shape", np.array([0] * (rank - 1) + [blocks, group], np.int64))
            out.append(helper.make_node("Reshape", [x, grouped], [base + ".grouped"]))
        else:
            tail = self.constant(f"{base}.group_shape", np.array([blocks, group], np.int64))
            out += [helper.make_node("Shape", [x], [base + ".lead"], end=-1),
                    helper.make_node("Concat", [base + ".lead", tail], [base + ".grouped_shape"], axis=0),
                    helper.make_node("Reshape", [x, base + ".grouped_shape"], [base + ".grouped"])]
        out += [
            helper.make_node("ReduceSum", [base + ".grouped", axes], [base + ".sums"], keepdims=0),
            helper.make_node("MatMul", [base + ".sums", off_t], [base + ".offset"]),
            helper.make_node("Add", [base + ".nbits", base + ".offset"], [base]),
        ]
        return out

    def gather_nodes_for(self, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        """A q8 lookup as GatherBlockQuantized: the head's MatMulNBits blocks and scales reshaped to [N, K] and
        [N, K / group] where the table is tied to a q8 head (held once), else its own codes + 128."""
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        group = attrs["group"]
        codes_name, scales_name, ids = node.input
        base = node.output[0]
        out = []
        head_scales = f"{scales_name}.nbits"
        shared = next((t for t in self.new_inits if t.name == head_scales), None)
        widen = False  # the rows come out in the scales' type: float16 scales of a float16 head, widened
        if codes_name in self.q8_blocks and shared is not None:
            widen = shared.data_type == onnx.TensorProto.FLOAT16
            blocks, n, k = self.q8_blocks[codes_name]
            rows, row_scales = f"{codes_name}.from_blocks", f"{scales_name}.from_blocks"
            out += [helper.make_node("Reshape", [blocks, self.constant(f"{rows}.shape", np.array([n, k], np.int64))],
                                     [rows], name=rows),
                    helper.make_node("Reshape", [head_scales,
                                                 self.constant(f"{row_scales}.shape", np.array([n, k // group], np.int64))],
                                     [row_scales], name=row_scales)]
        else:
            codes = self.array(codes_name, "codes")
            scales = self.array(scales_name, "scales").astype(np.float32)
            rows = self.constant(f"{codes_name}.u8", (codes.astype(np.int16) + DEFAULT_ZERO["q8"]).astype(np.uint8))
            row_scales = self.constant(f"{scales_name}.f32", scales.reshape(codes.shape[0], -1))
        gathered = base + ".f16" if widen else base
        out.append(helper.make_node("GatherBlockQuantized", [rows, ids, row_scales], [gathered], name=gathered,
                                    domain=ORT_DOMAIN, gather_axis=0, quantize_axis=1, block_size=group, bits=8))
        if widen:  # the lookup's rows are float32 in the graph (the placeholder's type)
            out.append(helper.make_node("Cast", [gathered], [base], to=onnx.TensorProto.FLOAT, name=base))
        return out


# Ops that move a table's elements without reading their values: the embedding lookup's path from the
# codes to the Cast that widens the gathered rows (the decomposition of foldline::qembedding).
_MOVES_ONLY = {"Transpose", "Gather", "GatherND", "Reshape", "Squeeze", "Unsqueeze", "Slice", "Identity"}
Q8_OFFSET = DEFAULT_ZERO["q8"]  # MatMulNBits' 8-bit blocks hold u = q + Q8_OFFSET


def _widening_casts(codes: str, consumers: dict[str, list[onnx.NodeProto]]
                    ) -> tuple[list[onnx.NodeProto], set[str]] | None:
    """The Casts to float32 that every path from `codes` through element moves ends in, and the tensors
    moved on the way; None where a path meets any other op (its values would change meaning if the
    codes were offset)."""
    casts, moved, front, seen = [], set(), [codes], set()
    while front:
        for node in consumers.get(front.pop(), []):
            if id(node) in seen:
                continue
            seen.add(id(node))
            if node.op_type == "Cast" and helper.get_attribute_value(node.attribute[0]) == onnx.TensorProto.FLOAT:
                casts.append(node)
            elif node.op_type in _MOVES_ONLY:
                front.append(node.output[0])
                moved.add(node.output[0])
            else:
                return None
    return (casts, moved) if casts else None


def _read_tied_tables_from_blocks(model: onnx.ModelProto, nodes: list[onnx.NodeProto],
                                  rewrite: _Rewrite) -> list[onnx.NodeProto]:
    """An embedding table tied to a q8 head, looked up in the head's MatMulNBits blocks: held once.

    The blocks hold u = q + 128 as uint8 [N, K / g, g], the table's codes in order; the lookup reads
    them reshaped to [N, K] and takes 128 from the rows it gathered, after they are widened to float
    (exact). The int8 table then has no reader left and leaves the graph.
    """
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in nodes:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    retyped: set[str] = set()
    for codes, (blocks, n, k) in rewrite.q8_blocks.items():
        path = _widening_casts(codes, consumers) if codes in consumers else None
        if path is None:
            continue
        casts, moved = path
        retyped |= moved
        rows = f"{codes}.from_blocks"
        shape = rewrite.constant(f"{rows}.shape", np.array([n, k], np.int64))
        offset = rewrite.constant(f"{rows}.offset", np.array(Q8_OFFSET, np.float32))
        for node in consumers[codes]:
            node.input[:] = [rows if name == codes else name for name in node.input]
        for cast in casts:
            widened = cast.output[0]
            cast.output[0] = widened + ".unsigned"
            nodes.insert(nodes.index(cast) + 1, helper.make_node("Sub", [cast.output[0], offset], [widened]))
        nodes.insert(0, helper.make_node("Reshape", [blocks, shape], [rows], name=rows))
    if retyped:  # the exporter's types of the moved rows said int8; they are uint8 now
        kept = [v for v in model.graph.value_info if v.name not in retyped]
        del model.graph.value_info[:]
        model.graph.value_info.extend(kept)
    return nodes


def to_matmul_nbits(model: onnx.ModelProto, accuracy_level: int) -> int:
    """Rewrite every `foldline.QLinear` of `model` (in place) into MatMulNBits; the number rewritten.

    Weights only the placeholders read (the codes in foldline's layout) leave the graph.
    """
    rewrite = _Rewrite(model, accuracy_level)
    nodes: list[onnx.NodeProto] = []
    count = 0
    for node in model.graph.node:
        if node.domain == PLACEHOLDER_DOMAIN and node.op_type == "QLinear":
            nodes += rewrite.nodes_for(node)
            count += 1
        else:
            nodes.append(node)
    lookups = [n for n in nodes if n.domain == PLACEHOLDER_DOMAIN and n.op_type == "QEmbedding"]
    for node in lookups:  # after the products: a table tied to a head reads the head's blocks
        at = nodes.index(node)
        nodes[at:at + 1] = rewrite.gather_nodes_for(node)
    count += len(lookups)
    if not count:
        return 0
    nodes = _read_tied_tables_from_blocks(model, nodes, rewrite)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    seen = {t.name for t in model.graph.initializer}
    model.graph.initializer.extend(t for t in rewrite.new_inits if t.name not in seen and not seen.add(t.name))
    used = {name for node in model.graph.node for name in node.input} | {o.name for o in model.graph.output}
    kept = [t for t in model.graph.initializer if t.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    imports = [o for o in model.opset_import if o.domain not in (PLACEHOLDER_DOMAIN, ORT_DOMAIN)]
    del model.opset_import[:]
    model.opset_import.extend([*imports, helper.make_opsetid(ORT_DOMAIN, 1)])
    return count


@register_graph_rewrite(NBITS_GRAPH_REWRITE, "quantized products as com.microsoft.MatMulNBits over their 4- or 8-bit "
                        "codes (int8 activations per block where asked)")
def matmul_nbits(model: onnx.ModelProto, settings: GraphSettings) -> int:
    """`to_matmul_nbits` as a graph rewrite, at the accuracy level of the settings' activations."""
    return to_matmul_nbits(model, ACCURACY_LEVEL[settings.activations])

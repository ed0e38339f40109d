"""Which nodes of an exported graph an ONNX Runtime execution provider has no kernel for.

ONNX Runtime places each node on the first provider of the session's list that registers a kernel for
its op at the model's opset and for its input types; a node no GPU kernel takes runs on the next provider
(CPU), with a copy across at each boundary. What each provider registers is ONNX Runtime's own table
(docs/OperatorKernels.md in its repository, generated from the registrations), kept here for the default
and com.microsoft domains (provider_kernels.json; scripts/ort_provider_kernels.py rewrites it from that
file). The
compile records each checked provider's gaps in the module's manifest entry; `foldline inspect` prints
them and the onnxruntime device warns when a session names such a provider.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import onnx

TABLE = Path(__file__).with_name("provider_kernels.json")
CHECKED = {"cuda": "CUDAExecutionProvider", "dml": "DmlExecutionProvider", "cpu": "CPUExecutionProvider"}
GPU_PROVIDERS = ("cuda", "dml")  # the providers a compile checks its graphs for
DEFAULT_DOMAIN = "ai.onnx"
# Turned into initializers when ONNX Runtime loads the graph: never placed on a provider.
LOAD_TIME_OPS = frozenset({"Constant"})
# Output element type of an op when it is not its first input's (see _element_types).
BOOL_OPS = frozenset({"And", "Or", "Not", "Xor", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual",
                      "IsNaN", "IsInf"})


@dataclass(frozen=True)
class Kernel:
    """One registration: the schema versions [low, high] (high None: open) and, per type constraint, the
    element types it takes."""

    low: int
    high: int | None
    types: dict[str, frozenset[str]]

    def takes(self, since: int) -> bool:
        """Whether ONNX Runtime gives a node whose schema version is `since` to this kernel: a kernel open to
        later opsets only when it starts at that version, a closed range when it holds it
        (kernel_registry.cc, VerifyKernelDef)."""
        return self.low == since or (self.low < since and self.high is not None and since <= self.high)

    def allows(self, constraint: str, dtype: str) -> bool:
        """Whether an input of this constraint ('T', or a fixed 'tensor(int64)') may have element type dtype;
        a constraint this registration does not name (an older signature) is not held against it."""
        if constraint.startswith("tensor("):
            return constraint == f"tensor({dtype})"
        allowed = self.types.get(constraint)
        return allowed is None or dtype in allowed


@dataclass(frozen=True)
class OpKernels:
    """What a provider registers for one op: each input's constraint, in order, and the kernels."""

    inputs: tuple[str, ...]
    kernels: tuple[Kernel, ...]
    variadic: bool = False  # the last input repeats (Concat, Max, Sum)

    def constraint(self, index: int) -> str | None:
        """Input `index`'s constraint: the last one's for the extra inputs of a variadic op; None (any type)
        for an input the table does not list, which a newer schema of the op added after it."""
        if index < len(self.inputs):
            return self.inputs[index]
        return self.inputs[-1] if self.variadic and self.inputs else None


def parse_versions(text: str) -> tuple[int, int | None]:
    """'13+' -> (13, None); '[6, 12]' -> (6, 12); '13' -> (13, 13)."""
    text = text.strip()
    if text.endswith("+"):
        return int(text[:-1]), None
    if text.startswith("["):
        low, high = (int(v) for v in text.strip("[]").split(","))
        return low, high
    return int(text), int(text)


@cache
def kernel_table() -> dict[str, dict[tuple[str, str], OpKernels]]:
    """provider short name -> (domain, op) -> what it registers, from provider_kernels.json."""
    data = json.loads(TABLE.read_text())
    table: dict[str, dict[tuple[str, str], OpKernels]] = {}
    for short, provider in CHECKED.items():
        ops = {}
        for key, entry in data["providers"][provider].items():
            domain, op = key.split("/", 1)
            kernels = tuple(Kernel(*parse_versions(k["versions"]), {c: frozenset(t) for c, t in k["types"].items()})
                            for k in entry["registrations"])
            ops[(domain, op)] = OpKernels(tuple(entry["inputs"]), kernels, _variadic(op, domain))
        table[short] = ops
    return table


def _variadic(op: str, domain: str) -> bool:
    """Whether the op's last input is variadic in onnx's schema (ONNX Runtime's own ops: taken as not)."""
    schema = _schema(op, domain, onnx.defs.onnx_opset_version())
    return bool(schema is not None and schema.inputs
                and schema.inputs[-1].option == onnx.defs.OpSchema.FormalParameterOption.Variadic)


def _element_types(model: onnx.ModelProto) -> dict[str, str]:
    """Every value's element type ('float', 'int64', ...), followed through the graph in order.

    onnx's shape inference stops at ONNX Runtime's own ops (com.microsoft), which it has no schemas for;
    what the check needs is each node's input types, which this walk gives: a node's outputs take its
    `to` (Cast), its second input's type (CastLike, Where), bool (comparisons), int64 (Shape), its scales'
    (GatherBlockQuantized), else its first input's.
    """
    name = onnx.TensorProto.DataType.Name
    types = {t.name: name(t.data_type).lower() for t in model.graph.initializer}
    for value in list(model.graph.input) + list(model.graph.value_info):
        if value.type.HasField("tensor_type"):
            types[value.name] = name(value.type.tensor_type.elem_type).lower()
    for node in model.graph.node:
        inputs = [types.get(i) for i in node.input]
        attrs = {a.name: a for a in node.attribute}
        if node.op_type == "Cast":
            out = name(attrs["to"].i).lower()
        elif node.op_type == "Constant":
            value = attrs.get("value")
            out = name(value.t.data_type).lower() if value is not None else ("int64" if "value_ints" in attrs
                                                                             else "float")
        elif node.op_type in ("CastLike", "Where"):
            out = inputs[1] if len(inputs) > 1 else None
        elif node.op_type in BOOL_OPS:
            out = "bool"
        elif node.op_type == "Shape":
            out = "int64"
        elif node.op_type == "GatherBlockQuantized":
            out = inputs[2] if len(inputs) > 2 else None
        else:
            out = inputs[0] if inputs else None
        for output in node.output:
            if output and out is not None:
                types.setdefault(output, out)
    return types


@cache
def _schema(op: str, domain: str, opset: int) -> onnx.defs.OpSchema | None:
    """The op's schema a graph importing `opset` of its domain uses: the latest at or below it; None for
    ONNX Runtime's own domain, which onnx has no schemas for."""
    try:
        return onnx.defs.get_schema(op, opset, "" if domain == DEFAULT_DOMAIN else domain)
    except onnx.defs.SchemaError:
        return None


def since_version(op: str, domain: str, opset: int) -> int:
    """The schema version ONNX Runtime matches kernels against (the opset imported where onnx has none)."""
    schema = _schema(op, domain, opset)
    return schema.since_version if schema is not None else opset


def _is_function(op: str, domain: str, opset: int) -> bool:
    """An op ONNX defines by a body of other ops (CastLike, Gelu, RMSNormalization): where a provider has no
    kernel for it, ONNX Runtime replaces the node by that body when it loads the graph."""
    schema = _schema(op, domain, opset)
    return schema is not None and (schema.has_function or schema.has_context_dependent_function)


def provider_gaps(model: onnx.ModelProto, provider: str) -> Counter[str]:
    """'op (type)' -> how many of the graph's nodes `provider` (cuda, dml, cpu) has no kernel for: the op is
    not in its table, or none of its kernels takes both the schema version the graph's opset gives the node
    and the node's input types. Those nodes run on the next provider of the session's list. An ONNX function
    op without a kernel is not counted: ONNX Runtime replaces it by its body (whose ops are not checked)."""
    ops = kernel_table()[provider]
    opsets = {(o.domain or DEFAULT_DOMAIN): o.version for o in model.opset_import}
    types = _element_types(model)
    gaps: Counter[str] = Counter()
    for node in model.graph.node:
        if node.op_type in LOAD_TIME_OPS:
            continue
        domain = node.domain or DEFAULT_DOMAIN
        opset = opsets.get(domain, 1)
        registered = ops.get((domain, node.op_type))
        since = since_version(node.op_type, domain, opset)
        kernels = [k for k in registered.kernels if k.takes(since)] if registered else []
        if not kernels and _is_function(node.op_type, domain, opset):
            continue
        typed = [(registered.constraint(i), types[name]) for i, name in enumerate(node.input)
                 if registered and name and name in types]
        if not any(all(c is None or k.allows(c, t) for c, t in typed) for k in kernels):
            first = types.get(node.input[0]) if node.input and node.input[0] else None
            gaps[f"{node.op_type} ({first})" if first else node.op_type] += 1
    return gaps


def module_gaps(models: list[onnx.ModelProto]) -> dict[str, dict[str, int]]:
    """For each GPU provider checked, 'op (type)' -> nodes of all the module's graphs it leaves to the next
    provider; {} for a provider that takes every node."""
    out = {}
    for provider in GPU_PROVIDERS:
        total: Counter[str] = Counter()
        for model in models:
            total += provider_gaps(model, provider)
        out[provider] = dict(sorted(total.items()))
    return out

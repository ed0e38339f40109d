"""Building hand-written kernels as MLIR ops through IREE's Python bindings, not as text.

A kernel generator (int8_decode.py, int8_gemm.py, the ISA emitters of isa.py)
holds `ir.Value`s and hands them from function to function: no SSA name is
shared between functions or files, each op checks its operands' types when it
is made, and an error names the Python line that made the op. `Builder` makes
ops at its insertion point (arith, math, vector, memref, scf loops, LLVM
intrinsics); `stream_executable` builds the hand-written dispatch around one
function and prints it with MLIR's printer, the text kernels/sites.py adds to
a module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from iree.compiler import ir
from iree.compiler.dialects import arith, builtin, func, llvm, math, memref, scf, stream, vector

Value = ir.Value
ELEMENTS = {"i1": 1, "i8": 8, "i16": 16, "i32": 32}  # integer element types by their spelling


class Builder:
    """Makes ops at the current insertion point, inside one function whose entry block is `entry`.

    `shared(value, type)` is a constant the function makes once (an ISA's zero accumulator,
    a mask): where it is first asked for at the function's top level, or at the top of the
    function when first asked for inside a loop.
    """

    def __init__(self, entry: ir.Block):
        self.entry = entry
        self._shared: dict[tuple[str, str], Value] = {}

    # types
    @staticmethod
    def element(name: str) -> ir.Type:
        """An element type by its spelling: "i8", "i32", "f16", "f32", "index"."""
        if name in ELEMENTS:
            return ir.IntegerType.get_signless(ELEMENTS[name])
        return {"f16": ir.F16Type.get, "f32": ir.F32Type.get, "index": ir.IndexType.get}[name]()

    @classmethod
    def vector(cls, size: int, element: str | ir.Type) -> ir.VectorType:
        """`vector<size x element>`, element a type or its spelling ("i8", "f32")."""
        return ir.VectorType.get([size], cls._type(element))

    @classmethod
    def vector2d(cls, rows: int, columns: int, element: str | ir.Type) -> ir.VectorType:
        """`vector<rows x columns x element>`: a tile to transpose."""
        return ir.VectorType.get([rows, columns], cls._type(element))

    @classmethod
    def memref(cls, shape: Sequence[int], element: str | ir.Type) -> ir.MemRefType:
        return ir.MemRefType.get(list(shape), cls._type(element))

    @classmethod
    def _type(cls, t: str | ir.Type) -> ir.Type:
        return cls.element(t) if isinstance(t, str) else t

    # constants
    def const(self, value: float | int | tuple[int, ...], t: str | ir.Type) -> Value:
        """An `arith.constant` here: a scalar, every lane of a vector type (`dense<value>`), or, given a tuple,
        an integer vector's lanes one by one (`dense<[...]>`)."""
        t = self._type(t).maybe_downcast()
        element = t.element_type if isinstance(t, ir.VectorType) else t
        if isinstance(value, tuple):
            lanes = [ir.IntegerAttr.get(element, int(v)) for v in value]
            return arith.ConstantOp(t, ir.DenseElementsAttr.get(lanes, type=t)).result
        if isinstance(element, ir.FloatType):
            attr = ir.FloatAttr.get(element, float(value))
        else:
            attr = ir.IntegerAttr.get(element, int(value))
        if isinstance(t, ir.VectorType):
            attr = ir.DenseElementsAttr.get_splat(t, attr)
        return arith.ConstantOp(t, attr).result

    def index(self, value: int) -> Value:
        return self.const(value, "index")

    def shared(self, value: float | int | tuple[int, ...], t: str | ir.Type) -> Value:
        """The function's one constant of this value and type (made here, or at its top inside a loop)."""
        t = self._type(t)
        key = (repr(value), str(t))
        if key not in self._shared:
            here = ir.InsertionPoint.current.block == self.entry
            with ir.InsertionPoint.current if here else ir.InsertionPoint.at_block_begin(self.entry):
                self._shared[key] = self.const(value, t)
        return self._shared[key]

    # arith and math
    @staticmethod
    def addi(a: Value, b: Value) -> Value:
        return arith.AddIOp(a, b).result

    @staticmethod
    def subi(a: Value, b: Value) -> Value:
        return arith.SubIOp(a, b).result

    @staticmethod
    def muli(a: Value, b: Value) -> Value:
        return arith.MulIOp(a, b).result

    @staticmethod
    def divui(a: Value, b: Value) -> Value:
        return arith.DivUIOp(a, b).result

    @staticmethod
    def remui(a: Value, b: Value) -> Value:
        return arith.RemUIOp(a, b).result

    @staticmethod
    def minsi(a: Value, b: Value) -> Value:
        return arith.MinSIOp(a, b).result

    @staticmethod
    def andi(a: Value, b: Value) -> Value:
        return arith.AndIOp(a, b).result

    @staticmethod
    def ori(a: Value, b: Value) -> Value:
        return arith.OrIOp(a, b).result

    @staticmethod
    def xori(a: Value, b: Value) -> Value:
        return arith.XOrIOp(a, b).result

    @staticmethod
    def shrui(a: Value, b: Value) -> Value:
        return arith.ShRUIOp(a, b).result

    @staticmethod
    def addf(a: Value, b: Value) -> Value:
        return arith.AddFOp(a, b).result

    @staticmethod
    def subf(a: Value, b: Value) -> Value:
        return arith.SubFOp(a, b).result

    @staticmethod
    def mulf(a: Value, b: Value) -> Value:
        return arith.MulFOp(a, b).result

    @staticmethod
    def divf(a: Value, b: Value) -> Value:
        return arith.DivFOp(a, b).result

    @staticmethod
    def negf(a: Value) -> Value:
        return arith.NegFOp(a).result

    @staticmethod
    def fma(a: Value, b: Value, c: Value) -> Value:
        """a * b + c, fused (`math.fma`)."""
        return math.FmaOp(a, b, c).result

    @staticmethod
    def absf(a: Value) -> Value:
        return math.AbsFOp(a).result

    @staticmethod
    def absi(a: Value) -> Value:
        return math.AbsIOp(a).result

    @staticmethod
    def exp(a: Value) -> Value:
        return math.ExpOp(a).result

    @staticmethod
    def tanh(a: Value) -> Value:
        return math.TanhOp(a).result

    @staticmethod
    def rsqrt(a: Value) -> Value:
        return math.RsqrtOp(a).result

    @staticmethod
    def roundeven(a: Value) -> Value:
        """LLVM's own roundeven (one vrndscaleps on x86); math.roundeven expands to bit operations."""
        return llvm.RoundEvenOp(a).result

    @staticmethod
    def cmpf_ogt(a: Value, b: Value) -> Value:
        return arith.CmpFOp(arith.CmpFPredicate.OGT, a, b).result

    @staticmethod
    def cmpi_ne(a: Value, b: Value) -> Value:
        return arith.CmpIOp(arith.CmpIPredicate.ne, a, b).result

    @staticmethod
    def select(condition: Value, a: Value, b: Value) -> Value:
        return arith.SelectOp(condition, a, b).result

    @staticmethod
    def bitcast(a: Value, t: ir.Type) -> Value:
        """`arith.bitcast`: the same bits as a type of the same width (f32 <-> i32)."""
        return arith.BitcastOp(t, a).result

    @staticmethod
    def extf(a: Value, t: ir.Type) -> Value:
        return arith.ExtFOp(t, a).result

    @staticmethod
    def sitofp(a: Value, t: ir.Type) -> Value:
        return arith.SIToFPOp(t, a).result

    @staticmethod
    def fptosi(a: Value, t: ir.Type) -> Value:
        return arith.FPToSIOp(t, a).result

    @staticmethod
    def trunci(a: Value, t: ir.Type) -> Value:
        return arith.TruncIOp(t, a).result

    # vector
    @staticmethod
    def load(t: ir.Type, base: Value, indices: Sequence[Value]) -> Value:
        """`vector.load` of type t from a memref at indices."""
        return vector.LoadOp(t, base, list(indices)).result

    @staticmethod
    def store(value: Value, base: Value, indices: Sequence[Value]) -> None:
        vector.StoreOp(value, base, list(indices))

    @staticmethod
    def shuffle(a: Value, b: Value, mask: Sequence[int]) -> Value:
        return vector.ShuffleOp(a, b, list(mask)).result

    @staticmethod
    def gather(t: ir.Type, base: Value, indices: Sequence[Value], offsets: Value, mask: Value,
               pass_thru: Value) -> Value:
        """`vector.gather`: lane i reads base[indices + offsets[i]] (the last dimension) where mask[i]."""
        return vector.GatherOp(t, base, list(indices), offsets, mask, pass_thru).result

    @staticmethod
    def broadcast(a: Value, t: ir.Type) -> Value:
        return vector.BroadcastOp(t, a).result

    @staticmethod
    def vbitcast(a: Value, t: ir.Type) -> Value:
        """`vector.bitcast`: the same bytes as a vector of other elements (64 x i8 <-> 16 x i32)."""
        return vector.BitCastOp(t, a).result

    @staticmethod
    def reduce(kind: str, a: Value) -> Value:
        """`vector.reduction <kind>` of a vector to its element type ("add", "maxui")."""
        return vector.ReductionOp(ir.VectorType(a.type).element_type, vector.CombiningKind[kind.upper()], a).result

    @staticmethod
    def insert(value: Value, dest: Value, position: int) -> Value:
        return vector.InsertOp(value, dest, [], [position]).result

    @staticmethod
    def extract(source: Value, position: int) -> Value:
        return vector.ExtractOp(source, [], [position]).result

    @staticmethod
    def transpose(a: Value, permutation: Sequence[int]) -> Value:
        shape = ir.VectorType(a.type).shape
        t = ir.VectorType.get([shape[p] for p in permutation], ir.VectorType(a.type).element_type)
        return vector.TransposeOp(t, a, list(permutation)).result

    @staticmethod
    def from_elements(t: ir.Type, elements: Sequence[Value]) -> Value:
        return vector.FromElementsOp(t, list(elements)).result

    # memref
    @staticmethod
    def alloca(t: ir.MemRefType) -> Value:
        """A stack buffer of the function (`memref.alloca`)."""
        return memref.AllocaOp(t, [], []).result

    @staticmethod
    def prefetch(base: Value, indices: Sequence[Value]) -> None:
        """`memref.prefetch` for reading: asks the memory for the line holding base[indices] into every
        cache level, ahead of its load."""
        memref.PrefetchOp(base, list(indices), False, 3, True)

    @staticmethod
    def load_scalar(base: Value, indices: Sequence[Value]) -> Value:
        return memref.LoadOp(base, list(indices)).result

    @staticmethod
    def store_scalar(value: Value, base: Value, indices: Sequence[Value]) -> None:
        memref.StoreOp(value, base, list(indices))

    # the dispatch
    @staticmethod
    def subspan(binding: Value, offset: Value, t: ir.MemRefType) -> Value:
        """The memref a `!stream.binding` argument holds from `offset` (`stream.binding.subspan`)."""
        return stream.BindingSubspanOp(t, binding, offset, []).result

    @staticmethod
    def workgroup_id() -> Value:
        """This workgroup's index along the dispatch's one dimension."""
        return stream.DispatchWorkgroupIDOp(0, results=[ir.IndexType.get()]).result

    # control flow and intrinsics
    @staticmethod
    def loop(lower: Value, upper: Value, step: Value, body: Callable[..., Sequence[Value] | None],
             carried: Sequence[Value] = ()) -> list[Value]:
        """An `scf.for`: `body(index, *carried)` builds one iteration and returns the values carried to the
        next (as many as `carried`, the first iteration's); returns the last iteration's."""
        op = scf.ForOp(lower, upper, step, list(carried))
        with ir.InsertionPoint(op.body):
            scf.YieldOp(list(body(op.induction_variable, *op.inner_iter_args) or []))
        return list(op.results)

    @staticmethod
    def intrinsic(name: str, result: ir.Type, *args: Value) -> Value:
        """`llvm.call_intrinsic "name"(args)`: one ISA instruction LLVM knows by name."""
        return llvm.CallIntrinsicOp(result, name, list(args), [], []).result


def stream_executable(name: str, workgroups: int, bindings: int,
                      body: Callable[[Builder, list[Value]], None]) -> str:
    """A `stream.executable` @{name}_exe exporting @{name}: a fixed 1-D workgroup count, one func whose
    arguments are `bindings` `!stream.binding`s, built by `body(builder, arguments)`; as printed text.

    A hand-written dispatch: the kernel's `util.func` reaches it with `flow.dispatch`.
    """
    with ir.Context(), ir.Location.unknown():
        index = ir.IndexType.get()
        executable = stream.ExecutableOp(f"{name}_exe", sym_visibility="private")
        with ir.InsertionPoint(executable.body.blocks.append()):
            export = stream.ExecutableExportOp(name, ir.FlatSymbolRefAttr.get(name), sym_visibility="public")
            with ir.InsertionPoint(export.workgroup_count.blocks.append()):
                n, one = arith.ConstantOp(index, workgroups).result, arith.ConstantOp(index, 1).result
                stream.ReturnOp([n, one, one])
            inner = builtin.ModuleOp()
            stream.ExecutableEndOp()
        with ir.InsertionPoint(inner.body):
            binding = ir.Type.parse("!stream.binding")
            function = func.FuncOp(name, ir.FunctionType.get([binding] * bindings, []))
            entry = function.add_entry_block()
            with ir.InsertionPoint(entry):
                body(Builder(entry), list(entry.arguments))
                func.ReturnOp([])
        executable.operation.verify()
        return str(executable)


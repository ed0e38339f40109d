"""The instruction-set forms of the int8 dot product, as emitters, and which kernels a target gets.

The int8-activation kernels (decode: int8_decode.py, prefill: int8_gemm.py) are
one generator each; what differs between CPUs is the instruction that turns
bytes into int32 sums of four products per lane. An `Int8Isa` emits that
product for 64 bytes at a time, bound to its form in the contract
(contract/isa/: its manifest name, what a CPU must have for it, its rank). Each
ISA family's emitters live in a folder of their own (kernels/x86/, kernels/arm/),
and kernels/select.py gives a target, per kernel family, the best registered
form its CPU runs, or the float kernels (kernels/qlinear.py) when it runs none.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..contract.isa import FLOAT, KernelForm
from .builder import Builder, Value

LANES = 16  # the int32 lanes of one product: its 64 byte operands, four bytes per lane


@dataclass(frozen=True)
class Int8Isa(ABC):
    """One form of the int8 dot product: how it is emitted, for its contract form (what it needs of the CPU).

    Both products are exact in int32 for what the kernels feed them: activations
    are int8 in [-127, 127] (max |x| / 127 per group, never -128), codes are q4
    (0..15, unsigned) or q8 (any int8); each form says why.
    """

    form: KernelForm  # its name in the manifest, arch, CPU flags and rank (contract/isa/<family>.py)
    vector_bytes: int  # bytes one dot-product instruction takes (64: zmm, 32: ymm)
    instruction: str  # what the compiled code must hold (the tests look for it)
    zmm: bool  # whether its code uses 512-bit registers

    @property
    def name(self) -> str:
        """Recorded in the manifest's module entry: "int8-avx512vnni", "int8-avx2"."""
        return self.form.name

    @property
    def arch(self) -> str:
        return self.form.arch

    @property
    def cpu_flags(self) -> frozenset[str]:
        """Feature flags the CPU must have (cpuinfo spelling)."""
        return self.form.cpu_flags

    @property
    def bit_vectors(self) -> bool:
        """Whether LLVM lowers a bitcast of bytes to a vector of i1, and a select by it, in a few vector
        instructions for this form: on x86 it does (a mask register and one masked move with AVX-512; a
        broadcast, an and and a compare with AVX2); on AArch64 it expands them lane by lane."""
        return self.arch == "x86_64"

    @property
    def group_sums_first(self) -> bool:
        """Whether the decode kernel adds each group's int32 lanes before converting them (one 4-lane
        register a group, scaled by one broadcast factor) rather than scaling all 16 lanes of a step.
        AArch64: a step's 16 lanes are four NEON registers, so the lane-wise float work (convert, spread
        scales, multiply, FMA) was most of a step's instructions. x86 keeps 16 lanes: one AVX-512
        register, where the float work is a few instructions."""
        return self.arch == "aarch64"

    @property
    def unsigned_bytes_exact(self) -> bool:
        """Whether dot_unsigned is exact for any unsigned byte (0..255) against the activations, not
        only q4 codes: true of VNNI's four products per int32 lane, false where pairs meet in int16."""
        return True

    @property
    def row_pairs(self) -> bool:
        """Whether the prefill GEMM is this form's own (`gemm_executable`), on activations stored in
        row pairs (int8_gemm._xq_memref), rather than the shared one built on `dot_*`."""
        return False

    def gemm_executable(self, shape) -> str:
        """The prefill GEMM's `stream.executable` of a form with `row_pairs`."""
        raise NotImplementedError(f"{self.name} takes the shared int8 GEMM (kernels/int8_gemm.py)")

    def available(self, cpu_flags: Iterable[str], arch: str = "x86_64") -> bool:
        return self.form.runs_on(cpu_flags, arch)

    @abstractmethod
    def constants(self, b: Builder) -> None:
        """Make the constants dot_unsigned / dot_signed share (`b.shared`) here, at the function's top
        level: a kernel calls it before its loops, which place them there anyway on first use."""

    @abstractmethod
    def dot_unsigned(self, b: Builder, acc: Value | None, u: Value, s: Value) -> Value:
        """`acc` (None: zero) + the lane sums of u * s (vector<64xi8> each, u read unsigned): vector<16xi32>.

        Exact while every pair 2 * u * |s| stays below 2^15: q4 codes against activations.
        """

    def unsigned_products_per_sum(self, max_code: int) -> int:
        """How many products `dot_unsigned_sum` may add before widening, for codes up to `max_code`."""
        return 1

    def dot_unsigned_sum(self, b: Builder, acc: Value | None, pairs: list[tuple[Value, Value]]) -> Value:
        """`acc` + the lane sums of every u * s of `pairs` (at most unsigned_products_per_sum).

        By default one dot_unsigned after another; a form whose products meet in a narrow sum
        (AVX2's int16 pairs) adds several there and widens once.
        """
        for u, s in pairs:
            acc = self.dot_unsigned(b, acc, u, s)
        return acc

    @abstractmethod
    def dot_signed(self, b: Builder, acc: Value | None, x: Value, q: Value) -> Value:
        """`acc` + the lane sums of x * q, both signed (x in [-127, 127], q any int8)."""


def zero_lanes(b: Builder, lanes: int = LANES) -> Value:
    """The function's zero accumulator of `lanes` int32 lanes."""
    return b.shared(0, b.vector(lanes, "i32"))


def lane_pieces(b: Builder, acc: Value | None, x: Value, y: Value, pieces: int,
                instruction: Callable[[Value, Value, Value], Value]) -> Value:
    """`acc` + the lane sums of x * y, as `pieces` narrower products on 64 / pieces bytes each.

    Lane i sums bytes 4i..4i+3 in every form, so piece h takes bytes of its own
    and its own slice of the sixteen lanes; no lane moves between pieces.
    `instruction(acc, x, y)` makes one piece's `acc` + product (its accumulator a
    zero of the piece's lanes where `acc` is None); the pieces are joined pairwise.
    """
    return lane_pieces_of_pairs(b, acc, [(x, y)], pieces, lambda c, pairs: instruction(c, *pairs[0]))


def lane_pieces_of_pairs(b: Builder, acc: Value | None, pairs: list[tuple[Value, Value]], pieces: int,
                         instruction: Callable[[Value, list[tuple[Value, Value]]], Value]) -> Value:
    """`lane_pieces` for the sum of several products: `instruction(acc, pairs)` gets each pair's bytes
    of one piece."""
    width, lanes = 64 // pieces, LANES // pieces
    parts = []
    for h in range(pieces):
        piece_pairs = []
        for x, y in pairs:
            span = list(range(h * width, (h + 1) * width))
            piece_pairs.append((b.shuffle(x, x, span), b.shuffle(y, y, span)))
        start = zero_lanes(b, lanes) if acc is None else b.shuffle(acc, acc, list(range(h * lanes, (h + 1) * lanes)))
        parts.append(instruction(start, piece_pairs))
    while len(parts) > 1:
        parts = [b.shuffle(parts[i], parts[i + 1], list(range(2 * lanes))) for i in range(0, len(parts), 2)]
        lanes *= 2
    return parts[0]


@dataclass(frozen=True)
class Int8Kernels:
    """The int8 kernel ISA each family takes on one target; None: that family's float kernels."""

    decode: Int8Isa | None = None
    prefill: Int8Isa | None = None
    # Decode kernels with output channels in the vector lanes (kernels/int8_channels.py): a batched
    # bundle's, whose rows then share each step's unpacking and scale once per group.
    channel_lanes: bool = False

    def record(self) -> dict[str, str]:
        """The manifest's `kernel_isa` of a module: {"decode": "int8-avx2", "prefill": "f32"}, ..."""
        return {family: isa.name if isa else FLOAT for family, isa in (("decode", self.decode),
                                                                      ("prefill", self.prefill))}


FLOAT_KERNELS = Int8Kernels()

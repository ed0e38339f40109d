"""What a compile chooses when the user leaves it open: element types, prefill chunk and kernels per target.

Every default and refusal a build applies before it exports anything lives
here, so `foldline verify` (tools/verify_cmd.py) and the tests reach the same
answers as the compile without running it.
"""

from __future__ import annotations

from dataclasses import replace

from ..dtypes import FLOAT_DTYPES, DTypeError
from ..frontend.types import LoadedModel
from ..kernels.isa import FLOAT_KERNELS, Int8Kernels
from ..kernels.mlir import HARDWARE_FLOAT, FloatIsa
from ..kernels.select import choose_kernels, cpu_has_int8_dot
from .iree.fused_attention import attention_form
from .options import BuildOptions
from .targets import IREE_VERSION, ONNX_DEVICE, Target, TargetError

# Prefill chunk lengths. A quantized linear dequantizes each weight once per prefill call
# (kernels/qlinear.py), so longer chunks amortize it (docs/history.md, "Prefill chunk, and how
# the kernels changed the figures").
FLOAT_CHUNK = 16
QUANTIZED_CHUNK = 64

KV_DTYPES = FLOAT_DTYPES
COMPUTE_DTYPES = FLOAT_DTYPES
ACTIVATIONS = ("auto", "int8", "f32")


# ---- element types and the prefill chunk ------------------------------------------------------------

def holds_quantized_weights(loaded: LoadedModel, weights: str) -> bool:
    return weights in ("int8", "int4") or (weights == "auto" and bool(loaded.source_blocks))


def default_chunk(loaded: LoadedModel, weights: str) -> int:
    """The prefill chunk when none is given: longer when the bundle will hold quantized weights."""
    return QUANTIZED_CHUNK if holds_quantized_weights(loaded, weights) else FLOAT_CHUNK


def default_kv_dtype(loaded: LoadedModel, weights: str, dtype: str | None = None,
                     targets: list[Target] | None = None) -> str:
    """The K/V cache type for --kv-dtype auto: float16 beside quantized weights, else the compute
    dtype (`dtype`; None: the model's).

    Half the cache bytes at no measurable cost in decode speed (docs/models.md, "bf16 and f16
    checkpoints"), as llama.cpp does by default; the rounding (2^-11
    relative) is far below the weights' own. Float bundles keep their dtype, so they stay
    within fp32 tolerance of the eager reference. A bundle for ONNX Runtime alone keeps the
    compute dtype: its CPU GroupQueryAttention computes in float32 and, over float16 caches,
    casts q, k and v every call (docs/onnx.md: decode is faster over float32 caches).
    """
    cfg = loaded.config if dtype is None else loaded.config.replace(dtype=dtype)
    if targets and all(t.device == ONNX_DEVICE for t in targets):
        return cfg.auto_cache_dtype(False)
    return cfg.auto_cache_dtype(holds_quantized_weights(loaded, weights))


def default_compute_dtype(loaded: LoadedModel, targets: list[Target]) -> str:
    """The compute dtype for --dtype auto: float32, whatever the checkpoint stores.

    A bf16 or f16 checkpoint widens to float32 exactly, so the bundle computes what
    the checkpoint's weights say with float32 rounding: the safe choice on every
    target. On llvm-cpu it is also the only one that works for bf16 (the pinned IREE
    fails to compile bf16 arithmetic, see unsupported_compute_dtype); f16 compiles
    there but rounds every activation to 11 bits, so it stays an explicit choice.
    """
    del loaded, targets  # one answer today; the signature is where a per-target choice goes
    return "float32"


def unsupported_compute_dtype(dtype: str, targets: list[Target]) -> str | None:
    """Why `dtype` cannot be the compute dtype for one of `targets`, or None when it can."""
    if dtype == "bfloat16" and any(t.device == ONNX_DEVICE for t in targets):
        return "the ONNX target keeps no bfloat16 state or activations; compute in float32 (--dtype f32 or auto)"
    if dtype == "bfloat16" and any(t.device == "cpu" for t in targets):
        return (f"IREE {IREE_VERSION}'s llvm-cpu backend fails to compile bfloat16 arithmetic "
                "('arith.constant' op failed to verify); compute in float32 (--dtype f32 or auto: "
                "bf16 weights widen to f32 exactly) and keep bf16 caches with --kv-dtype bf16")
    return None


def resolve_dtypes(loaded: LoadedModel, options: BuildOptions) -> tuple[str, str]:
    """(compute dtype, K/V cache dtype) for a build; DTypeError for a choice that cannot work."""
    dtype = default_compute_dtype(loaded, options.targets) if options.dtype == "auto" else options.dtype
    if dtype not in COMPUTE_DTYPES:
        raise DTypeError(f"compute dtype {dtype!r} is not supported; choose one of {', '.join(COMPUTE_DTYPES)}")
    why = unsupported_compute_dtype(dtype, options.targets)
    if why is not None:
        raise DTypeError(f"compute dtype {dtype} is not available for this target: {why}")
    kv_dtype = (default_kv_dtype(loaded, options.weights, dtype, options.targets) if options.kv_dtype == "auto"
                else options.kv_dtype)
    if kv_dtype not in KV_DTYPES:
        raise DTypeError(f"K/V cache dtype {kv_dtype!r} is not supported; choose one of {', '.join(KV_DTYPES)}")
    if kv_dtype == "bfloat16" and any(t.device == ONNX_DEVICE for t in options.targets):
        raise DTypeError("the ONNX target keeps no bfloat16 caches (ONNX Runtime's Python API takes no bfloat16 "
                         "arrays): choose --kv-dtype f16 or f32")
    return dtype, kv_dtype


# ---- kernels ------------------------------------------------------------------------------------------

def keeps_five_bit_codes(targets: list[Target], activations: list[str]) -> bool:
    """Whether 5-bit checkpoint blocks stay 5-bit (q5) or are widened to bytes (q8) at compile time.

    The int8 kernels of an IREE CPU module read q5's planes as they lie; the float kernels
    (GPU targets, --activations f32) read them through a widening copy each
    call (kernels/templates/qlinear_widen_q5.mlir), slower than reading bytes. The codes stay 5-bit where
    some IREE CPU module decodes with int8 activations: a multi-ISA bundle's baseline module
    then takes the slower read, as its fallback. The ONNX export widens its own copy.
    """
    return any(t.device == "cpu" and a == "int8" for t, a in zip(targets, activations))


def target_activations(target: Target, activations: str, batch: int = 1) -> str:
    """What a quantized decode product multiplies its codes by on this target: "int8" or "f32".

    int8 (kernels/int8_decode.py) needs a CPU one of the int8 dot-product forms runs
    on (kernels/select.py: x86 AVX2 or VNNI, aarch64 dotprod); auto takes it there
    and on the ONNX target (MatMulNBits' int8 kernels), f32 everywhere else (GPU
    targets, other CPUs, `--cpu generic`). A batched IREE bundle takes it too: its
    few-row kernels (kernels/int8_decode.py) and every other op compute each row
    to the bit as the 1-row entry points do, so a stream's tokens do not depend on
    how many others run (docs/serving.md). The ONNX target's batched rows stay f32:
    ONNX Runtime's MatMulNBits takes another kernel over several rows.
    """
    if activations not in ACTIVATIONS:
        raise TargetError(f"unknown activations {activations!r}; expected one of {', '.join(ACTIVATIONS)}")
    if batch > 1 and target.device == ONNX_DEVICE:
        if activations == "int8":
            raise TargetError(f"--activations int8 on the ONNX target is for --batch 1 (--batch {batch} asked for): "
                              "its batched rows decode with float activations")
        return "f32"
    # ONNX Runtime picks MatMulNBits' int8 kernel by the CPU it runs on, and multiplies in float where it has none
    capable = target.device == ONNX_DEVICE or (target.device == "cpu" and cpu_has_int8_dot(target.cpu_flags, target.arch))
    if activations == "int8" and not capable:
        raise TargetError(f"--activations int8 needs a CPU target with an int8 dot product: x86 AVX2 (avx2, fma, "
                          f"f16c) or AVX-512 VNNI (avx512f, avx512bw, avx512_vnni), or aarch64 dotprod (asimddp); "
                          f"{target.description} has none: use --activations f32 or name such a CPU with --cpu "
                          "(e.g. x86-64-v3, znver4, cortex-a76)")
    return "int8" if activations != "f32" and capable else "f32"


def import_kind(target: Target, attention: str) -> tuple[bool, bool]:
    """(CPU, fused prefill attention): the import a target's module is compiled from.

    CPU targets keep the decode attention ops for their hand-written kernel (kernels/attention.py);
    GPU targets import the decomposed form; targets whose prefill attention is fused import it so.
    """
    return target.device == "cpu", attention_form(target.device, attention) == "fused"


def target_kernels(target: Target, activations: str, batched: bool = False) -> tuple[Int8Kernels, FloatIsa]:
    """The int8 kernels (none: float) and the float instruction set a target's quantized products are
    expanded with, for its `activations` (target_activations).

    A batched bundle's decode takes the channel-lane kernels where its form has them
    (kernels/int8_channels.py): several rows cost little more than one, and every row count of the
    bundle computes a row alike, so a row's result does not depend on the others.
    """
    int8 = choose_kernels(target.cpu_flags, target.arch) if activations == "int8" else FLOAT_KERNELS
    if batched and int8.decode is not None and not int8.decode.group_sums_first:
        int8 = replace(int8, channel_lanes=True)
    float_isa = FloatIsa.of(target.cpu_flags, target.arch) if target.device == "cpu" else HARDWARE_FLOAT
    return int8, float_isa

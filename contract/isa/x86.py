"""x86-64: its CPU features and its int8 kernel forms (emitters: kernels/x86/).

- AVX-512 VNNI: `vpdpbusd` on 64 bytes (Cascade Lake and later Xeons, Zen 4).
- AVX-VNNI: `vpdpbusd` on 32 bytes, for CPUs with VNNI and no AVX-512 (Alder Lake).
- AVX2: `vpmaddubsw` + `vpmaddwd` on 32 bytes (Haswell, Zen 1-3).
"""

from __future__ import annotations

from .registry import IsaFamily, KernelForm

AVX512_VNNI = KernelForm("int8-avx512vnni", "x86_64", frozenset({"avx512f", "avx512bw", "avx512_vnni"}), rank=3)
AVX_VNNI = KernelForm("int8-avxvnni", "x86_64", frozenset({"avx_vnni", "avx2", "fma", "f16c"}), rank=2)
AVX2 = KernelForm("int8-avx2", "x86_64", frozenset({"avx2", "fma", "f16c"}), rank=1)

FAMILY = IsaFamily(
    arch="x86_64",
    arch_aliases=("amd64", "x64"),
    cpuinfo_line="flags",
    llvm_features={
        "sse4.1": "sse4_1", "sse4.2": "sse4_2", "avx": "avx", "avx2": "avx2", "fma": "fma", "f16c": "f16c",
        "bmi2": "bmi2", "avx512f": "avx512f", "avx512dq": "avx512dq", "avx512cd": "avx512cd",
        "avx512bw": "avx512bw", "avx512vl": "avx512vl", "avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16",
        "avx512fp16": "avx512_fp16", "amx-tile": "amx_tile", "amx-int8": "amx_int8", "amx-bf16": "amx_bf16",
        "avx512vbmi": "avx512vbmi", "avx512vbmi2": "avx512_vbmi2", "avx512ifma": "avx512ifma",
        "avx512vpopcntdq": "avx512_vpopcntdq", "avx512bitalg": "avx512_bitalg", "avxvnni": "avx_vnni",
        "gfni": "gfni", "vaes": "vaes", "vpclmulqdq": "vpclmulqdq",
    },
    isa_levels=("avx512_vnni", "avx512f", "avx_vnni", "avx2", "avx", "sse4_2"),
    forms=(AVX512_VNNI, AVX_VNNI, AVX2),
)

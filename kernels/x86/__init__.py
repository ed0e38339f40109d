"""x86 emitters of the int8 dot product (kernels/isa.py), one per form of contract/isa/x86.py.

- AVX-512 VNNI (avx512_vnni.py): `vpdpbusd` on 64 bytes.
- AVX-VNNI (avx_vnni.py): `vpdpbusd` on 32 bytes, for CPUs with VNNI and no AVX-512.
- AVX2 (avx2.py): `vpmaddubsw` + `vpmaddwd` on 32 bytes, exact by moving q8 signs onto the activations.

Which of them a target takes, and in what order, is the forms' rank (kernels/select.py).
"""

from .avx2 import AVX2
from .avx512_vnni import AVX512_VNNI
from .avx_vnni import AVX_VNNI

EMITTERS = (AVX512_VNNI, AVX_VNNI, AVX2)

__all__ = ["AVX2", "AVX512_VNNI", "AVX_VNNI", "EMITTERS"]

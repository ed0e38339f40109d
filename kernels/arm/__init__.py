"""aarch64 emitters of the int8 dot product (kernels/isa.py), one per form of contract/isa/arm.py.

- NEON dotprod (neon_dotprod.py): `sdot` on 16 bytes, signed by signed.
- NEON i8mm (neon_i8mm.py): `smmla` on two rows by two channels, for the prefill GEMM.

Which of them a target takes, and in what order, is the forms' rank (kernels/select.py).
"""

from .neon_dotprod import NEON_DOTPROD
from .neon_i8mm import NEON_I8MM

EMITTERS = (NEON_I8MM, NEON_DOTPROD)

__all__ = ["EMITTERS", "NEON_DOTPROD", "NEON_I8MM"]

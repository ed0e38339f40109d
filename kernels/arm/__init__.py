"""aarch64 forms of the int8 dot product (kernels/isa.py), best first per kernel family.

- NEON dotprod (neon_dotprod.py): `sdot` on 16 bytes, signed by signed.
- NEON i8mm (neon_i8mm.py): `smmla` on two rows by two channels, for the prefill GEMM.
"""

from .neon_dotprod import NEON_DOTPROD
from .neon_i8mm import NEON_I8MM

DECODE_FORMS = (NEON_DOTPROD,)
PREFILL_FORMS = (NEON_I8MM, NEON_DOTPROD)

__all__ = ["DECODE_FORMS", "NEON_DOTPROD", "NEON_I8MM", "PREFILL_FORMS"]

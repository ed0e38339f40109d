"""aarch64 forms of the int8 dot product (kernels/isa.py), best first per kernel family.

- NEON dotprod (neon_dotprod.py): `sdot` on 16 bytes, signed by signed.
"""

from .neon_dotprod import NEON_DOTPROD

DECODE_FORMS = (NEON_DOTPROD,)
PREFILL_FORMS = (NEON_DOTPROD,)

__all__ = ["DECODE_FORMS", "NEON_DOTPROD", "PREFILL_FORMS"]

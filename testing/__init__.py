"""Test support that tests and users import: golden pass checks, eager parity, fixture generators.

- `golden`: run a CompileUnit before and after a pass in torch eager and compare;
- `parity`: a compiled bundle vs the torch eager reference, step by step;
- `rotated_gguf`: write Hadamard-folded GGUF fixtures from unrotated models.
"""

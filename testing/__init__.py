"""What an engineer imports to test their own passes and bundles against torch eager.

- `golden`: run a CompileUnit before and after a pass in torch eager and compare;
- `parity`: a compiled bundle vs the torch eager reference, step by step.

Helpers only foldline's own tests use (qemu runner, fixture generators, int8
emulations, dispatch readers) live beside the tests, in tests/.
"""

"""The bundle contract: what the compiler writes and the runtime reads.

numpy only (no torch, no IREE compiler), so the compiler stages and the
embedded runtime import the same definitions:

- `state`: the one state-buffer type and the layout rule of each state kind;
- `entry_points`: the module's entry points and the inputs each takes;
- `manifest`: the typed manifest, its seal and its loading;
- `schema`: the checks of every field the runtime reads;
- `isa`: per ISA family, the CPU feature names a module may rely on and the
  int8 kernel forms with their ranks (the compiler's and the runtime's one order);
- `vmfb`: what a compiled module says about where it runs.

Only this package names the manifest's fields (tests/test_layering.py checks it).
"""

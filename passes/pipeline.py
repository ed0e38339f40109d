"""The default pass pipeline, by name: a leaf module (no torch), so a compile answered from the
cache never imports the passes.

fuse-hadamard first: folding restores the plain embedding lookups fold-embedding-scale anchors on.
quantize-weights after them: it reads the float weights the other passes leave.
fuse-sibling-qlinears right after it: it concatenates the blocks quantize-weights lifted.
"""

DEFAULT_PIPELINE: tuple[str, ...] = ("fuse-hadamard", "fold-embedding-scale", "ring-buffer-swa", "quantize-weights",
                                     "fuse-sibling-qlinears")

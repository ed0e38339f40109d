"""Hand-written kernels and the rewrites that put them into the imported MLIR.

Each kernel family declares the shapes it takes (`supports`) and, for the
int8-activation kernels, the instruction-set forms it is written for (isa.py,
one folder per ISA family). Every site gets the best kernel its target allows
and otherwise the portable float form; `sites.rewrite_sites` is the one loop
that makes the calls and counts which kernel each site took.
"""

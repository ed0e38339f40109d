"""Tests of kernels/: each hand-written kernel against numpy or eager, in every ISA form the host runs."""

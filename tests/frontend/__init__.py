"""Tests of frontend/: configs, loaders (GGUF, HF), the reference modules, Hadamard and block formats."""

"""Whole models against HF transformers and llama.cpp, and the command line end to end."""

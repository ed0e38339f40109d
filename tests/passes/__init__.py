"""Tests of passes/: each FX pass golden against eager, the pass manager, state and shard plans."""

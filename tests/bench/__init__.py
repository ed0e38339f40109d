"""Tests of bench/: `foldline bench` and its peers."""

"""Tests of server/: `foldline serve` against real clients, hostile clients, fuzzed bodies and its schema."""

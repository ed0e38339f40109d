"""Property tests, fuzzed inputs and soaks (docs/reliability.md)."""

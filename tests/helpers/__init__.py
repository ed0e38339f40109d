"""Helpers the test groups share (imported as `helpers.<module>`; tests/ is on sys.path)."""

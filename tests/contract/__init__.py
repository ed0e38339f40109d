"""Tests of contract/: the manifest, its schema and seal, the ISA registry."""

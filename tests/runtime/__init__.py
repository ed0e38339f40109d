"""Tests of runtime/: sessions, batches, the prompt cache, saved sessions, CPU module choice, threads."""

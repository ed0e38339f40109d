"""Fixtures only the end-to-end tests use: HF transformers' tokenizers and eager outputs of the real GGUF models."""

from __future__ import annotations

from collections.abc import Callable

import pytest


@pytest.fixture(scope="session")
def hf_tokenizers() -> Callable[[str], object]:
    """name -> HF transformers tokenizer built from the same GGUF, once per session."""
    from helpers.gguf_reference import hf_tokenizer

    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = hf_tokenizer(name)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def hf_references(hf_tokenizers) -> Callable[[str], dict]:
    """name -> HF transformers eager ids and logits on the fixed prompts (disk cache)."""
    from helpers.gguf_reference import hf_reference

    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            cache[name] = hf_reference(name, hf_tokenizers)
        return cache[name]

    return get

"""Fuzzed runtime inputs: a bundle's manifest.json and the prompt ids a Session is given.

manifest.json: random edits of fields and types (removed, retyped, set to
absurd values, nested, the whole text damaged); Manifest.load must load or
raise BundleError. Where the bundle format seals its manifest (a
`manifest_sha256` over the rest), each edit is tried twice: as edited (the
seal refuses it) and sealed again, so the edit reaches the checks behind the
seal.

Prompt ids: negative, past the vocabulary, floats, bools, strings, nested
and ragged lists, numpy arrays of every dtype, empty, too many for the
context. Each must raise a FoldlineError and leave the session usable and
unchanged (position, tokens, and the next logits equal a fresh session's).
"""

from __future__ import annotations

import copy
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from foldline.contract import manifest as manifest_module
from foldline.runtime import BundleError, ContextFullError, Manifest, Model, TokenIdError

from reliability.fuzz_common import FuzzLog
from reliability.reliability_common import record, scaled

pytestmark = pytest.mark.slow  # compiles a tiny preset with IREE (shared with the pipeline tests)

PRESET = "ripple-tiny"  # sliding-window layers (W = 16) and max_context 128: rings wrap 7 times


@pytest.fixture(scope="module")
def bundle(bundle_factory) -> Path:
    return bundle_factory(PRESET)


# ---- manifest.json -----------------------------------------------------------------------------

ODD_VALUES = [None, True, 0, -1, 2**63, 1e308, float("nan"), "", "x", [], {}, [1, "a"], {"file": 3}]


def _paths(node, prefix=()):
    """Every (path, value) in a JSON document, containers included."""
    yield prefix, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


def _edit(data, path, value, delete=False):
    out = copy.deepcopy(data)
    node = out
    for key in path[:-1]:
        node = node[key]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


def manifest_edits(data: dict, rng: random.Random, n_random: int):
    """(description, manifest object or raw bytes): every top-level field removed and retyped, then random edits."""
    text = json.dumps(data).encode()
    yield "empty", b""
    yield "not JSON", text[: len(text) // 2]
    yield "not text", b"\xff\xfe" + text
    yield "a list", b"[]"
    for key in sorted(data):
        yield f"without {key}", _edit(data, (key,), None, delete=True)
        for value in ODD_VALUES:
            yield f"{key} = {value!r}", _edit(data, (key,), value)
    paths = [p for p, _ in _paths(data) if p]
    for i in range(n_random):
        out = data
        for _ in range(rng.randint(1, 3)):
            path = rng.choice([p for p, _ in _paths(out) if p] or paths)
            if rng.random() < 0.25:
                out = _edit(out, path, None, delete=True)
            else:
                old = _node(out, path)
                choices = [*ODD_VALUES, rng.randint(-10, 10**6)]
                if isinstance(old, (int, float)) and not isinstance(old, bool):
                    choices += [old + 1, old - 1, old * 1000, -old]
                if isinstance(old, list) and old:
                    choices += [old[:-1], old + old[-1:], old[::-1]]
                out = _edit(out, path, rng.choice(choices))
        yield f"random edit #{i}", out


def _node(data, path):
    for key in path:
        data = data[key]
    return data


def _load_manifest(root: Path) -> None:
    m = Manifest.load(root)
    assert isinstance(m.model, dict) and m.state


def test_fuzzed_manifests_raise_bundle_errors(tmp_path, bundle):
    """Manifest.load on an edited manifest.json: loads or raises BundleError, nothing else."""
    root = tmp_path / "bundle"
    shutil.copytree(bundle, root)
    original = json.loads((root / "manifest.json").read_text())
    Manifest.load(root)  # the undamaged bundle loads
    seal = getattr(manifest_module, "seal_manifest", None)
    sealed = seal is not None and "manifest_sha256" in original
    log = FuzzLog("manifest", expected=BundleError)
    for what, edited in manifest_edits(original, random.Random(3), scaled(150, 10000)):
        variants = [(what, edited)]
        if sealed and isinstance(edited, dict):
            variants.append((f"{what} (sealed again)", seal(copy.deepcopy(edited))))
        for name, content in variants:
            raw = content if isinstance(content, bytes) else json.dumps(content).encode()
            (root / "manifest.json").write_bytes(raw)
            try:
                log.run(name, lambda: _load_manifest(root))
            finally:
                (root / "manifest.json").write_text(json.dumps(original))
    log.finish()
    assert log.clear_errors > log.cases // 2


# ---- prompt ids --------------------------------------------------------------------------------


def bad_prompts(vocab: int, context: int, rng: random.Random, n_random: int):
    """Prompts a Session must refuse, each with why."""
    yield "empty list", []
    yield "empty array", np.array([], np.int64)
    yield "negative", [1, -1, 2]
    yield "vocab size", [vocab]
    yield "past vocab", [1, 2, vocab + 10**6]
    yield "int64 max", [2**63 - 1]
    yield "beyond int64", [2**64 + 3]
    yield "float", [1.0, 2.0]
    yield "float nan", [float("nan")]
    yield "float inf", [float("inf")]
    yield "bool", [True, False]
    yield "string ids", ["1", "2"]
    yield "a string", "hello"
    yield "bytes", b"\x01\x02"
    yield "None", [None]
    yield "dict", {1: 2}
    yield "complex", [1 + 2j]
    yield "object array", np.array([1, "a"], dtype=object)
    yield "too many", list(range(1, 2)) * (context + 1)
    for dtype in ("float16", "float32", "float64", "bool", "complex64", "U3", "datetime64[s]"):
        yield f"{dtype} array", np.ones(3).astype(dtype)
    for dtype in ("uint64", "int8", "uint8", "int16", "uint16", "int32", "uint32"):
        values = np.array([1, 2, np.iinfo(dtype).max], dtype=dtype)
        if int(values.max()) >= vocab:
            yield f"{dtype} array past vocab", values
    for i in range(n_random):
        n = rng.choice((1, 3, context, context + 1, context + rng.randint(2, 500)))
        ids = [rng.randrange(vocab) for _ in range(n)]
        if n <= context:
            k = rng.randrange(n)
            ids[k] = rng.choice([-rng.randint(1, 10**9), vocab + rng.randint(0, 10**9), 0.5, None, "7"])
        yield f"random #{i} ({n} ids)", ids


def test_fuzzed_prompt_ids_are_refused_cleanly(bundle):
    """Every bad prompt raises a FoldlineError and leaves the session as it was, still usable."""
    with Model.load(bundle, threads=1) as model:
        fresh = model.session()
        fresh.prefill([5, 6])
        expected = fresh.prefill([7])  # the same two calls as below: bit-identical logits
        session = model.session()
        session.prefill([5, 6])
        held = (session.position, list(session.tokens))
        snap = session.snapshot()
        log = FuzzLog("prompt ids")
        cases = list(bad_prompts(model.vocab_size, model.max_context, random.Random(5), scaled(60, 5000)))
        for what, ids in cases:
            one = isinstance(ids, (list, np.ndarray)) and len(ids) == 1
            for call in ("prefill", "decode", "generate_ids") if one else ("prefill", "generate_ids"):
                args = ids[0] if call == "decode" else ids  # decode takes the id itself

                def step(call=call, args=args, what=what):
                    if call == "generate_ids":
                        list(session.generate_ids(args, max_new_tokens=2))
                    else:
                        getattr(session, call)(args)
                    raise AssertionError(f"{call} accepted {what}")  # a bad prompt must not be taken

                log.run(f"{call}({what})", step)
                if (session.position, session.tokens) != held:
                    log.failures.append(f"{call}({what}) changed the session to position {session.position}")
                    session.restore(snap)
        log.finish()
        assert log.clear_errors == log.cases
        # Still usable, and its state is the one it had: the next token's logits equal a fresh session's.
        assert np.array_equal(session.prefill([7]), expected)
        record("fuzz prompt ids: sessions left usable", 1)


def test_context_full_refused_without_change(bundle):
    """A prompt one token longer than the room left is refused whole, at the start and near the end."""
    with Model.load(bundle, threads=1) as model:
        session = model.session()
        with pytest.raises(ContextFullError):
            session.prefill([1] * (model.max_context + 1))
        assert session.position == 0
        session.prefill([1] * (model.max_context - 2))
        with pytest.raises(ContextFullError):
            session.prefill([1, 2, 3])
        assert session.position == model.max_context - 2
        session.prefill([1, 2])
        with pytest.raises(ContextFullError):
            session.decode(1)


# ---- found by the fuzz and fixed: kept as regression tests (docs/reliability.md) ---------------------

RUNTIME_FINDINGS = {
    "nested equal lists are flattened": ("prefill", [[1, 2], [3, 4]]),
    "ragged lists raise numpy's ValueError": ("prefill", [[1, 2], [3]]),
    "a list element raises numpy's ValueError": ("prefill", [1, [2], 3]),
    "decode of a list takes its first id": ("decode", [1, 2, 3]),
    "decode of an empty list raises IndexError": ("decode", []),
}


@pytest.mark.parametrize("finding", sorted(RUNTIME_FINDINGS))
def test_runtime_findings(bundle, finding):
    """Prompts the fuzz found taken or crashing: each is a TokenIdError and changes nothing."""
    call, ids = RUNTIME_FINDINGS[finding]
    with Model.load(bundle, threads=1) as model:
        session = model.session()
        with pytest.raises(TokenIdError):
            getattr(session, call)(ids)
        assert session.position == 0


def test_manifest_nested_too_deep(tmp_path, bundle):
    """A manifest of 100000 nested arrays must be a BundleError, not a RecursionError."""
    root = tmp_path / "bundle"
    shutil.copytree(bundle, root)
    (root / "manifest.json").write_bytes(b"[" * 100000 + b"]" * 100000)
    with pytest.raises(BundleError):
        Manifest.load(root)

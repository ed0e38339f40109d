"""The compile cache: keys that change with every input, atomic stores, the bound, and the CLI."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from foldline.backends.compile_cache import CompileCache
from foldline.backends.options import BuildOptions, build_cache_key
from foldline.backends.targets import make_target
from foldline.frontend.fingerprint import FULL_HASH_LIMIT, checkpoint_fingerprint, file_fingerprint


def _bundle(root: Path, text: str) -> Path:
    root.mkdir(parents=True)
    (root / "manifest.json").write_text(text)
    (root / "params.irpa").write_bytes(text.encode() * 100)
    return root


BUNDLE_FILES = ("manifest.json", "params.irpa")  # what _bundle writes


def _digest(folder: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())}


def test_store_then_fetch_copies_the_bundle(tmp_path):
    cache = CompileCache(tmp_path / "cache")
    src = _bundle(tmp_path / "b", "one")
    assert not cache.fetch("k1", tmp_path / "out0")
    cache.store("k1", src, {"name": "m"}, files=BUNDLE_FILES)
    assert cache.fetch("k1", tmp_path / "out")
    assert _digest(tmp_path / "out") == _digest(src)
    (tmp_path / "out" / "params.irpa").write_bytes(b"damaged")  # a copy: the entry stays intact
    assert cache.fetch("k1", tmp_path / "out2") and _digest(tmp_path / "out2") == _digest(src)
    assert [e.key for e in cache.entries()] == ["k1"]


def test_concurrent_writers_leave_one_whole_entry(tmp_path):
    cache = CompileCache(tmp_path / "cache")
    sources = [_bundle(tmp_path / f"b{i}", "same") for i in range(6)]
    threads = [threading.Thread(target=cache.store, args=("k", s, {}, BUNDLE_FILES)) for s in sources]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [e.key for e in cache.entries()] == ["k"]
    assert sorted(p.name for p in cache.root.iterdir()) == ["k"]  # no temporaries left
    assert cache.fetch("k", tmp_path / "out") and _digest(tmp_path / "out") == _digest(sources[0])


def test_a_second_compile_of_the_same_inputs_waits_and_reuses_the_first(tmp_path, monkeypatch):
    """Two compiles of one key at once: one compiles, the other waits on the cache's lock and copies the
    bundle (the test workers asking for the same bundle compiled it twice before)."""
    from types import SimpleNamespace

    from foldline.backends import build

    cache = CompileCache(tmp_path / "cache")
    compiled, started = [], threading.Event()

    def fake_compile(loaded, out_dir, options, progress, cache_, key):
        compiled.append(out_dir)
        started.set()
        threading.Event().wait(0.5)  # the other compile arrives meanwhile
        _bundle(Path(out_dir), "built once")
        cache_.store(key, Path(out_dir), {}, files=BUNDLE_FILES)
        return Path(out_dir)

    monkeypatch.setattr(build, "_compile_and_store", fake_compile)
    loaded = SimpleNamespace(fingerprint={"preset": "llama-tiny", "seed": 0})
    options = BuildOptions(targets=[make_target("cpu")])
    said: list[str] = []
    first = threading.Thread(target=build.compile_model, args=(loaded, tmp_path / "a", options, lambda _m: None, cache))
    first.start()
    started.wait(10)
    build.compile_model(loaded, tmp_path / "b", options, said.append, cache)
    first.join()
    assert compiled == [tmp_path / "a"], "one compile"
    assert _digest(tmp_path / "b") == _digest(tmp_path / "a")
    assert any("another compile of the same inputs is running" in m for m in said), said
    assert any("reused from the compile cache" in m for m in said), said


def test_the_bound_drops_least_recently_used_entries(tmp_path):
    cache = CompileCache(tmp_path / "cache", max_bytes=10**9)
    for i in range(3):
        cache.store(f"k{i}", _bundle(tmp_path / f"b{i}", "x" * 1000), {}, files=BUNDLE_FILES)
        os.utime(cache.root / f"k{i}" / "entry.json", (1000 + i, 1000 + i))
    assert cache.fetch("k0", tmp_path / "out")  # k0 is now the most recently used
    sizes = {e.key: e.size for e in cache.entries()}  # entries differ by a byte or two (their timestamps)
    cache.max_bytes = sizes["k0"] + sizes["k2"]
    assert cache.evict() == ["k1"]
    assert {e.key for e in cache.entries()} == {"k0", "k2"}
    assert cache.clear() > 0 and cache.entries() == []


def test_the_cache_leaves_the_disk_its_free_space_floor(tmp_path, monkeypatch):
    """On a nearly full disk older entries make room for a new one, and a bundle that would cut into the
    floor even with every entry gone is not stored, the entries kept: the cache never fills the disk."""
    from foldline.backends import compile_cache

    cache = CompileCache(tmp_path / "cache", max_bytes=10**9, min_free_bytes=1000)
    disk = 1000 + 2 * 5300 + 500  # the floor, two entries (each ~5.3 KB) and a little more
    monkeypatch.setattr(cache, "free_bytes", lambda: disk - compile_cache._tree_size(cache.root))
    for i in range(2):
        assert cache.store(f"k{i}", _bundle(tmp_path / f"b{i}", "x" * 52), {}, files=BUNDLE_FILES)
        os.utime(cache.root / f"k{i}" / "entry.json", (1000 + i, 1000 + i))
    assert {e.key for e in cache.entries()} == {"k0", "k1"}
    assert cache.store("k2", _bundle(tmp_path / "b2", "y" * 52), {}, files=BUNDLE_FILES)
    assert {e.key for e in cache.entries()} == {"k1", "k2"}  # k0, the least recently used, made room
    assert cache.free_bytes() >= cache.min_free_bytes
    huge = _bundle(tmp_path / "b3", "z" * 200)  # ~20 KB: more than the disk has above the floor
    assert not cache.store("k3", huge, {}, files=BUNDLE_FILES)
    assert {e.key for e in cache.entries()} == {"k1", "k2"}  # kept: dropping them would not have made room


def test_an_entry_holds_only_the_files_named(tmp_path):
    cache = CompileCache(tmp_path / "cache")
    src = _bundle(tmp_path / "b", "one")
    (src / "notes.txt").write_text("the user's, not the bundle's")
    cache.store("k", src, {}, files=BUNDLE_FILES)
    assert sorted(p.name for p in (cache.root / "k" / "bundle").iterdir()) == sorted(BUNDLE_FILES)
    assert cache.fetch("k", tmp_path / "out") and sorted(_digest(tmp_path / "out")) == sorted(BUNDLE_FILES)


@pytest.mark.slow
def test_a_compile_caches_its_bundle_files_only(tmp_path, monkeypatch, bundle_factory):
    """A compile into a directory that holds other files stores the bundle's files alone (its manifest and what
    the manifest lists). The IREE stages are replaced by copying an already compiled bundle in."""
    import shutil

    from foldline.backends import build

    compiled = bundle_factory("llama-tiny")

    def copy_compiled(loaded, out_dir, options, progress):
        shutil.copytree(compiled, out_dir, dirs_exist_ok=True)
        return Path(out_dir)

    monkeypatch.setattr(build, "_compile", copy_compiled)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("not part of the bundle")
    cache = CompileCache(tmp_path / "cache")
    build.compile_spec("llama-tiny", out, BuildOptions(), progress=lambda _m: None, cache=cache)
    [entry] = cache.entries()
    assert _digest(entry.path / "bundle") == _digest(compiled)
    assert "notes.txt" not in _digest(entry.path / "bundle")


def test_file_fingerprint_full_and_sampled(tmp_path):
    small = tmp_path / "small.gguf"
    small.write_bytes(b"a" * 1000)
    before = file_fingerprint(small)
    small.write_bytes(b"a" * 999 + b"b")
    assert file_fingerprint(small) != before and "sha256" in before

    big = tmp_path / "big.gguf"
    with big.open("wb") as f:
        f.truncate(FULL_HASH_LIMIT + (8 << 20))
    first = file_fingerprint(big)
    assert "sampled_sha256" in first and file_fingerprint(big) == first
    with big.open("r+b") as f:  # the first sample starts at offset 0
        f.write(b"\x01")
    os.utime(big, ns=(first["mtime_ns"], first["mtime_ns"]))
    assert file_fingerprint(big)["sampled_sha256"] != first["sampled_sha256"]
    os.utime(big, ns=(first["mtime_ns"] + 10**9, first["mtime_ns"] + 10**9))
    assert file_fingerprint(big)["mtime_ns"] != first["mtime_ns"]


def test_keys_follow_every_input():
    fp = checkpoint_fingerprint("llama-tiny")
    base = build_cache_key(fp, BuildOptions())
    assert base == build_cache_key(checkpoint_fingerprint("llama-tiny"), BuildOptions())
    assert base != build_cache_key(checkpoint_fingerprint("llama-tiny", seed=1), BuildOptions())
    assert base != build_cache_key(checkpoint_fingerprint("gemma3-tiny"), BuildOptions())
    assert base != build_cache_key(fp, BuildOptions(kv_dtype="float32"))
    assert base != build_cache_key(fp, BuildOptions(targets=[make_target("cpu", cpu="x86-64-v3")]))
    assert base != build_cache_key(fp, BuildOptions(targets=[make_target("cpu"), make_target("cuda")]))
    assert build_cache_key(None, BuildOptions()) is None  # a model built by hand
    assert build_cache_key(fp, BuildOptions(dump_after={"quantize-weights": Path("/tmp/x")})) is None


@pytest.mark.slow
def test_cli_reuses_an_unchanged_compile(tmp_path, monkeypatch, capsys):
    from foldline.tools.cli import main

    monkeypatch.setenv("FOLDLINE_CACHE", str(tmp_path / "cache"))
    args = ["compile", "llama-tiny", "--cpu", "host"]  # one module: the cache's logic, not x86-all's three compiles
    assert main([*args, "-o", str(tmp_path / "a")]) == 0
    first = capsys.readouterr().err
    assert "stage times: export" in first and "iree-compile" in first and "reused" not in first
    assert main([*args, "-o", str(tmp_path / "b")]) == 0
    assert "reused from the compile cache" in capsys.readouterr().err
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    # answered without importing torch or the compiler stages (seconds of imports on a cache hit)
    probe = ("import sys; from foldline.tools.cli import main; "
             f"rc = main({[*args, '-o', str(tmp_path / 'e')]!r}); "
             "print(rc, sorted(m for m in ('torch', 'foldline.backends.build', 'foldline.passes.manager') "
             "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env={**os.environ, "FOLDLINE_CACHE": str(tmp_path / "cache")})
    assert out.stdout.strip().splitlines()[-1] == "0 []", out.stdout + out.stderr
    assert "reused from the compile cache" in out.stderr
    assert main([*args, "--no-cache", "-o", str(tmp_path / "c")]) == 0
    assert "reused" not in capsys.readouterr().err
    assert main([*args, "--max-context", "64", "-o", str(tmp_path / "d")]) == 0  # other options: a miss
    assert "reused" not in capsys.readouterr().err
    assert main(["cache", "ls"]) == 0
    listing = capsys.readouterr().out
    assert "2 bundle(s)" in listing and listing.count("llama-tiny") == 2
    assert main(["cache", "clear"]) == 0
    assert main(["cache", "ls"]) == 0 and "0 bundle(s)" in capsys.readouterr().out

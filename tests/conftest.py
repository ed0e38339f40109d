"""Fixtures the test groups share (compiled bundles are expensive, so each is built once per test run);
a group's own fixtures are in its conftest.py."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from pathlib import Path

import pytest

# ---- garbage collection over a long run ----------------------------------------------------------
# Session fixtures keep compiled bundles, loaded models and exported programs alive for the whole run:
# millions of objects that every full collection would walk again, in each later test that builds
# torch graphs. After each test, what is still alive is collected once and frozen out of later
# collections (gc.freeze), so a collection walks only what the current test made.
_gc_time = {"s": 0.0, "collections": 0, "start": 0.0}


def _time_gc(phase: str, _info: dict) -> None:
    if phase == "start":
        _gc_time["start"] = time.perf_counter()
    else:
        _gc_time["s"] += time.perf_counter() - _gc_time["start"]
        _gc_time["collections"] += 1


gc.callbacks.append(_time_gc)


# The files that take longest (together half the suite's time on 2 cores; pytest's --durations shows
# them), run first, longest first: with the suite on two workers (README), a long file started last would
# leave one worker alone at the end. The rest keep their order. Paths are relative to tests/.
LONGEST_FIRST = ("backends/test_tensor_parallel.py", "e2e/test_gguf_models.py", "backends/test_multi_device.py",
                 "e2e/test_hadamard_compile.py", "serve/test_serve.py", "kernels/test_aarch64.py",
                 "backends/test_onnx.py", "backends/test_kv_tiles.py", "kernels/test_quant_compile.py",
                 "kernels/test_fusion.py", "backends/test_fused_attention.py", "backends/test_vulkan.py",
                 "backends/test_lowering.py", "kernels/test_int8_decode.py", "serve/test_robust.py",
                 "backends/test_onnx_genai.py")
TESTS = Path(__file__).resolve().parent


def pytest_configure(config) -> None:
    # pytest-xdist hands out the files with the most tests first unless told not to; this order is ours.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_tests_path(item), len(rank)))  # stable: a file's tests keep their order


def _tests_path(item) -> str:
    """The item's file relative to tests/ ('' for a file outside it)."""
    path = Path(item.path).resolve()
    return path.relative_to(TESTS).as_posix() if path.is_relative_to(TESTS) else ""


def pytest_runtest_teardown(item, nextitem) -> None:
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config) -> None:
    gc.unfreeze()  # what the run kept is freed before the interpreter exits, not reported as leaked
    gc.collect()


def pytest_terminal_summary(terminalreporter) -> None:
    terminalreporter.write_line(f"garbage collection: {_gc_time['collections']} collections, "
                                f"{_gc_time['s']:.1f} s; {gc.get_freeze_count()} objects frozen")


@pytest.fixture(scope="session")
def bundle_factory(tmp_path_factory) -> Callable[..., Path]:
    """compile(spec, target="cpu", passes=None, chunk=16, ..., batch=1, devices=1, scheme=...) -> bundle dir, once per session
    and from the compile cache when an earlier run compiled the same inputs with the same sources."""
    from foldline.backends.build import BuildOptions, compile_model
    from foldline.backends.compile_cache import CompileCache
    from foldline.backends.targets import make_target
    from foldline.frontend.sources import load_model

    cache: dict[tuple, Path] = {}

    def compile_bundle(spec: str, target: str = "cpu", passes: tuple[str, ...] | None = None,
                       chunk: int = 16, max_context: int | None = None,
                       kv_dtype: str = "auto", batch: int = 1, attention: str = "auto", devices: int = 1,
                       weights: str = "auto", scheme: str = "pipeline") -> Path:
        key = (spec, target, passes, chunk, max_context, kv_dtype, batch, attention, devices, weights, scheme)
        if key not in cache:
            out = tmp_path_factory.mktemp(spec.replace("/", "_")) / "bundle"
            loaded = load_model(spec, max_context=max_context)
            options = BuildOptions(targets=[make_target(target)], passes=list(passes) if passes is not None else None,
                                   chunk=chunk, kv_dtype=kv_dtype, batch=batch, attention=attention,
                                   devices=devices, weights=weights, scheme=scheme)
            compile_model(loaded, out, options, progress=lambda _msg: None, cache=CompileCache())
            cache[key] = out
        return cache[key]

    return compile_bundle


# ---- backends: compiled through the command line, shared by the backend and integrity tests ----

def vulkan_device_names() -> list[str]:
    """The Vulkan devices IREE's driver sees here (lavapipe counts), [] when there is none."""
    from foldline.runtime.device import available_devices

    return available_devices("vulkan")


@pytest.fixture(scope="session")
def vulkan_device() -> str:
    """The name of the Vulkan device the tests run on; skips the test when there is none."""
    names = vulkan_device_names()
    if not names:
        pytest.skip("no Vulkan device: the IREE vulkan driver finds none (apt-get install mesa-vulkan-drivers "
                    "libvulkan1 gives the lavapipe CPU device)")
    return names[0]


@pytest.fixture(scope="session")
def cli_bundle(tmp_path_factory) -> Callable[..., Path]:
    """cli_bundle(*compile_args) -> bundle dir from `foldline compile ARGS -o DIR`, once per session."""
    from foldline.tools.cli import main

    cache: dict[tuple[str, ...], Path] = {}

    def compile_bundle(*args: str) -> Path:
        if args not in cache:
            out = tmp_path_factory.mktemp("cli_bundle") / "bundle"
            rc = main(["compile", *args, "-o", str(out)])
            assert rc == 0, f"foldline compile {' '.join(args)} exited with {rc}"
            cache[args] = out
        return cache[args]

    return compile_bundle


@pytest.fixture(scope="session")
def other_weights_bundle(tmp_path_factory) -> Path:
    """llama-tiny with different weights (seed 1), for cpu and cuda sm_80: the source of
    foreign files in the integrity tests and the CUDA bundle of the backend tests."""
    from foldline.backends.build import BuildOptions, compile_model
    from foldline.backends.compile_cache import CompileCache
    from foldline.backends.targets import make_target
    from foldline.frontend.sources import load_model

    out = tmp_path_factory.mktemp("other_weights") / "bundle"
    options = BuildOptions(targets=[make_target("cpu"), make_target("cuda", cuda_arch="sm_80")])
    compile_model(load_model("llama-tiny", seed=1), out, options, progress=lambda _msg: None, cache=CompileCache())
    return out


# ---- real GGUF models (tests/helpers/gguf_reference.py): each loaded and compiled once --------


@pytest.fixture(scope="session")
def gguf_models() -> Callable[[str], object]:
    """name -> LoadedModel for a shipped GGUF model, loaded once per session."""
    from foldline.frontend.sources import load_model

    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = load_model(name)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def gguf_bundles(gguf_models, tmp_path_factory) -> Callable[[str], Path]:
    """name -> bundle dir (default pipeline, IREE CPU), compiled once per source state (compile cache)."""
    from helpers.gguf_reference import compiled_bundle

    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = compiled_bundle(name, gguf_models(name), tmp_path_factory.mktemp(name) / "bundle")
        return cache[name]

    return get


# ---- passes: reference exports, each traced once per session ------------------------------------


@pytest.fixture(scope="session")
def exported_unit() -> Callable[..., object]:
    """exported_unit(config, batch=1, chunk=8) -> the reference CompileUnit, exported once per session.

    Shared between tests: run passes on `foldline.testing.golden.copy_unit(unit)`, never on it.
    """
    import torch

    from foldline.frontend.export import export_model
    from foldline.frontend.model import build_model
    from foldline.passes.manager import CompileUnit

    cache: dict[tuple, object] = {}

    def get(config, batch: int = 1, chunk: int = 8, seed: int = 0):
        key = (config, batch, chunk, seed)
        if key not in cache:
            with torch.no_grad():
                entries = export_model(build_model(config, seed=seed), batch, chunk)
            cache[key] = CompileUnit(config, {n: e.program for n, e in entries.items()},
                                     entries["prefill"].state_specs)
        return cache[key]

    return get


@pytest.fixture
def torch_one_thread():
    """Eager runs of tiny graphs are dominated by thread hand-offs on a shared machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

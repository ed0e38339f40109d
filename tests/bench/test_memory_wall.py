"""bench/memory_wall.py: the dispatches a decode step records, the bytes it reads, the host's bandwidth."""

from __future__ import annotations

import iree.runtime as rt
import pytest

from foldline.bench.memory_wall import (
    count_dispatches,
    disassemble,
    dispatches_per_step,
    function_bodies,
    host_read_gb_s,
    step_reads,
)
from foldline.contract.manifest import Manifest

DISASSEMBLY = """vm.module @module version 0
vm.import @hal.command_buffer.dispatch cconv "0rrIiiiICiDCiirIID_v"
vm.export @prefill$async
vm.func @prefill$async(%r0: !vm.ref<?>) -> (!vm.ref<?>) {
^bb0:
  vm.call.variadic @hal.command_buffer.dispatch segments[0](%r0)
  vm.call.variadic @hal.command_buffer.dispatch segments[0](%r0)
  vm.call.variadic @hal.command_buffer.dispatch segments[0](%r0)
  vm.return %r0
}

vm.export @decode$async
vm.func @decode$async(%r0: !vm.ref<?>) -> (!vm.ref<?>) {
^bb0:
  vm.call.variadic @hal.command_buffer.dispatch segments[0](%r0)
  vm.call @hal.command_buffer.finalize(%r0)
  vm.call.variadic @hal.command_buffer.dispatch segments[0](%r0)
  vm.return %r0
}

vm.func @__init() -> () {
^bb0:
  vm.cond_br %i40, ^bb2(), ^bb5()
  vm.call.variadic @hal.command_buffer.dispatch segments[0](%r0)
}
"""


def test_dispatches_are_counted_in_the_named_function_only():
    assert count_dispatches(DISASSEMBLY, "decode$async") == (2, False)
    assert count_dispatches(DISASSEMBLY, "prefill$async") == (3, False)
    assert count_dispatches(DISASSEMBLY, "__init") == (1, True)  # a branch: the count is an upper bound
    with pytest.raises(ValueError, match="no function 'decode_rows2\\$async'"):
        count_dispatches(DISASSEMBLY, "decode_rows2$async")


REPLAYED = """vm.module @module version 0
vm.func @prefill$async(%r0: !vm.ref<?>) -> (!vm.ref<?>) {
^bb0:
  vm.call.variadic @hal.command_buffer.dispatch segments[0](%r0)
  vm.return %r0
}

vm.func @fn1() -> (!vm.ref<?>) {
^bb0:
  %r0 = vm.call @hal.command_buffer.create(%r35, %i7, %i4, %i72, %i32)
  vm.call.variadic @hal.command_buffer.dispatch segments[0](%r0)
  vm.call.variadic @hal.command_buffer.dispatch segments[0](%r0)
  vm.call @hal.command_buffer.finalize(%r0)
  vm.return %R0
}

vm.func @decode$async(%r0: !vm.ref<?>) -> (!vm.ref<?>) {
^bb0:
  %r11 = vm.global.load.ref .refs[7] : !hal.command_buffer
  vm.call.variadic @hal.device.queue.execute.indirect segments[10](%r2, %i24, %R12, %r0, %R11)
  vm.return %r0
}

vm.func @__init() -> () {
^bb0:
  %r4 = vm.call @module:0()
  %r0 = vm.call @module:1()
  vm.global.store.ref %R0, .refs[7] : !hal.command_buffer
  vm.return
}
"""


def test_a_replayed_step_counts_the_dispatches_its_command_buffer_records():
    """A step with no input-dependent shape is recorded once by the initializer and replayed: its
    dispatches are those of the function whose result the initializer stores in the replayed global."""
    assert count_dispatches(REPLAYED, "decode$async") == (2, False)
    assert count_dispatches(REPLAYED, "prefill$async") == (1, False)
    broken = REPLAYED.replace(".refs[7] : !hal.command_buffer\n  vm.return\n", ".refs[8] : !hal.command_buffer\n  vm.return\n")
    with pytest.raises(ValueError, match="no function records the command buffer in global 7"):
        count_dispatches(broken, "decode$async")


def test_a_compiled_step_is_straight_line_with_dispatches_for_every_layer(bundle_factory):
    manifest = Manifest.load(bundle_factory("llama-tiny"))
    for key, entry in manifest.modules.items():
        calls, branches = dispatches_per_step(manifest.root / entry.file)
        assert not branches, key
        assert calls >= 2 * len(manifest.config["layer_types"]), key  # at least attention and MLP per layer


def test_a_one_row_step_is_recorded_once_and_replayed(bundle_factory):
    """The decode attention kernel writes the caches itself (kernels/attention.py), so nothing in a one-row
    step reads the host position: IREE records its command buffer at load and the step replays it.
    Its dispatches are then the recorder's, fewer than the prefill's own."""
    manifest = Manifest.load(bundle_factory("llama-tiny"))
    for key, entry in manifest.modules.items():
        text = disassemble(manifest.root / entry.file)
        decode = "\n".join(function_bodies(text)["decode$async"])
        assert "@hal.command_buffer.dispatch" not in decode and "queue.execute.indirect" in decode, key
        assert count_dispatches(text, "decode$async")[0] >= 2 * len(manifest.config["layer_types"]), key


def test_a_step_reads_every_tied_weight_and_the_state_held(bundle_factory):
    manifest = Manifest.load(bundle_factory("llama-tiny"))
    index = rt.ParameterIndex()
    index.load(str(manifest.root / manifest.params_files[0].file))
    weights = sum(entry.length for _name, entry in index.items())
    assert manifest.config["tie_word_embeddings"]
    per_token = sum(s.nbytes // s.shape[2] for s in manifest.state)  # llama-tiny: full caches only
    for held in (1, 20, 100):
        reads = step_reads(manifest, held)
        assert reads.weights == weights and reads.state == per_token * held


def test_the_bandwidth_probe_reads_at_a_plausible_rate():
    figures = host_read_gb_s(2, nbytes=64 << 20, repeats=3)
    assert len(figures) == 3 and all(0.1 < f < 2000 for f in figures)

"""The prompt cache: a released row's state serves a new prompt's prefix, and the logits stay a fresh run's."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from foldline.runtime import Model
from foldline.runtime.prompt_cache import ReuseRule, common_prefix, place


def spec(kind: str, slots: int = 64) -> SimpleNamespace:
    return SimpleNamespace(kind=kind, shape=(2, 1, slots, 8))


def test_rules_follow_the_kinds_of_state():
    full = ReuseRule.for_state([spec("global_kv"), spec("local_kv", 64)], max_context=64)
    ring = ReuseRule.for_state([spec("global_kv"), spec("local_kv", 16)], max_context=64)
    recurrent = ReuseRule.for_state([spec("global_kv"), spec("gdn_recurrent", 4), spec("gdn_conv", 3)], max_context=64)
    assert full == ReuseRule(whole_only=False)
    assert ring == ReuseRule(whole_only=True)
    assert recurrent == ReuseRule(whole_only=True)

    held = [5, 6, 7, 8]
    assert full.usable(held, [5, 6, 9, 9]) == 2, "full caches serve any shared prefix"
    assert ring.usable(held, [5, 6, 9, 9]) == 0 and recurrent.usable(held, [5, 6, 9, 9]) == 0
    for rule in (full, ring, recurrent):
        assert rule.usable(held, [*held, 1, 2]) == 4, "a continuation of every held token"
        assert rule.usable(held, [9, 5, 6]) == 0
        assert rule.usable([], [1, 2]) == 0
    assert full.usable(held, held) == 3, "the last prompt token is always fed"
    assert full.usable(held, [*held, 1], prefilled=2) == 2, "full caches serve only what prefill computed"
    assert ring.usable(held, [*held, 1], prefilled=2) == 4, "rings cannot be rewound: the whole row or nothing"
    assert ring.usable(held, held) == 0
    assert full.usable(held, [5]) == 0


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([7], [8]) == 0


def test_a_prompt_takes_its_own_row_then_an_empty_one_then_the_least_recently_used():
    """Two chats share a template header: the second takes an empty row, not the first chat's row."""
    full = ReuseRule(whole_only=False)
    header, chat_a, chat_b = [1, 2, 3], [1, 2, 3, 10, 11, 12], [1, 2, 3, 20, 21, 22]
    held, prefilled = [chat_a, [], [], []], [len(chat_a), 0, 0, 0]
    used = [1, 0, 0, 0]
    assert place(full, [0, 1, 2, 3], held, prefilled, used, chat_b) == (1, 0), "an empty row, the lowest"
    assert place(full, [0, 1, 2, 3], held, prefilled, used, [*chat_a, 13, 14]) == (0, 6), "its own row"
    held, prefilled, used = [chat_a, chat_b, [*header, 30], [*header, 40]], [6, 6, 4, 4], [4, 1, 3, 2]
    assert place(full, [0, 1, 2, 3], held, prefilled, used, [*header, 50, 51]) == (1, 3), "the least recently used"
    assert place(full, [0, 2, 3], held, prefilled, used, [*header, 50, 51]) == (3, 3)
    assert place(full, [0, 1, 2, 3], held, prefilled, used, [1, 2, 3, 10, 99, 98]) == (1, 3), "LRU, not chat A's"
    assert place(full, [0, 1, 2, 3], held, prefilled, used, chat_a) == (0, 5), "the same prompt again: its row"
    ring = ReuseRule(whole_only=True)
    assert place(ring, [0, 1], [chat_a, []], [0, 0], [1, 0], chat_b) == (1, 0)
    assert place(ring, [0, 1], [chat_a, chat_b], [0, 0], [1, 2], []) == (0, 0), "a row for a restore: LRU"


def _feed(batch, row: int, ids: list[int], chunk: int) -> np.ndarray:
    """Feed prompt tokens `ids` to `row` in prefill chunks, as the scheduler does; the logits after the last."""
    logits = None
    for i in range(0, len(ids), chunk):
        logits = batch.step({row: ids[i:i + chunk]}, prompt_rows={row})[row]
    return logits


def _fresh(model: Model, ids: list[int]) -> np.ndarray:
    with model.session() as s:
        return s.prefill(ids)


def _assert_same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * max(1.0, float(np.abs(want).max())), err_msg=what)
    assert int(np.argmax(got)) == int(np.argmax(want)), what


def test_full_caches_serve_any_shared_prefix(bundle_factory):
    """llama-tiny (global attention only): a released row serves a prompt that shares part of what was
    prefilled, and the logits are those of a fresh prefill to the bit."""
    model = Model.load(bundle_factory("llama-tiny"))
    rng = np.random.default_rng(11)
    prompt = rng.integers(1, model.vocab_size, 40).tolist()
    batch = model.batch()
    row, reused = batch.open_row_reusing(prompt)
    assert reused == 0
    _feed(batch, row, prompt, model.chunk)
    for token in (3, 4, 5):
        batch.step({row: [token]})
    held = list(batch.tokens[row])
    assert held == [*prompt, 3, 4, 5]
    batch.release(row)

    # a continuation: the prompt is served, not the tokens the decode steps computed
    follow = [*held, 6, 7]
    row, reused = batch.open_row_reusing(follow)
    assert reused == len(prompt) and batch.prefilled[row] == len(prompt)
    assert np.array_equal(_feed(batch, row, follow[reused:], model.chunk), _fresh(model, follow)), \
        "a prompt's state is a prefill from scratch, to the bit"
    batch.release(row)

    # a prompt that shares 25 tokens, then differs: the row is rewound to 25 and fed the rest
    other = [*prompt[:25], *rng.integers(1, model.vocab_size, 12).tolist()]
    row, reused = batch.open_row_reusing(other)
    assert reused == 25 and batch.positions[row] == 25
    assert np.array_equal(_feed(batch, row, other[25:], model.chunk), _fresh(model, other)), "rewound"
    batch.release(row)

    # the same prompt again: every token but the last is served, and the last is prefilled, not decoded
    row, reused = batch.open_row_reusing(other)
    assert reused == len(other) - 1
    assert np.array_equal(_feed(batch, row, other[-1:], model.chunk), _fresh(model, other)), "the same prompt"


@pytest.mark.slow
def test_rings_continue_after_riding_along(bundle_factory):
    """gemma3-tiny (rings of 16 slots, wrapped): a released row keeps its tokens while another row decodes."""
    model = Model.load(bundle_factory("gemma3-tiny", batch=2))
    assert model.batch_size == 2
    rng = np.random.default_rng(12)
    first = rng.integers(1, model.vocab_size, 30).tolist()
    batch = model.batch()
    a, _ = batch.open_row_reusing(first)
    _feed(batch, a, first, model.chunk)
    for token in (7, 8, 9, 10):
        batch.step({a: [token]})
    held = list(batch.tokens[a])
    batch.release(a)

    second = rng.integers(1, model.vocab_size, 9).tolist()
    assert batch.open_row_reusing(second) == (0, 0), "a prompt that shares nothing takes the lowest free row"
    batch.release(0)
    a, _ = batch.open_row_reusing(first)  # row 0 again, fed the same as before
    _feed(batch, a, first, model.chunk)
    for token in (7, 8, 9, 10):
        batch.step({a: [token]})
    assert batch.tokens[a] == held
    batch.release(a)
    b = batch.open_row(1)
    _feed(batch, b, second, model.chunk)
    for token in (11, 12, 13, 14, 15, 16):
        batch.step({b: [token]})  # decode calls over rows 0 and 1: the free row 0 rides along at its next position
    assert batch.tokens[a] == held

    follow = [*held, *rng.integers(1, model.vocab_size, 6).tolist()]
    row, reused = batch.open_row_reusing(follow)
    assert (row, reused) == (a, len(held))
    _assert_same(_feed(batch, row, follow[len(held):], model.chunk), _fresh(model, follow),
                 "a continuation of a kept row after decode steps of another")
    batch.release(row)
    row, reused = batch.open_row_reusing([*held[:20], 1, 2, 3])
    assert reused == 0, "a ring serves no shorter prefix"


@pytest.mark.slow
def test_recurrent_state_is_kept_while_other_rows_decode(bundle_factory):
    """qwen35-tiny (gated delta net): a continuation reuses the row, also after another row's prefill and
    decode calls in which it rode along with no token (n_valid 0)."""
    model = Model.load(bundle_factory("qwen35-tiny", batch=2))
    rng = np.random.default_rng(13)
    first = rng.integers(1, model.vocab_size, 21).tolist()
    batch = model.batch()
    a, _ = batch.open_row_reusing(first)
    _feed(batch, a, first, model.chunk)
    batch.step({a: [4]})
    held = list(batch.tokens[a])
    batch.release(a)

    follow = [*held, *rng.integers(1, model.vocab_size, 5).tolist()]
    row, reused = batch.open_row_reusing(follow)
    assert (row, reused) == (a, len(held))
    _assert_same(_feed(batch, row, follow[len(held):], model.chunk), _fresh(model, follow), "recurrent continuation")
    batch.release(row)

    held = list(batch.tokens[a])
    b = batch.open_row(1 - a)
    batch.step({b: [1, 2, 3]})
    batch.step({b: [5]})  # decode over both rows: row a rides along, fed nothing
    assert batch.tokens[a] == held
    batch.release(b)
    again = [*held, *rng.integers(1, model.vocab_size, 4).tolist()]
    row, reused = batch.open_row_reusing(again)
    assert (row, reused) == (a, len(held))
    _assert_same(_feed(batch, row, again[len(held):], model.chunk), _fresh(model, again),
                 "recurrent continuation after riding along")


def test_checkpoints_serve_a_prompt_that_leaves_a_ring_or_recurrent_row():
    """A whole-only row serves a diverging prompt from its last checkpoint at or before the divergence."""
    ring = ReuseRule(whole_only=True)
    held = list(range(1, 41))
    edited = [*held[:29], 99, 98]
    assert ring.usable(held, edited) == 0, "without checkpoints: nothing"
    assert ring.usable(held, edited, checkpoints=[8, 16, 24, 32]) == 24, "the last checkpoint before the edit"
    assert ring.usable(held, [*held, 7], checkpoints=[8, 16]) == 40, "a continuation still takes the whole row"
    assert ring.usable(held, held[:16], checkpoints=[8, 16]) == 8, "the last prompt token is always fed"
    assert ring.served(held) == 40


def test_a_conversation_takes_back_its_row_and_a_prompt_asked_again_its_own():
    """`preferred` (a prompt_cache_key's row) wins when it serves anything; a prompt that repeats all a row's
    prefill computed takes that row back (it loses at most an answer), also when an empty row is free."""
    ring = ReuseRule(whole_only=True)
    prompt = list(range(1, 33))
    held = [*prompt, 70, 71, 72]  # the prompt and an answer
    edited = [*prompt[:20], 90, 91]
    rows, used = [0, 1], [1, 0]
    marks = [[8, 16, 24, 32], []]
    assert place(ring, rows, [held, []], [32, 0], used, edited, marks) == (1, 0), "an empty row first"
    assert place(ring, rows, [held, []], [32, 0], used, edited, marks, preferred=0) == (0, 16), "its own row"
    assert place(ring, rows, [held, []], [32, 0], used, [9, 9, 9], marks, preferred=0) == (1, 0), \
        "its row serves nothing: the usual rules"
    assert place(ring, rows, [held, []], [32, 0], used, prompt, marks) == (0, 24), "asked again"
    full = ReuseRule(whole_only=False)
    assert place(full, rows, [held, []], [32, 0], used, edited) == (1, 0)
    assert place(full, rows, [held, []], [32, 0], used, edited, preferred=0) == (0, 20)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["gemma3-tiny", "qwen35-tiny"])
def test_checkpoints_resume_an_edited_prompt_to_the_bit(bundle_factory, preset):
    """gemma3-tiny (rings of 16 slots, wrapped four times) and qwen35-tiny (gated delta net): a row keeps
    its rings and recurrent state at its prompt's chunk boundaries (the latest 3); a prompt edited after
    one resumes there and its logits are a prefill from scratch's, to the bit. Another row's calls leave the
    free row's state and checkpoints as they were."""
    model = Model.load(bundle_factory(preset, batch=2))
    chunk = model.chunk
    rng = np.random.default_rng(14)
    prompt = rng.integers(1, model.vocab_size, 4 * chunk + 11).tolist()
    batch = model.batch(checkpoints=3)
    assert batch.volatile and batch.checkpoint_nbytes() > 0
    assert Model.batch(model).max_checkpoints == 0, "none unless asked for"
    row, reused = batch.open_row_reusing(prompt)
    assert reused == 0
    _feed(batch, row, prompt, chunk)
    assert batch.checkpoint_positions(row) == [2 * chunk, 3 * chunk, 4 * chunk], "the latest 3 chunk boundaries"
    for token in (3, 4, 5):
        batch.step({row: [token]})
    assert batch.checkpoint_positions(row) == [2 * chunk, 3 * chunk, 4 * chunk], "decode steps take none"
    batch.release(row)

    edit_at = 3 * chunk + 5
    edited = [*prompt[:edit_at], *rng.integers(1, model.vocab_size, 20).tolist()]
    row, reused = batch.open_row_reusing(edited, row)
    assert reused == 3 * chunk and batch.positions[row] == 3 * chunk, "the last checkpoint before the edit"
    assert np.array_equal(_feed(batch, row, edited[reused:], chunk), _fresh(model, edited)), \
        f"{preset}: an edited prompt resumed from a checkpoint"
    assert batch.checkpoint_positions(row) == [2 * chunk, 3 * chunk, 4 * chunk], "later ones taken anew"
    batch.step({row: [6]})
    batch.release(row)

    # another row's prefill and decode calls: this free row rides along, fed nothing
    other = batch.open_row(1 - row)
    batch.step({other: [1, 2, 3]})
    saved = []
    batch.before_evict = lambda r: saved.append(batch.snapshot_row(r))
    batch.step({other: [7]})
    assert batch.tokens[row] == [*edited, 6] and not saved
    batch.release(other)
    prompt_again = edited[:4 * chunk + 3]
    row_again, reused = batch.open_row_reusing(prompt_again, row)
    assert reused == 4 * chunk
    assert np.array_equal(_feed(batch, row_again, prompt_again[reused:], chunk), _fresh(model, prompt_again)), \
        f"{preset}: resumed after riding along"
    batch.release(row_again)

    # a row zeroed for another prompt forgets its checkpoints; one restored from a snapshot has none
    batch.before_evict = None
    batch.open_row(row)
    assert batch.checkpoint_positions(row) == []

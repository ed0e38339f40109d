"""Streaming text: exact pieces, constant work per token, stop strings never leak (runtime/streaming.py)."""

from __future__ import annotations

import pytest

from foldline.runtime.streaming import IncrementalDetokenizer, StopStringFilter, stream_pieces

from e2e.test_gguf_models import MODELS, _skip_unless_installed
from helpers.gguf_reference import TOKENIZER_TEXTS

MULTIBYTE = [
    "emoji 🎉🎉 and a family 👩‍👩‍👧 then 🙂🙃 done",
    "中文测试：你好，世界！日本語のテキスト。한국어 텍스트.",
    "accents: naïve café résumé Zürich Ångström — “quotes” … ellipsis",
    "rare code points spelled in bytes: 𓀀 🜁 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𐍈",
]


class CountingTokenizer:
    """A real tokenizer that records how many ids each decode call was given."""

    def __init__(self, inner):
        self.inner = inner
        self.sizes: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        self.sizes.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(params=MODELS)
def tokenizer(request, gguf_models):
    _skip_unless_installed(request.param)
    from tokenizers import Tokenizer

    return Tokenizer.from_str(gguf_models(request.param).tokenizer_json)


def _stream(tok, ids):
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(t) for t in ids]
    return pieces, detok.flush()


def test_pieces_concatenate_to_the_full_decode(tokenizer):
    held_back = 0
    for text in TOKENIZER_TEXTS + MULTIBYTE:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        pieces, tail = _stream(tokenizer, ids)
        assert "".join(pieces) + tail == tokenizer.decode(ids), text
        assert not any("\ufffd" in p for p in pieces), f"a piece split a character: {text}"
        held_back += pieces.count("")
    assert held_back > 0, "no token ended inside a character: the texts do not exercise the hold-back"


def test_work_per_token_is_constant(tokenizer):
    text = " ".join(TOKENIZER_TEXTS + MULTIBYTE) * 8
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    counting = CountingTokenizer(tokenizer)
    pieces, tail = _stream(counting, ids)
    assert len(ids) > 500
    assert "".join(pieces) + tail == tokenizer.decode(ids)
    assert max(counting.sizes) <= 16, f"a decode call saw {max(counting.sizes)} ids of {len(ids)}"
    assert len(counting.sizes) <= 2 * len(ids) + 2


def test_an_unfinished_character_is_flushed_at_the_end(tokenizer):
    for text in MULTIBYTE:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        for cut in range(1, len(ids)):
            if tokenizer.decode(ids[:cut]).endswith("\ufffd"):
                pieces, tail = _stream(tokenizer, ids[:cut])
                assert tail.endswith("\ufffd")
                assert "".join(pieces) + tail == tokenizer.decode(ids[:cut])
                return
    raise AssertionError("no prefix of these texts ends inside a character: the test proves nothing")


def test_stop_string_never_leaks_its_start():
    f = StopStringFilter(["\n\n"])
    assert [f.push(p) for p in ["Hello", "\n", "\nWorld"]] == ["Hello", "", ""]
    assert f.stopped and f.flush() == ""


def test_a_partial_stop_string_is_released_when_it_does_not_complete():
    f = StopStringFilter(["\n\n", "END"])
    out = [f.push(p) for p in ["a\n", "b E", "N", "x", "\n"]]
    assert out == ["a", "\nb ", "", "ENx", ""]
    assert not f.stopped and f.flush() == "\n"


def test_stop_string_inside_one_piece_and_across_many():
    f = StopStringFilter(["stop here"])
    assert f.push("go on stop here and more") == "go on "
    f = StopStringFilter(["stop here"])
    assert "".join(f.push(c) for c in "go on stop here and more") == "go on "


def test_stream_pieces_end_at_stop_ids_and_strings(tokenizer):
    text = "First line.\n\nSecond line. 🎉 Third."
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert "".join(stream_pieces(iter(ids), tokenizer)) == tokenizer.decode(ids)
    assert "".join(stream_pieces(iter(ids), tokenizer, ["\n\n"])) == "First line."
    assert "".join(stream_pieces(iter(ids), tokenizer, stop_ids=[ids[3]])) == tokenizer.decode(ids[:3])
    assert "".join(stream_pieces(iter(ids), tokenizer, ["🎉"])) == tokenizer.decode(ids).split("🎉")[0]


class _Letters:
    """Ids are code points: a decoder with no tokenizer behind it."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def _drain(gen):
    pieces = []
    while True:
        try:
            pieces.append(next(gen))
        except StopIteration as end:
            return "".join(pieces), end.value


def test_stream_pieces_says_whether_a_stop_string_ended_it():
    ids = [ord(c) for c in "one two. three"]
    assert _drain(stream_pieces(iter(ids), _Letters(), [". "])) == ("one two", True)
    assert _drain(stream_pieces(iter(ids), _Letters(), ["four"])) == ("one two. three", False)
    assert _drain(stream_pieces(iter(ids), _Letters(), [". "], stop_ids=[ord("w")])) == ("one t", False)

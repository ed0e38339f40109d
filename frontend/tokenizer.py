"""A `tokenizers` tokenizer.json rebuilt from a GGUF file's tokenizer metadata.

A GGUF carries no tokenizer.json, only llama.cpp's description of the
vocabulary. The bundle's runtime needs a tokenizer without transformers, so we
rebuild one with the `tokenizers` library:

- `gpt2` (byte-level BPE, SmolLM2, Llama 3, Qwen): vocabulary and merges from
  the file; the pre-tokenizer split follows `tokenizer.ggml.pre` the way
  llama.cpp's tokenizer does (SmolLM2 isolates every digit).
- `llama` (SentencePiece BPE with byte fallback, Gemma): the file has scores but
  no merges; merges are rebuilt from the vocabulary, best first, with the same
  ordering HF transformers' GGUF loader uses (token order for Gemma, whose
  scores do not follow merge order; scores otherwise).

Tokens the file marks as control become special added tokens (matched whole
and skipped when decoding); user-defined ones become plain added tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from ..errors import FoldlineError

TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
SPM_SPACE = "\u2581"


class TokenizerBuildError(FoldlineError, ValueError):
    """The GGUF tokenizer metadata describes a tokenizer foldline cannot rebuild."""


# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), by tokenizer.ggml.pre.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# pre type -> regexes applied in order (each splits the pieces of the previous one).
BYTE_LEVEL_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2_SPLIT,),
    "gpt2": (_GPT2_SPLIT,),
    "gpt-2": (_GPT2_SPLIT,),
    "mpt": (_GPT2_SPLIT,),
    "olmo": (_GPT2_SPLIT,),
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "starcoder": (r"\p{N}", _GPT2_SPLIT),
    "refact": (r"\p{N}", _GPT2_SPLIT),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "llama-v3": (_LLAMA3_SPLIT,),
    "smaug-bpe": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def generate_spm_merges(vocab: Mapping[str, int], scores: Mapping[str, float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: every split of a token into two tokens,
    ordered by the merged token's score (best first), then by longer left piece.

    The splits of one token all differ in the length of their left piece, so that order is
    total within a token; tokens of equal score keep the vocabulary's order (a stable sort).
    """
    merges: list[tuple[float, int, int, str, str]] = []
    known = vocab.__contains__
    for token, score in scores.items():
        for i in range(1, len(token)):
            left = token[:i]
            if known(left):
                right = token[i:]
                if known(right):
                    merges.append((score, i, len(token) - i, left, right))
    merges.sort(key=lambda m: m[:3], reverse=True)
    return [(m[3], m[4]) for m in merges]


def _added_tokens(tokens: Sequence[str], types: Sequence[int], vocab: Mapping[str, int],
                  alphabet: set[str] | None) -> tuple[list[AddedToken], list[AddedToken]]:
    special, plain = [], []
    for token, kind in zip(tokens, types):
        if kind == TOKEN_CONTROL and (alphabet is None or set(token) <= alphabet):
            special.append(AddedToken(token, normalized=False, special=True))
        elif kind == TOKEN_USER_DEFINED and token in vocab:
            plain.append(AddedToken(token, normalized=False, special=False))
    return special, plain


def _byte_level(meta: Mapping[str, Any]) -> tuple[Tokenizer, set[str]]:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    pre = meta.get("tokenizer.ggml.pre", "default") or "default"
    if pre not in BYTE_LEVEL_SPLITS:
        raise TokenizerBuildError(
            f"byte-level pre-tokenizer {pre!r} is not supported; known: {', '.join(sorted(BYTE_LEVEL_SPLITS))}"
        )
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        text = token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[text] = i
    raw_merges = meta.get("tokenizer.ggml.merges")
    if raw_merges is None:
        raise TokenizerBuildError("a gpt2 (byte-level BPE) tokenizer needs tokenizer.ggml.merges")
    merges = [tuple(m.split(" ", 1)) for m in raw_merges]
    tok = Tokenizer(BPE(vocab, merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                        fuse_unk=False))
    splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in BYTE_LEVEL_SPLITS[pre]]
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                     use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok, alphabet


def _sentencepiece(meta: Mapping[str, Any]) -> Tokenizer:
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    arch = meta.get("general.architecture", "")
    gemma = arch.startswith("gemma")
    if gemma:
        # Gemma stores runs of spaces as real spaces; the model sees them as runs of U+2581.
        tokens = [SPM_SPACE * len(t) if t and set(t) == {" "} else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    if gemma:
        order: dict[str, float] = {t: -i for i, t in enumerate(tokens)}
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None:
            raise TokenizerBuildError("a SentencePiece tokenizer needs tokenizer.ggml.scores")
        order = dict(zip(tokens, scores))
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    tok = Tokenizer(BPE(vocab, generate_spm_merges(vocab, order), fuse_unk=True, unk_token=unk, dropout=None,
                        byte_fallback=True))
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", not gemma))
    steps = [normalizers.Prepend(SPM_SPACE)] if add_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPM_SPACE)])
    dec = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    return tok


def build_tokenizer(meta: Mapping[str, Any]) -> Tokenizer:
    """A tokenizers.Tokenizer for the GGUF metadata (no BOS/EOS post-processing: the runtime adds BOS)."""
    model = meta.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in meta:
        raise TokenizerBuildError("the file has no tokenizer.ggml.tokens")
    alphabet: set[str] | None = None
    if model == "gpt2":
        tok, alphabet = _byte_level(meta)
    elif model == "llama":
        tok = _sentencepiece(meta)
    else:
        raise TokenizerBuildError(f"tokenizer model {model!r} is not supported (gpt2, llama)")
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or []
    special, plain = _added_tokens(tokens, types, tok.get_vocab(with_added_tokens=False), alphabet)
    if special:
        tok.add_special_tokens(special)
    if plain:
        tok.add_tokens(plain)
    return tok


def tokenizer_json_from_gguf(meta: Mapping[str, Any]) -> str:
    """The tokenizer.json document a bundle ships."""
    return build_tokenizer(meta).to_str()

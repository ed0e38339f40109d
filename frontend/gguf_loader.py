"""GGUF checkpoints (llama.cpp's format) -> ModelConfig + reference module + tokenizer.

Metadata and tensor directory are parsed here with numpy (gguf's own
GGUFReader builds a Python object per array element, which takes tens of
seconds on a 262k-token vocabulary); the format's enums and the
dequantization kernels are gguf's (`gguf.quants.dequantize`). Every weight is
dequantized to float32, one tensor at a time, straight into a module built on
the meta device, so peak memory stays near the size of the float32 model.

Conventions that differ from the HF checkpoints the reference modules follow:

- llama: llama.cpp's converter permutes the rows of Q and K so that RoPE
  rotates adjacent pairs. We undo that permutation (as HF's GGUF loader does)
  and keep the half-rotation (`rope_interleaved=False`); both are exact row
  reorders, and the parity tests against HF transformers prove the choice.
- gemma3: the converter stores RMSNorm weights as `1 + w`, so the module uses
  `x * w` (norm_weight_offset 0) on the stored values.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize as gguf_dequantize

from .config import ConfigError, ModelConfig

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

SUPPORTED_ARCHITECTURES = ("llama", "gemma3", "qwen35")
# Quantization types we load; each has a tested path through gguf.quants.dequantize.
SUPPORTED_QUANTS = (
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
)

# Compile-time context when the user gives none: room for a >512-token prompt
# on Gemma (so the 512 window matters), small enough for fast CPU builds.
DEFAULT_MAX_CONTEXT = {"llama": 512, "gemma3": 1024, "qwen35": 1024}

# Gemma's published turn format, used when a gemma3 GGUF carries no
# tokenizer.chat_template (the shipped 270M file has none). A system message is
# folded into the first user turn, as Gemma's own template does.
GEMMA_TURN_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\n\n' %}"
    "{% else %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{% if role == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


class GGUFError(ValueError):
    """A GGUF file foldline cannot turn into a model."""


class UnsupportedArchitectureError(GGUFError):
    """general.architecture names a family foldline does not map."""


class UnsupportedQuantError(GGUFError):
    """A tensor is stored in a quantization type foldline does not dequantize."""


class MissingTensorError(GGUFError):
    """A tensor the architecture needs is absent from the file."""


# ---------------------------------------------------------------------------
# Reading the file
# ---------------------------------------------------------------------------

_SCALAR_DTYPES: dict[int, np.dtype] = {
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.BOOL: np.dtype("<u1"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor directory; `shape` is numpy order (outermost first)."""

    name: str
    shape: tuple[int, ...]
    qtype: int
    offset: int  # absolute byte offset in the file

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.qtype).name
        except ValueError:
            return f"type {self.qtype}"

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.qtype)]
        return math.prod(self.shape) // block * size


class GGUFFile:
    """A memory-mapped GGUF file: metadata dict, tensor directory, raw tensor bytes."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = memoryview(self._map)
        self._pos = 0
        try:
            self._parse()
        except (IndexError, ValueError, UnicodeDecodeError) as e:
            if isinstance(e, GGUFError):
                raise
            raise GGUFError(f"{self.path} is not a readable GGUF file: {e}") from e

    # -- primitive reads ---------------------------------------------------
    def _read(self, dtype: np.dtype, count: int = 1) -> np.ndarray:
        n = dtype.itemsize * count
        if self._pos + n > len(self._buf):
            raise GGUFError(f"{self.path} is truncated (needs {n} bytes at offset {self._pos})")
        out = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._pos)
        self._pos += n
        return out

    def _u32(self) -> int:
        return int(self._read(np.dtype("<u4"))[0])

    def _u64(self) -> int:
        return int(self._read(np.dtype("<u8"))[0])

    def _string(self) -> str:
        n = self._u64()
        raw = bytes(self._buf[self._pos : self._pos + n])
        self._pos += n
        return raw.decode("utf-8", errors="surrogateescape")

    def _value(self, vtype: int) -> Any:
        if vtype == GGUFValueType.STRING:
            return self._string()
        if vtype == GGUFValueType.ARRAY:
            etype, count = self._u32(), self._u64()
            if etype == GGUFValueType.STRING:
                return [self._string() for _ in range(count)]
            if etype == GGUFValueType.ARRAY:
                return [self._value(GGUFValueType.ARRAY) for _ in range(count)]
            if etype not in _SCALAR_DTYPES:
                raise GGUFError(f"{self.path}: unknown array element type {etype}")
            arr = self._read(_SCALAR_DTYPES[etype], count)
            return arr.astype(bool).tolist() if etype == GGUFValueType.BOOL else arr.tolist()
        if vtype not in _SCALAR_DTYPES:
            raise GGUFError(f"{self.path}: unknown metadata value type {vtype}")
        value = self._read(_SCALAR_DTYPES[vtype])[0].item()
        return bool(value) if vtype == GGUFValueType.BOOL else value

    def _parse(self) -> None:
        if bytes(self._buf[:4]) != GGUF_MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file (bad magic {bytes(self._buf[:4])!r})")
        self._pos = 4
        self.version = self._u32()
        if self.version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {self.version} is not supported (big-endian or too new?)")
        n_tensors, n_kv = self._u64(), self._u64()
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._u32())
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._u32()
            dims = [self._u64() for _ in range(n_dims)]
            qtype, offset = self._u32(), self._u64()
            infos.append((name, tuple(reversed(dims)), qtype, offset))
        align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = (self._pos + align - 1) // align * align
        self.tensors: dict[str, TensorInfo] = {
            name: TensorInfo(name, shape, qtype, data_start + off) for name, shape, qtype, off in infos
        }

    # -- access -------------------------------------------------------------
    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path} has no general.architecture")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_key(self, key: str, default: Any = None) -> Any:
        """`<arch>.<key>` metadata, e.g. arch_key("block_count")."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def require(self, key: str) -> Any:
        full = f"{self.architecture}.{key}"
        if full not in self.metadata:
            raise GGUFError(f"{self.path} lacks metadata key {full!r}")
        return self.metadata[full]

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as uint8 [..., row_bytes]: the layout gguf.quants expects."""
        info = self.info(name)
        qtype = self._check_qtype(info)
        block, size = GGML_QUANT_SIZES[qtype]
        row = info.shape[-1]
        if row % block:
            raise GGUFError(f"tensor {name!r}: row length {row} is not a multiple of the {qtype.name} block {block}")
        byte_shape = (*info.shape[:-1], row // block * size)
        return np.frombuffer(self._buf, dtype=np.uint8, count=info.nbytes, offset=info.offset).reshape(byte_shape)

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise MissingTensorError(f"{self.path} has no tensor {name!r} ({self.architecture} needs it)")
        return self.tensors[name]

    def _check_qtype(self, info: TensorInfo) -> GGMLQuantizationType:
        if info.qtype not in [int(q) for q in SUPPORTED_QUANTS]:
            supported = ", ".join(q.name for q in SUPPORTED_QUANTS)
            raise UnsupportedQuantError(
                f"tensor {info.name!r} in {self.path} is stored as {info.type_name}; foldline dequantizes {supported}"
            )
        return GGMLQuantizationType(info.qtype)

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 in numpy order, e.g. [out, in] for a linear weight."""
        info = self.info(name)
        qtype = self._check_qtype(info)
        out = gguf_dequantize(self.raw(name), qtype)
        return np.array(out, dtype=np.float32, copy=True).reshape(info.shape)

    def close(self) -> None:
        try:
            self._buf.release()
            self._map.close()
        except BufferError:
            pass  # a caller still holds a view of raw bytes; the map closes when it is collected

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------


def _scalar_heads(g: GGUFFile, key: str) -> int:
    value = g.require(key)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise GGUFError(f"{g.path}: per-layer {g.architecture}.{key} {value} is not supported")
        value = value[0]
    return int(value)


def _eos_ids(g: GGUFFile, tokens: list[str] | None) -> tuple[int, ...]:
    """EOS plus end-of-turn: generation must stop on either (llama.cpp's end-of-generation set)."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        if (value := g.get(key)) is not None and int(value) not in ids:
            ids.append(int(value))
    if tokens is not None:
        for text in ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
            if text in tokens and tokens.index(text) not in ids:
                ids.append(tokens.index(text))
    return tuple(ids)


def _bos_id(g: GGUFFile) -> int | None:
    """The BOS id the runtime prepends, or None when the tokenizer adds none."""
    bos = g.get("tokenizer.ggml.bos_token_id")
    add = g.get("tokenizer.ggml.add_bos_token")
    if add is None:  # llama.cpp's default: SentencePiece vocabularies add BOS
        add = g.get("tokenizer.ggml.model") == "llama"
    return int(bos) if bos is not None and add else None


def _rope_scaling(g: GGUFFile) -> float:
    kind = g.arch_key("rope.scaling.type")
    factor = float(g.arch_key("rope.scaling.factor", 1.0) or 1.0)
    if kind in (None, "none") or factor == 1.0:
        return 1.0
    if kind != "linear":
        raise GGUFError(f"{g.path}: RoPE scaling {kind!r} is not supported (only linear)")
    return factor


def _common(g: GGUFFile, max_context: int | None) -> dict[str, Any]:
    arch = g.architecture
    hidden = int(g.require("embedding_length"))
    heads = _scalar_heads(g, "attention.head_count")
    kv_heads = _scalar_heads(g, "attention.head_count_kv") if g.arch_key("attention.head_count_kv") else heads
    head_dim = int(g.arch_key("attention.key_length", hidden // heads))
    value_dim = int(g.arch_key("attention.value_length", head_dim))
    if value_dim != head_dim:
        raise GGUFError(f"{g.path}: value head width {value_dim} != key head width {head_dim} is not supported")
    tokens = g.get("tokenizer.ggml.tokens")
    vocab = g.arch_key("vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:
        vocab = g.info("token_embd.weight").shape[0]
    trained_ctx = int(g.arch_key("context_length", 0) or 0)
    ctx = max_context if max_context is not None else DEFAULT_MAX_CONTEXT[arch]
    if trained_ctx:
        ctx = min(ctx, trained_ctx) if max_context is None else ctx
    name = g.get("general.name") or g.path.stem
    return dict(
        name=str(name),
        family=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(g.require("feed_forward_length")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        kv_mapping="blocked",
        rms_eps=float(g.require("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in g.tensors,
        attn_bias="blk.0.attn_q.bias" in g.tensors,
        max_context=int(ctx),
        dtype="float32",
        bos_token_id=_bos_id(g),
        eos_token_ids=_eos_ids(g, tokens),
        extra={"gguf": str(g.path), "trained_context": trained_ctx},
    )


def _llama_config(g: GGUFFile, max_context: int | None) -> ModelConfig:
    if "rope_freqs.weight" in g.tensors:
        raise GGUFError(f"{g.path}: per-frequency RoPE factors (rope_freqs.weight, Llama 3.1 scaling) are not supported")
    c = _common(g, max_context)
    layers = int(g.require("block_count"))
    base = float(g.arch_key("rope.freq_base", 10000.0))
    rot = int(g.arch_key("rope.dimension_count", c["head_dim"]))
    return ModelConfig(
        **c,
        layer_types=("global",) * layers,
        rope_theta_local=base,
        rope_theta_global=base,
        rotary_dim_local=rot,
        rotary_dim_global=rot,
        rope_scaling_factor_global=_rope_scaling(g),
        rope_interleaved=False,  # Q/K rows are un-permuted at load
        norm_placement="pre",
        mlp_activation="silu",
    )


def gemma3_layer_types(g: GGUFFile, layers: int) -> tuple[str, ...]:
    """Sliding-window schedule: an explicit per-layer list, a period N (every Nth global) or llama.cpp's 6."""
    pattern = g.arch_key("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise GGUFError(f"{g.path}: sliding_window_pattern has {len(pattern)} entries for {layers} layers")
        return tuple("local" if swa else "global" for swa in pattern)
    period = int(pattern)
    if period <= 0:
        raise GGUFError(f"{g.path}: sliding_window_pattern {period} must be positive")
    return tuple("global" if (i + 1) % period == 0 else "local" for i in range(layers))


def _gemma3_config(g: GGUFFile, max_context: int | None) -> ModelConfig:
    c = _common(g, max_context)
    layers = int(g.require("block_count"))
    hidden = c["hidden_size"]
    # query_pre_attn_scalar is not stored; llama.cpp derives it: hidden/heads for
    # the 62-layer 27B model, head_dim for every other size.
    scalar = hidden // c["num_heads"] if layers == 62 else c["head_dim"]
    softcap = g.arch_key("final_logit_softcapping")
    return ModelConfig(
        **c,
        layer_types=gemma3_layer_types(g, layers),
        sliding_window=int(g.require("attention.sliding_window")),
        attn_scale=float(scalar) ** -0.5,
        rope_theta_local=float(g.arch_key("rope.freq_base_swa", 10000.0)),
        rope_theta_global=float(g.arch_key("rope.freq_base", 1_000_000.0)),
        rope_scaling_factor_global=_rope_scaling(g),
        rope_interleaved=False,  # NEOX (half) rotation, as the file expects
        qk_norm=True,
        norm_placement="peri",
        norm_weight_offset=0.0,  # stored weights are already 1 + w
        mlp_activation="gelu_tanh",
        embed_scale=math.sqrt(hidden),
        embed_scale_dtype="float32",
        final_logit_softcap=float(softcap) if softcap else None,
    )


def _qwen35_config(g: GGUFFile, max_context: int | None) -> ModelConfig:
    from .gguf_qwen35 import qwen35_config

    return qwen35_config(g, max_context)


_CONFIG_BUILDERS = {"llama": _llama_config, "gemma3": _gemma3_config, "qwen35": _qwen35_config}


def config_from_file(g: GGUFFile, max_context: int | None = None) -> ModelConfig:
    arch = g.architecture
    if arch not in _CONFIG_BUILDERS:
        raise UnsupportedArchitectureError(
            f"{g.path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    try:
        return _CONFIG_BUILDERS[arch](g, max_context)
    except ConfigError as e:
        raise GGUFError(f"{g.path}: metadata describes an invalid model: {e}") from e


def read_gguf_config(path: str | Path, max_context: int | None = None) -> ModelConfig:
    """The ModelConfig a GGUF file describes; reads metadata only."""
    with GGUFFile(path) as g:
        return config_from_file(g, max_context)


# ---------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------

_LAYER_TENSORS = {
    "attn_norm.weight": "input_norm.weight",
    "attn_q.weight": "mixer.q_proj.weight",
    "attn_k.weight": "mixer.k_proj.weight",
    "attn_v.weight": "mixer.v_proj.weight",
    "attn_q.bias": "mixer.q_proj.bias",
    "attn_k.bias": "mixer.k_proj.bias",
    "attn_v.bias": "mixer.v_proj.bias",
    "attn_output.weight": "mixer.o_proj.weight",
    "attn_q_norm.weight": "mixer.q_norm.weight",
    "attn_k_norm.weight": "mixer.k_norm.weight",
    "post_attention_norm.weight": "post_mixer_norm.weight",
    "ffn_norm.weight": "mlp_norm.weight",
    "post_ffw_norm.weight": "post_mlp_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}


def tensor_name_map(cfg: ModelConfig) -> dict[str, str]:
    """module parameter name -> GGUF tensor name, for every parameter the config's module has."""
    if cfg.family == "qwen35":
        from .gguf_qwen35 import qwen35_tensor_name_map

        return qwen35_tensor_name_map(cfg)
    inverse_layer = {v: k for k, v in _LAYER_TENSORS.items()}
    inverse_global = {v: k for k, v in _GLOBAL_TENSORS.items()}
    with torch.device("meta"):
        from .model import CausalLM

        names = [n for n, _ in CausalLM(cfg).named_parameters()]
    out = {}
    for name in names:
        if name.startswith("layers."):
            _, idx, rest = name.split(".", 2)
            if rest not in inverse_layer:
                raise GGUFError(f"no GGUF tensor is known for parameter {name!r} of a {cfg.family} model")
            out[name] = f"blk.{idx}.{inverse_layer[rest]}"
        else:
            if name not in inverse_global:
                raise GGUFError(f"no GGUF tensor is known for parameter {name!r} of a {cfg.family} model")
            out[name] = inverse_global[name]
    return out


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (adjacent-pair RoPE -> HF half rotation)."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _iter_weights(g: GGUFFile, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    if cfg.family == "qwen35":
        from .gguf_qwen35 import iter_qwen35_weights

        yield from iter_qwen35_weights(g, cfg)
        return
    names = tensor_name_map(cfg)
    missing = [t for t in names.values() if t not in g.tensors]
    if missing:
        raise MissingTensorError(
            f"{g.path} lacks {len(missing)} tensor(s) a {cfg.family} model needs, first {missing[0]!r}"
        )
    used = set(names.values())
    unexpected = sorted(t for t in g.tensors if t not in used)
    if unexpected:
        raise GGUFError(f"{g.path}: tensor {unexpected[0]!r} has no place in a {cfg.family} model "
                        f"({len(unexpected)} unexpected)")
    for param, tname in names.items():
        w = g.dequantize(tname)
        if cfg.family == "llama" and tname.endswith(("attn_q.weight", "attn_q.bias")):
            w = unpermute_rope_rows(w, cfg.num_heads)
        elif cfg.family == "llama" and tname.endswith(("attn_k.weight", "attn_k.bias")):
            w = unpermute_rope_rows(w, cfg.num_kv_heads)
        yield param, w


def build_module(g: GGUFFile, cfg: ModelConfig):
    """The reference CausalLM with the file's weights, materialised one tensor at a time."""
    from .model import CausalLM

    with torch.device("meta"):
        model = CausalLM(cfg)
    expected = dict(model.named_parameters())
    state: dict[str, torch.Tensor] = {}
    for param, w in _iter_weights(g, cfg):
        shape = tuple(expected[param].shape)
        if w.shape != shape:
            raise GGUFError(
                f"{g.path}: tensor for {param!r} has shape {w.shape}, the config implies {shape}"
            )
        state[param] = torch.from_numpy(w)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def load_gguf(path: str | Path, max_context: int | None = None):
    """LoadedModel for a GGUF file: config, float32 module, tokenizer.json and chat template."""
    from .sources import LoadedModel
    from .tokenizer import tokenizer_json_from_gguf

    path = Path(path)
    with GGUFFile(path) as g:
        cfg = config_from_file(g, max_context)
        module = build_module(g, cfg)
        if any(key.startswith("prism.hadamard.") for key in g.metadata):
            # Weights stored Hadamard-rotated: wrap them so the module computes the unrotated model.
            from .hadamard import apply_hadamard_metadata

            apply_hadamard_metadata(module, g.metadata)
        tokenizer_json = tokenizer_json_from_gguf(g.metadata) if g.get("tokenizer.ggml.tokens") else None
        template = g.get("tokenizer.chat_template")
        if template is None and cfg.family == "gemma3":
            template = GEMMA_TURN_TEMPLATE
    return LoadedModel(cfg, module, tokenizer_json, template, source=f"gguf:{path.name}")

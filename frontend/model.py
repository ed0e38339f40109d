"""Reference torch modules for hybrid decoder-only models, built from a ModelConfig.

Written the reference way: every attention layer appends K/V to a full-length
cache (slot j holds position j) and local layers apply a window mask. Compact
storage (rings of W slots) is the job of the `ring-buffer-swa` pass.

One forward computes a chunk of C tokens at absolute positions
start_pos[b] + i, of which the first n_valid[b] are real; state tensors are
updated in place and logits are returned for the last valid position only.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..contract.entry_points import kv_tile_size
from ..contract.state import StateBuffer, state_buffers
from .attention_ops import CACHE_ATTENTION, KV_CACHE_WRITE
from .config import ModelConfig
from .gdn import GatedDeltaNet
from .layers import RMSNorm, rotary
from .types import TORCH_DTYPES, ChunkContext


class Attention(nn.Module):
    """Global or sliding-window attention with a full-length reference KV cache."""

    state_count = 2  # the K and V caches

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.cfg = cfg
        self.kind = cfg.layer_types[layer_idx]
        d, hq, hkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_out = hq * hd * (2 if cfg.attn_output_gate == "fused_q" else 1)
        self.q_proj = nn.Linear(d, q_out, bias=cfg.attn_bias)
        self.k_proj = nn.Linear(d, hkv * hd, bias=cfg.attn_bias)
        self.v_proj = nn.Linear(d, hkv * hd, bias=cfg.attn_bias)
        self.o_proj = nn.Linear(hq * hd, d, bias=False)
        if cfg.attn_output_gate == "separate":
            self.gate_proj = nn.Linear(d, hq * hd, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_eps, cfg.norm_weight_offset)
            self.k_norm = RMSNorm(hd, cfg.rms_eps, cfg.norm_weight_offset)
        if cfg.value_residual:
            self.value_lambda = nn.Parameter(torch.zeros(()))
        self.window = cfg.sliding_window if self.kind == "local" else 0

    def forward(self, h: Tensor, ctx: ChunkContext, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        cfg = self.cfg
        b, c, _ = h.shape
        hq, hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q = self.q_proj(h)
        gate = None
        if cfg.attn_output_gate == "fused_q":
            q, gate = q.view(b, c, hq, 2 * hd).chunk(2, dim=-1)
            gate = gate.reshape(b, c, hq * hd)
        elif cfg.attn_output_gate == "separate":
            gate = self.gate_proj(h)
        q = q.reshape(b, c, hq, hd).transpose(1, 2)
        k = self.k_proj(h).view(b, c, hkv, hd).transpose(1, 2)
        v_in = h
        if cfg.value_residual:
            a = torch.sigmoid(self.value_lambda)
            v_in = (1 - a) * ctx.embed + a * h
        v = self.v_proj(v_in).view(b, c, hkv, hd).transpose(1, 2)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        base, rot_dim, pos_scale = cfg.rope_for(self.kind)
        if base is not None:
            q = rotary(q, ctx.positions, base, rot_dim, pos_scale, cfg.rope_interleaved)
            k = rotary(k, ctx.positions, base, rot_dim, pos_scale, cfg.rope_interleaved)

        write = (ctx.start_pos, ctx.n_valid) if ctx.host_pos is None else (ctx.start_pos, ctx.n_valid, ctx.host_pos)
        new_k = KV_CACHE_WRITE(k_cache, k, *write)
        new_v = KV_CACHE_WRITE(v_cache, v, *write)
        k_cache.copy_(new_k)
        v_cache.copy_(new_v)
        attn = CACHE_ATTENTION(
            q, new_k, new_v, ctx.start_pos, self.window, cfg.softmax_scale, cfg.kv_mapping,
            k_cache.shape[2] if ctx.kv_length is None else ctx.kv_length,
        )
        attn = attn.transpose(1, 2).reshape(b, c, hq * hd)
        if gate is not None:
            if cfg.gate_fp32:
                attn = (attn.float() * torch.sigmoid(gate.float())).to(attn.dtype)
            else:
                attn = attn * torch.sigmoid(gate)
        return self.o_proj(attn)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        cfg = self.cfg
        g, u = self.gate_proj(x), self.up_proj(x)
        if cfg.mlp_gate_clip_max is not None:
            g = g.clamp(max=cfg.mlp_gate_clip_max)
        if cfg.mlp_up_clip is not None:
            u = u.clamp(-cfg.mlp_up_clip, cfg.mlp_up_clip)
        act = F.silu(g) if cfg.mlp_activation == "silu" else F.gelu(g, approximate="tanh")
        return self.down_proj(act * u)


def make_mixer(cfg: ModelConfig, layer_idx: int) -> nn.Module:
    kind = cfg.layer_types[layer_idx]
    if kind == "gdn":
        return GatedDeltaNet(cfg, layer_idx)
    return Attention(cfg, layer_idx)


class DecoderLayer(nn.Module):
    """Pre-norm (Llama, Qwen) or peri-norm (Ripple PeriNorm, Gemma sandwich) block."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.cfg = cfg
        self.kind = cfg.layer_types[layer_idx]
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_eps, cfg.norm_weight_offset)  # noqa: E731
        self.input_norm = norm()
        self.mixer = make_mixer(cfg, layer_idx)
        self.mlp_norm = norm()
        self.mlp = MLP(cfg)
        if cfg.norm_placement == "peri":
            self.post_mixer_norm = norm()
            self.post_mlp_norm = norm()

    def forward(self, x: Tensor, ctx: ChunkContext, state: list[Tensor]) -> Tensor:
        peri = self.cfg.norm_placement == "peri"
        out = self.mixer(self.input_norm(x), ctx, *state)
        x = x + (self.post_mixer_norm(out) if peri else out)
        out = self.mlp(self.mlp_norm(x))
        return x + (self.post_mlp_norm(out) if peri else out)


def scale_embedding(x: Tensor, cfg: ModelConfig) -> Tensor:
    """Embedded rows times the config's embedding scale (Gemma's sqrt(hidden)), rounded to the dtype the
    checkpoint's reference rounds it to first where it names one."""
    if cfg.embed_scale == 1.0:
        return x
    if cfg.embed_scale_dtype is not None:
        scale = torch.tensor(cfg.embed_scale, dtype=TORCH_DTYPES[cfg.embed_scale_dtype])
        return x * scale.to(x.dtype)
    return x * cfg.embed_scale


class CausalLM(nn.Module):
    """The whole model; `forward` processes one chunk and updates `state` in place."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, cfg.norm_weight_offset)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def state_specs(self, batch: int) -> list[StateBuffer]:
        return state_specs(self.cfg, batch)

    def embed(self, tokens: Tensor) -> Tensor:
        return scale_embedding(self.embed_tokens(tokens), self.cfg)

    def head(self, h: Tensor) -> Tensor:
        weight = self.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight
        logits = F.linear(h, weight)
        if self.cfg.final_logit_softcap is not None:
            cap = self.cfg.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def forward(
        self, tokens: Tensor, start_pos: Tensor, n_valid: Tensor, *state: Tensor, host_pos: int | None = None,
        kv_tiles: int | None = None, all_logits: bool = False,
    ) -> Tensor:
        """`host_pos`: start_pos[0] as a host integer, for a chunk of one real token (decode).
        `kv_tiles`: attention over full caches reads only their first kv_tiles tiles (prefill).
        `all_logits`: logits [B, C, V] of every position, as ONNX Runtime GenAI reads them, instead of
        [B, V] of each row's last valid one.

        Both may be symbolic in an exported program: the attention then reads a
        length known only when the entry point is called.
        """
        b, c = tokens.shape
        x = self.embed(tokens)
        positions = start_pos[:, None] + torch.arange(c, dtype=start_pos.dtype)
        tile = kv_tile_size(self.cfg.max_context)
        if kv_tiles is not None:
            kv_length = kv_tiles * tile
        elif host_pos is not None:
            kv_length = (host_pos // tile + 1) * tile  # the tiles up to and including the token's slot
        else:
            kv_length = None
        ctx = ChunkContext(start_pos=start_pos, n_valid=n_valid, positions=positions, embed=x, host_pos=host_pos,
                           kv_length=kv_length)
        start = 0
        for layer in self.layers:
            count = layer.mixer.state_count
            x = layer(x, ctx, list(state[start : start + count]))
            start += count
        if all_logits:
            return self.head(self.norm(x)).float()
        # Logits only for the last valid position of each row.
        last = (n_valid - 1).clamp(min=0)
        x = torch.gather(x, 1, last[:, None, None].expand(b, 1, x.shape[-1]))[:, 0]
        return self.head(self.norm(x)).float()


def state_specs(cfg: ModelConfig, batch: int) -> list[StateBuffer]:
    """Two buffers per layer, in layer order; the reference form keeps full-length caches (contract/state.py)."""
    return state_buffers(cfg.to_dict(), batch)


def init_random(model: CausalLM, seed: int = 0, std: float = 0.08) -> CausalLM:
    """Seeded random weights for tiny presets (norm weights jittered around their identity)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 - getattr_offset(model, name)))
            elif name.endswith("value_lambda"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / math.sqrt(p.shape[1])) * 4)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


def layer_index(model: CausalLM, layer: nn.Module) -> int:
    return next(i for i, candidate in enumerate(model.layers) if candidate is layer)


def getattr_offset(model: CausalLM, param_name: str) -> float:
    module = model.get_submodule(param_name.rsplit(".", 1)[0])
    return getattr(module, "offset", 0.0)


def build_model(cfg: ModelConfig, seed: int | None = 0) -> CausalLM:
    """Build a model in the config's dtype; seeded random weights unless seed is None."""
    model = CausalLM(cfg)
    if seed is not None:
        init_random(model, seed)
        for layer in model.layers:
            if hasattr(layer.mixer, "init_random"):  # mixers with their own parameter ranges (GDN)
                layer.mixer.init_random(seed + layer_index(model, layer))
    return model.to(TORCH_DTYPES[cfg.dtype]).eval()


def new_state(cfg: ModelConfig, batch: int, specs: list[StateBuffer] | None = None) -> list[Tensor]:
    specs = specs if specs is not None else state_specs(cfg, batch)
    return [torch.zeros(s.shape, dtype=TORCH_DTYPES[s.dtype]) for s in specs]


# torch.nn.init's in-place initialisers, which a skeleton has no use for.
_INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "kaiming_uniform_",
                 "kaiming_normal_", "xavier_uniform_", "xavier_normal_")


@contextmanager
def no_initialisers() -> Iterator[None]:
    saved = {name: getattr(nn.init, name) for name in _INITIALISERS}
    for name in _INITIALISERS:
        setattr(nn.init, name, lambda tensor, *_args, **_kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def skeleton(cfg: ModelConfig) -> CausalLM:
    """The config's module on the meta device, its initialisers skipped: names and shapes, no data.

    A loader then assigns every weight. nn.Linear's initialiser on meta tensors computes
    nothing and took most of the build's time (docs/benchmarks.md, "Compile time").
    """
    with torch.device("meta"), no_initialisers():
        return CausalLM(cfg)


def parameter_names(cfg: ModelConfig) -> list[str]:
    """Every parameter name of the config's module, without allocating weights."""
    return [name for name, _ in skeleton(cfg).named_parameters()]

"""ring-buffer-swa: sliding-window layers keep W cache slots instead of max_context.

The reference modules write every K/V into a full-length cache (slot j holds
position j) and mask the read to the window. A mask is not eviction: the cache
still grows with the context. This pass rewrites each site

    k' = kv_cache_write(k_cache, k, start_pos, n_valid)      (same for v)
    k_cache <- k'                                             (state mutation)
    o  = cache_attention(q, k', v', start_pos, W, scale, map, L)   with W > 0

into

    o  = ring_attention(q, k_ring, v_ring, k, v, start_pos, n_valid, W, scale, map)
    k_ring <- ring_write(k_ring, k, start_pos, n_valid)

where k_ring is the same state argument re-typed to [B, Hkv, W, D]; slot s holds
the newest position p with p % W == s. The attention reads the ring as it was
before this chunk's write plus the chunk's own K/V, with a mask built from
absolute positions, so it is exact for chunks longer than W, across wrap-around,
for padded chunks and for batch rows at different positions.

A site whose chunk is one token (the decode entry points, which always pass
n_valid = 1) takes a form that reads only the written ring:

    k_ring' = ring_write_token(k_ring, k, start_pos, n_valid)      (same for v)
    o = ring_decode_attention(q, k_ring', v_ring', start_pos, W, scale, map)

After the token's write the ring holds exactly its window, so nothing but the
update reads the old ring, and IREE writes the one slot in place instead of
copying the ring into the attention's keys and again to protect that read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.export import ExportedProgram
from torch.fx import Graph, Node

from ..contract.state import SEQ_DIM, ring_buffer, ring_slots
from ..frontend.attention_ops import (
    CACHE_ATTENTION,
    KV_CACHE_WRITE,
    RING_ATTENTION,
    RING_DECODE_ATTENTION,
    RING_WRITE,
    RING_WRITE_TOKEN,
)
from .graph_edit import (
    copy_graph_module,
    placeholders,
    rebuild,
    refresh_fake_meta,
    state_placeholder_names,
)
from .registry import CompileUnit, PassResult, register_pass

NAME = "ring-buffer-swa"

COPY = torch.ops.aten.copy.default


@dataclass
class Site:
    """One sliding-window attention written the reference way."""

    attention: Node
    k_write: Node
    v_write: Node
    k_state: int  # index into the state list
    v_state: int
    window: int


def _match(node: Node, state_index: dict[str, int], length_of: dict[str, int]) -> tuple[Site | None, str]:
    """Match one cache_attention node; returns (site, why-not)."""
    q, k_w, v_w, start_pos, window, _scale, _mapping, _length = node.args
    if not isinstance(window, int) or window <= 0:
        return None, ""
    for w in (k_w, v_w):
        if not (isinstance(w, Node) and w.op == "call_function" and w.target == KV_CACHE_WRITE):
            return None, f"{node.name}: K/V do not come from kv_cache_write"
        cache = w.args[0]
        if not (isinstance(cache, Node) and cache.name in state_index):
            return None, f"{node.name}: the cache written by {w.name} is not a state argument"
        if w.args[2] is not start_pos:
            return None, f"{node.name}: write and read use different start positions"
        others = [u for u in w.users if u is not node]
        if any(not (u.target == COPY and u.args[0] is cache) for u in others):
            return None, f"{node.name}: the full cache {cache.name} has readers besides this attention"
    if k_w.args[3] is not v_w.args[3]:
        return None, f"{node.name}: K and V writes use different valid counts"
    if ring_slots(window, length_of[k_w.args[0].name]) is None:
        return None, f"{node.name}: window {window} is not smaller than the cache; kept the full cache"
    k_idx, v_idx = state_index[k_w.args[0].name], state_index[v_w.args[0].name]
    return Site(node, k_w, v_w, k_idx, v_idx, window), ""


def find_sites(graph: Graph, state_names: list[str]) -> tuple[list[Site], list[str]]:
    """Every rewritable site in `graph`, plus a note for each sliding-window site that is not."""
    state_index = {name: i for i, name in enumerate(state_names)}
    length_of = {
        n.name: n.meta["val"].shape[SEQ_DIM] for n in graph.nodes if n.op == "placeholder" and n.name in state_index
    }
    sites, notes = [], []
    seen: set[int] = set()
    for node in graph.nodes:
        if node.op == "call_function" and node.target == CACHE_ATTENTION:
            site, why = _match(node, state_index, length_of)
            if why:
                notes.append(why)
            if site is None:
                continue
            if {site.k_state, site.v_state} & seen:
                notes.append(f"{node.name}: its state buffers are shared with another site; left alone")
                continue
            seen |= {site.k_state, site.v_state}
            sites.append(site)
    return sites, notes


def _rewrite(program: ExportedProgram, windows: dict[int, int], n_state: int) -> tuple[ExportedProgram, int]:
    """Rewrite the sites whose state indices are in `windows`; returns the new program and site count."""
    gm = copy_graph_module(program)
    names = state_placeholder_names(program, n_state)
    sites, _ = find_sites(gm.graph, names)
    done = 0
    for site in sites:
        if site.k_state not in windows or site.v_state not in windows:
            continue
        attn = site.attention
        q, _k, _v, start_pos, window, scale, mapping, length = attn.args
        k_state, k_new, _, n_valid = site.k_write.args[:4]
        v_state, v_new = site.v_write.args[:2]
        one_token = q.meta["val"].shape[2] == 1  # attend over the written ring (module docstring)
        site.k_write.target = site.v_write.target = RING_WRITE_TOKEN if one_token else RING_WRITE
        if one_token:
            attn.target = RING_DECODE_ATTENTION
            attn.args = (q, site.k_write, site.v_write, start_pos, window, scale, mapping)
            done += 1
            continue
        with gm.graph.inserting_before(attn):
            ring = gm.graph.call_function(
                RING_ATTENTION, (q, k_state, v_state, k_new, v_new, start_pos, n_valid, window, scale, mapping,
                            *_held_length(length))
            )
        ring.meta = dict(attn.meta)
        attn.replace_all_uses_with(ring)
        gm.graph.erase_node(attn)
        # Program order: every read of the old ring comes before its write. The
        # functional graph does not need this, but the compiled module updates the
        # caller's buffer in place and must not overwrite slots still to be read.
        anchor = ring
        for write in (site.k_write, site.v_write):
            for node in [write, *[u for u in write.users if u.target == COPY]]:
                anchor.append(node)
                anchor = node
        done += 1

    # Re-type the ring state arguments and propagate the new shapes to every node.
    ph = placeholders(gm)
    new_state: dict[int, torch.Tensor] = {}
    for idx, window in windows.items():
        val = ph[names[idx]].meta["val"]
        shape = list(val.shape)
        shape[SEQ_DIM] = window
        new_state[idx] = torch.zeros(shape, dtype=val.dtype, device=val.device)
    refresh_fake_meta(gm, {names[i]: t for i, t in new_state.items()})
    example = program.example_inputs
    if example is not None:
        args, kwargs = example
        args = list(args)
        first_state = len(args) - n_state
        for idx, t in new_state.items():
            args[first_state + idx] = t
        example = (tuple(args), kwargs)
    return rebuild(program, gm, example_inputs=example), done


def _held_length(length) -> tuple:
    """The ring attention's `length` argument: the prefill's symbolic tile length (the ring then reads
    its slots up to it), none for a static one (the cache's whole length, or a decode's)."""
    return (length,) if isinstance(length, Node) else ()


@register_pass(NAME, "sliding-window layers keep a ring of W K/V slots instead of a full-length cache")
def ring_buffer_swa(unit: CompileUnit) -> PassResult:
    n_state = len(unit.state_specs)
    notes: list[str] = []
    per_program: dict[str, dict[int, int]] = {}
    for name, program in unit.programs.items():
        sites, why = find_sites(program.graph, state_placeholder_names(program, n_state))
        notes.extend(f"{name}: {w}" for w in why)
        windows: dict[int, int] = {}
        for s in sites:
            windows[s.k_state] = s.window
            windows[s.v_state] = s.window
        per_program[name] = windows
    if not per_program:
        return PassResult(changed=False, notes=notes)
    # A buffer changes layout only if every entry point agrees: the runtime owns one buffer.
    agreed = dict(next(iter(per_program.values())))
    for windows in per_program.values():
        agreed = {i: w for i, w in agreed.items() if windows.get(i) == w}
    for name, windows in per_program.items():
        skipped = sorted(set(windows) - set(agreed))
        if skipped:
            notes.append(f"{name}: state {skipped} not rewritten: entry points disagree on the layout")
    if not agreed:
        return PassResult(changed=False, notes=notes)

    sites = 0
    for name, program in list(unit.programs.items()):
        unit.programs[name], count = _rewrite(program, agreed, n_state)
        sites += count
    before = sum(s.nbytes for s in unit.state_specs)
    unit.state_specs = [ring_buffer(s, agreed[i]) if i in agreed else s for i, s in enumerate(unit.state_specs)]
    saved = before - sum(s.nbytes for s in unit.state_specs)
    layers = sorted({layer for i in agreed for layer in unit.state_specs[i].layers})
    return PassResult(
        changed=True,
        sites=sites,
        bytes_saved=saved,
        notes=notes + [f"layers {layers} hold rings of {sorted(set(agreed.values()))} slots"],
        details={"ring_state": sorted(agreed), "layers": layers},
    )

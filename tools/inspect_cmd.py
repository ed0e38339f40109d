"""foldline inspect BUNDLE: what a bundle holds, from its manifest."""

from __future__ import annotations

import json


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="describe a compiled bundle (model, state buffers, modules, passes)")
    p.add_argument("bundle", help="bundle directory")
    p.add_argument("--json", action="store_true", help="print the raw manifest (default: a summary)")
    p.set_defaults(func=run)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _cpu_choice(m) -> str:
    """Which CPU module this machine would load, or why none (runtime/cpu_select.py)."""
    from ..contract.errors import BundleError
    from ..runtime.cpu_select import select_cpu_module
    from ..runtime.device import check_host_compatible, cpu_features, host_arch

    try:
        have = cpu_features()
        key = select_cpu_module(m, have, host_arch())
        check_host_compatible(m.modules[key], "cpu", have)
    except BundleError as e:
        return f"none: {e}"
    return f"{key} ({m.modules[key].file})"


def run(args) -> int:
    from ..contract.isa import ARCH_ISA_FLAGS
    from ..contract.manifest import Manifest
    from ..runtime.cpu_select import isa_level

    m = Manifest.load(args.bundle)
    if args.json:
        print(json.dumps(m.to_json(), indent=2))
        return 0
    cfg = m.config
    kinds = {k: cfg["layer_types"].count(k) for k in ("local", "global", "gdn") if k in cfg["layer_types"]}
    print(f"bundle   {m.root}")
    print(f"model    {cfg['name']} ({cfg['family']}), {len(cfg['layer_types'])} layers {kinds}, "
          f"vocab {cfg['vocab_size']}, hidden {cfg['hidden_size']}, dtype {cfg['dtype']}")
    rows = f" (entry points for {', '.join(map(str, m.row_counts))} rows)" if m.batch > 1 else ""
    print(f"shapes   batch {m.batch}{rows}, prefill chunk {m.prefill_chunk}, max context {m.max_context}")
    print(f"attention reads the tokens held, in tiles of {m.kv_tile} slots (prefill's kv_tiles input)")
    params = m.params
    if params:
        print(f"params   {params.file}: {params.count} tensors, {_mib(params.size or 0)}")
    for j, archive in enumerate(m.placement.params if m.placement else [], start=1):
        print(f"         {archive.file} (device {j}, scope {archive.scope}): {archive.count} tensors, "
              f"{_mib(archive.size or 0)}")
    for key, mod in m.modules.items():
        acts = f", {mod.activations} activations in quantized decode" if mod.activations else ""
        isa = mod.kernel_isa
        if isa:
            acts += f" (kernels: decode {isa['decode']}, prefill {isa['prefill']})"
        level = f", ISA {isa_level(mod)}" if m.device_of(key) == "cpu" and mod.arch in ARCH_ISA_FLAGS else ""
        print(f"module   {key}: {mod.file} ({_mib(mod.size or 0)}) {mod.description}{level}{acts}")
        if mod.parts:
            print("         graphs: " + ", ".join(f"{fn} {part.file} ({_mib(part.size or 0)})" for fn, part in mod.parts.items()))
        if mod.window_order:
            print(f"         windowed caches held in {mod.window_order!r} order, not as rings "
                  "(session files of the other order are refused)")
        for provider, ops in (mod.provider_gaps or {}).items():
            print(f"         under {provider}: " + (f"{sum(ops.values())} nodes have no {provider} kernel and run on the "
                  "next provider: " + ", ".join(f"{n} {op}" for op, n in ops.items()) if ops
                  else "every node has a kernel"))
        if mod.kernels:
            print("         sites: " + ", ".join(f"{n} {kind}" for kind, n in mod.kernels.items()))
    if "cpu" in m.devices():
        print(f"this CPU loads {_cpu_choice(m)}")
    print(f"tokenizer {m.tokenizer.file if m.tokenizer else 'none (token ids only)'}")
    print(f"passes   {', '.join(name + ('*' if changed else '') for name, changed in m.pass_names()) or 'none'}"
          "   (* changed the program)")
    if m.placement:
        place = m.placement
        if place.scheme == "tensor":
            runs = "every layer's heads and MLP features in parts, " + ", ".join(
                f"device {j} state {_mib(place.state_bytes(m.state, j))}" for j in range(place.devices))
        else:
            runs = ", ".join(f"device {j} layers {first}-{last} (state {_mib(place.state_bytes(m.state, j))})"
                             for j, (first, last) in enumerate(place.layers))
        print(f"devices  {place.devices} CPU devices, {place.scheme}: {runs}; logits on device {place.result}")
    print(f"state    {len(m.state)} buffers, {_mib(sum(s.nbytes for s in m.state))}")
    for i, s in enumerate(m.state):
        where = f"  device {m.state_device(i)}" if m.placement else ""
        print(f"  {s.name:<16} {s.kind:<14} {str(list(s.shape)):<22} {s.dtype:<8} {_mib(s.nbytes)}{where}")
    return 0


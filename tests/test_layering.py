"""The package's import graph: no cycles, and no import against the stage order.

Every import counts, at module level or inside a function: a lazy import that
dodges a cycle at run time is still a cycle in the design.

Stage order: tools -> backends -> kernels -> passes -> frontend -> contract (`contract`
is the bundle's contract, numpy only, shared by compiler and runtime; `kernels` holds the
hand-written kernels and the rewrites that put them into the imported MLIR). `runtime` stands apart
(an edge app installs it without the compiler), so it imports no compiler
stage; `server` (the HTTP front of `foldline serve`) builds on the runtime
alone; `bench` (`foldline bench`: engines, peers, modes, tables) runs the
runtime and, for the torch reference, the frontend and the parity runner, and
only the CLI imports it; `testing` (golden harness, parity runner) may use
any stage, and no product stage imports it except the CLI and the bench.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("contract", "frontend", "passes", "kernels", "backends", "runtime", "server", "bench", "tools", "testing")

# stage -> stages it must never import
FORBIDDEN = {
    "contract": {"frontend", "passes", "kernels", "backends", "runtime", "server", "bench", "tools", "testing"},
    "runtime": {"frontend", "passes", "kernels", "backends", "server", "bench", "tools", "testing"},
    "server": {"frontend", "passes", "kernels", "backends", "bench", "tools", "testing"},
    "bench": {"passes", "kernels", "backends", "server", "tools"},
    "frontend": {"passes", "kernels", "backends", "bench", "tools", "testing"},
    "passes": {"kernels", "backends", "bench", "tools", "testing"},
    "kernels": {"backends", "bench", "tools", "testing"},
    "backends": {"bench", "tools", "testing"},
}


def module_sources(root: Path = ROOT) -> dict[str, str]:
    """foldline module name -> source text, for every module of the stage packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(["foldline", *parts])] = path.read_text()
    return out


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """module -> the foldline modules it imports (resolved to the longest existing module name)."""
    graph: dict[str, set[str]] = {m: set() for m in sources}
    for module, text in sources.items():
        is_package = any(other.startswith(module + ".") for other in sources)
        package = module if is_package else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(text)):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    full = ".".join(base + ([node.module] if node.module else []))
                else:
                    full = node.module or ""
                targets = [full] + [f"{full}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            for target in targets:
                while target and target not in sources:
                    target = target.rsplit(".", 1)[0] if "." in target else ""
                if target and target != module:
                    graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def stage_of(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def against_stage_order(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{src} imports {dst}"
        for src, dsts in graph.items()
        for dst in dsts
        if stage_of(dst) in FORBIDDEN.get(stage_of(src), set())
    )


def test_the_package_has_no_import_cycle():
    graph = import_graph(module_sources())
    assert len(graph) > 40  # every stage was read
    assert cycles(graph) == []


def test_no_import_goes_against_the_stage_order():
    assert against_stage_order(import_graph(module_sources())) == []


def test_a_lazy_import_cycle_is_caught():
    """The cycles this layout removed (e.g. gdn <-> model through a function-level import) fail the check."""
    sources = module_sources()
    sources["foldline.frontend.gdn"] += "\n\ndef _late():\n    from .model import CausalLM\n    return CausalLM\n"
    assert ["foldline.frontend.gdn", "foldline.frontend.model"] in cycles(import_graph(sources))


def test_an_import_against_the_order_is_caught():
    sources = module_sources()
    sources["foldline.frontend.model"] += "\n\ndef _late():\n    from ..passes.manager import run_pipeline\n"
    sources["foldline.runtime.model"] += "\nimport foldline.frontend.config\n"
    assert against_stage_order(import_graph(sources)) == [
        "foldline.frontend.model imports foldline.passes.manager",
        "foldline.runtime.model imports foldline.frontend.config",
    ]



# ---- backends: the IREE side and the ONNX side stand apart -------------------------------------------

# backends/ is the compile's driver (build, policy, bundle_files) over two sides: backends/iree/ (MLIR import,
# the edits of the imported module, iree-compile's pool) and backends/onnx/ (the ONNX export and its ONNX
# Runtime operators). Neither side imports the other, and what both use (lowering, targets, options, the
# cache, the stage clock) imports neither side: only the driver picks one.
BACKEND_SIDES = ("foldline.backends.iree", "foldline.backends.onnx")
BACKEND_DRIVER = {"foldline.backends.build", "foldline.backends.policy", "foldline.backends.bundle_files"}


def _backend_side(module: str) -> str | None:
    return next((s for s in BACKEND_SIDES if module == s or module.startswith(s + ".")), None)


def backend_sides_crossed(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a backend side from the other side or from a shared backends module (the driver may)."""
    found = []
    for src, dsts in graph.items():
        if not src.startswith("foldline.backends.") or src in BACKEND_DRIVER:
            continue
        side = _backend_side(src)
        found += [f"{src} imports {dst}" for dst in dsts if _backend_side(dst) not in (None, side)]
    return sorted(found)


def test_the_iree_and_onnx_backends_never_import_each_other():
    sources = module_sources()
    assert {f"{s}.{m}" for s, m in zip(BACKEND_SIDES, ("importer", "export"))} <= set(sources)
    assert backend_sides_crossed(import_graph(sources)) == []


def test_a_backend_import_across_the_sides_is_caught():
    sources = module_sources()
    sources["foldline.backends.iree.importer"] += "\n\ndef _late():\n    from ..onnx.gqa import local_window\n"
    sources["foldline.backends.onnx.export"] += "\nfrom ..iree.fused_attention import SITE_NAME\n"
    sources["foldline.backends.lowering"] += "\nfrom .iree.input_ir import module_text\n"
    sources["foldline.backends.build"] += "\nfrom .onnx.norms import fuse_rms_norms\n"  # the driver may
    assert backend_sides_crossed(import_graph(sources)) == [
        "foldline.backends.iree.importer imports foldline.backends.onnx.gqa",
        "foldline.backends.lowering imports foldline.backends.iree.input_ir",
        "foldline.backends.onnx.export imports foldline.backends.iree.fused_attention",
    ]

# ---- the manifest's fields are named in contract/ only -----------------------------------------------

# Keys every JSON document uses (a device's "name", a config's "dtype", an API's "model"): outside
# contract/ they name other documents' fields. A manifest is typed (contract/manifest.py), so code
# reads these as attributes; the distinct field names below catch a manifest indexed as a dict.
GENERIC_KEYS = {"name", "model", "cpu", "device", "dtype", "file", "size", "shape", "kind", "count", "source",
                "description", "flags", "format", "state", "batch", "params", "passes", "tokenizer", "sha256",
                "layers", "scope", "modules", "versions", "arch"}
# (module, key): another document's field that shares a name with one of the manifest's.
OTHER_DOCUMENTS = {
    ("foldline.frontend.hf_loader", "chat_template"): "HF tokenizer_config.json",
    ("foldline.backends.onnx.genai", "chat_template"): "the tokenizer_config.json beside a GenAI model",
    ("foldline.runtime.session_file", "format_version"): "the session file's header",
    ("foldline.runtime.session_file", "params_sha256"): "the session file's header (the bundle it belongs to)",
    ("foldline.runtime.session_file", "window_order"): "the session file's header (the module that saved it)",
}


def _keys(tree: ast.AST) -> Iterator[ast.Constant]:
    """String constants used as a mapping key: x["k"], x.get("k"), x.pop("k"), {"k": ...}."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            yield node.slice
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("get", "pop", "setdefault") and node.args and isinstance(node.args[0], ast.Constant)):
            yield node.args[0]
        elif isinstance(node, ast.Dict):
            yield from (k for k in node.keys if isinstance(k, ast.Constant))


def manifest_fields_named_outside_contract(sources: dict[str, str]) -> list[str]:
    from foldline.contract.manifest import MODULE_FIELDS, PARAMS_FIELDS, STATE_FIELDS, TOP_FIELDS

    fields = {*TOP_FIELDS, *STATE_FIELDS, *PARAMS_FIELDS, *MODULE_FIELDS} - GENERIC_KEYS
    return sorted(
        f"{module}:{key.lineno} names {key.value!r}"
        for module, text in sources.items()
        if not module.startswith("foldline.contract")
        for key in _keys(ast.parse(text))
        if key.value in fields and (module, key.value) not in OTHER_DOCUMENTS
    )


def test_only_the_contract_names_the_manifests_fields():
    from foldline.contract.manifest import Manifest

    assert not hasattr(Manifest, "data")  # no untyped view of the file
    assert manifest_fields_named_outside_contract(module_sources()) == []


def test_a_manifest_field_named_outside_the_contract_is_caught():
    sources = module_sources()
    sources["foldline.runtime.batch"] += "\n\ndef _chunk(m):\n    return m.to_json()['prefill_chunk']\n"
    sources["foldline.tools.inspect_cmd"] += "\n\ndef _isa(entry):\n    return entry.get('kernel_isa')\n"
    found = manifest_fields_named_outside_contract(sources)
    assert len(found) == 2 and "'prefill_chunk'" in found[0] + found[1] and "'kernel_isa'" in found[0] + found[1]


# ---- MLIR is edited through the bindings, not its printed text ---------------------------------------

# The modules that edit IREE's MLIR between the compile steps or before them: they hold the module as IR
# (iree.compiler.ir), so nothing of theirs depends on how the printer lays it out.
MLIR_EDITORS = {"foldline.backends.iree.inplace_state", "foldline.backends.iree.abi_declaration",
                "foldline.backends.iree.multi_device", "foldline.backends.iree.input_ir"}
_TEXT_EDITS = {"sub", "subn", "compile"}


def text_edits_of_mlir(sources: dict[str, str]) -> list[str]:
    """In backends/: every `re.sub`/`re.subn`/`re.compile` and `str(...).replace`; in the MLIR editors also
    any `import re` and any `.replace(` call."""
    found = []
    for module, text in sources.items():
        if not module.startswith("foldline.backends."):
            continue
        editor = module in MLIR_EDITORS
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module == "re":
                found.append(f"{module}:{node.lineno} imports from re")
            elif editor and isinstance(node, ast.Import) and any(a.name == "re" for a in node.names):
                found.append(f"{module}:{node.lineno} imports re")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                receiver, name = node.func.value, node.func.attr
                if isinstance(receiver, ast.Name) and receiver.id == "re" and name in _TEXT_EDITS:
                    found.append(f"{module}:{node.lineno} calls re.{name}")
                elif name == "replace" and (editor or isinstance(receiver, ast.Call) and isinstance(
                        receiver.func, ast.Name) and receiver.func.id == "str"):
                    found.append(f"{module}:{node.lineno} calls .replace")
    return sorted(found)


def test_backends_edit_mlir_through_the_bindings_not_its_text():
    sources = module_sources()
    assert MLIR_EDITORS <= set(sources)
    assert text_edits_of_mlir(sources) == []


def test_a_text_edit_of_mlir_is_caught():
    sources = module_sources()
    sources["foldline.backends.iree.inplace_state"] += "\n\nimport re\n\ndef _f(t):\n    return re.sub('a', 'b', t)\n"
    sources["foldline.backends.iree.abi_declaration"] += "\n\ndef _g(t):\n    return t.replace('a', 'b')\n"
    sources["foldline.backends.targets"] += "\n\ndef _h(a):\n    return str(a).replace('<', '(')\n"
    sources["foldline.backends.build"] += "\n\ndef _i(t):\n    return t.replace(dtype='f16')\n"  # not text
    assert sorted(f.split(":")[0] + " " + f.split(" ", 1)[1] for f in text_edits_of_mlir(sources)) == [
        "foldline.backends.iree.abi_declaration calls .replace",
        "foldline.backends.iree.inplace_state calls re.sub",
        "foldline.backends.iree.inplace_state imports re",
        "foldline.backends.targets calls .replace",
    ]


def test_every_subpackage_is_in_the_wheel():
    """pyproject.toml lists the packages (the repository root is `foldline`): a folder with an
    __init__.py missing from that list is left out of the wheel, which only an install would show."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for init in root.rglob("__init__.py"):
        rel = init.parent.relative_to(root)
        if rel.parts and (rel.parts[0].startswith(".") or rel.parts[0] in {"tests", "scripts", "build"}):
            continue
        found.add(".".join(("foldline", *rel.parts)))
    assert found - listed == set(), "add these to [tool.setuptools] packages"
    assert listed - found == set(), "these listed packages do not exist"

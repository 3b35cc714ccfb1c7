"""The import graph of dflow_trt, read with `ast` (nothing is imported): no cycle among modules at
import time, and a layering with no upward import, at module level or inside a function.

Layers, lowest first; a module may import its own layer and any below (a module belongs to the
longest entry that names it or a package above it):

    0  errors
    1  atomic, flags, prompting, evalsets leaf helpers (`flags`: the CLI's shared argument checks)
    2  decoding                           the loop, its interfaces, acceptance and sampling
    3  kernels                            the torch CPU kernels targets and drafters run on
    4  targets
    5  drafter
    6  backends                           runtimes over exported graphs (`onnx_io`: the graphs' contract)
    7  training
    8  export                             ONNX, FP8, TensorRT-LLM artefacts (FP8 calibrates on training's prompts)
    9  loading                            the one loader: each mode's (target, drafter) on a back end
   10  serving
   11  cli, export.cli, benchmarks, demo  entry points (`export/cli.py` is the CLI's build commands)

So `decoding/` imports nothing above it, and decoding, targets, drafter and backends never import
`export` (ALLOWED is empty). A new module must fall in a layer; a new upward import fails
unless added to ALLOWED with its reason; an entry no longer needed fails too, so the list stays true.
"""

import ast
from collections import defaultdict
from pathlib import Path

PKG = "dflow_trt"
ROOT = Path(__file__).resolve().parents[1] / PKG

LAYERS = [
    ("errors",),
    ("atomic", "flags", "prompting", "evalsets"),
    ("decoding",),
    ("kernels",),
    ("targets",),
    ("drafter",),
    ("backends",),
    ("training",),
    ("export",),
    ("loading",),
    ("serving",),
    ("cli", "export.cli", "benchmarks", "demo"),
]

# (importer, imported): why this upward import stands
ALLOWED: dict = {}

# function-level imports that exist only because the import at module level would close a cycle
LAZY_FOR_CYCLE: dict = {}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports() -> list[tuple[str, str, bool, int]]:
    """Every internal import: (importer, imported module, inside a function, line). `from X import y`
    names module X.y where that is a module, else X."""
    mods = _modules()
    out = []
    for mod, path in mods.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]

        def add(name, node, in_function):
            if name == PKG or name.startswith(PKG + "."):
                out.append((mod, name, in_function, node.lineno))

        def visit(node, in_function):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.Import):
                    for a in child.names:
                        add(a.name, child, in_function)
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        base = ".".join(package[: len(package) - child.level + 1] + ([base] if base else []))
                    for a in child.names:
                        add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base, child, in_function)
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        visit(ast.parse(path.read_text(), str(path)), False)
    return out


def _short(name: str) -> str:
    return name[len(PKG) + 1:]


def layer(mod: str) -> int | None:
    name = _short(mod)
    best = None
    for i, entries in enumerate(LAYERS):
        for e in entries:
            if (name == e or name.startswith(e + ".")) and (best is None or len(e) > len(best[1])):
                best = (i, e)
    return None if best is None else best[0]


def module_graph() -> dict[str, set[str]]:
    """What importing each module runs at once: its module-level imports, each with the packages
    above the imported module that Python runs first (except the importer's own packages)."""
    mods = _modules()
    graph = defaultdict(set)
    for a, b, in_function, _ in imports():
        if in_function:
            continue
        parts = b.split(".")
        for i in range(2, len(parts) + 1):
            target = ".".join(parts[:i])
            if target in mods and target != a and not a.startswith(target + "."):
                graph[a].add(target)
    return graph


def _reaches(graph, start: str, goal: str) -> list[str] | None:
    """A module-level import path start -> ... -> goal, or None."""
    stack, seen = [(start, [start])], {start}
    while stack:
        node, path = stack.pop()
        for nxt in sorted(graph.get(node, ())):
            if nxt == goal:
                return path + [nxt]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return None


def cycle_dodges() -> set[tuple[str, str]]:
    """Function-level imports a -> b that would close a cycle at module level (b already reaches a)."""
    graph = module_graph()
    return {(_short(a), _short(b)) for a, b, in_function, _ in imports()
            if in_function and a != b and _reaches(graph, b, a) is not None}


def test_every_module_has_a_layer():
    assert [m for m in _modules() if m != PKG and layer(m) is None] == []


def test_no_cycle_at_module_level():
    graph = module_graph()
    cycles = [path for mod in sorted(graph) if (path := _reaches(graph, mod, mod))]
    assert cycles == [], "import cycles at module level:\n" + "\n".join(" -> ".join(map(_short, c)) for c in cycles)


def test_no_upward_import():
    upward = {}
    for a, b, in_function, line in imports():
        if a != PKG and layer(b) is not None and layer(b) > layer(a):
            upward.setdefault((_short(a), _short(b)), f"{_short(a)}:{line}{' (in a function)' if in_function else ''}")
    new = {k: v for k, v in upward.items() if k not in ALLOWED}
    assert new == {}, "imports above the importer's layer (move the code, or add to ALLOWED with a reason):\n" + \
        "\n".join(f"{where} imports {b} (layer {layer(PKG + '.' + b)} > {layer(PKG + '.' + a)})"
                  for (a, b), where in new.items())
    assert set(ALLOWED) - set(upward) == set(), "ALLOWED lists imports that are gone; remove them"


def test_core_imports_no_exporter():
    """The issue's named rule, said directly: loading a target, a drafter or a runtime never pulls in
    the export pipeline (ONNX export, ModelOpt, TensorRT-LLM checkpoints)."""
    core = ("decoding", "targets", "drafter", "backends")
    bad = sorted({(_short(a), _short(b)) for a, b, _, _ in imports()
                  if _short(a).split(".")[0] in core and _short(b).split(".")[0] == "export"} - set(ALLOWED))
    assert bad == []


def test_function_level_imports_that_dodge_a_cycle_are_listed():
    """A lazy import that only dodges a cycle hides one: each is listed, with why the cycle stands."""
    assert cycle_dodges() == set(LAZY_FOR_CYCLE)

"""The house rules: hapnb's modules import one way along the data flow (docs/architecture.md §2), counting imports at
any depth (a function-local import that closes a circle is still a circle), and no module is too big.

Every ``import``/``from`` anywhere in a module's AST is resolved to the hapnb module it names; an edge
into a package's own ``__init__`` from inside that package is the package's face, not a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"hapnb": ROOT / "hapnb", "hapnb.widgets": ROOT / "widgets"}

#: Layers bottom up (docs/architecture.md §2). A module may import its own layer (one way) and those below.
#: ``hapnb`` itself (the lazy public API) and ``__main__`` sit on top.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("display",),  # renderers: a leaf that imports no other hapnb module
    ("ir", "ops", "zoo"),  # values: forms and the graph IR, custom ops, model definitions
    ("rules",),
    ("tracing",),
    ("triples",),
    ("hardware", "cost"),  # device models and clusters; the cost and memory models
    ("synth",),  # the search, its bounds and tables, memory pruning, the ratio LP, the Q/B loop, duplex
    ("plans", "pipelines"),  # the Plan value, synthesize, the simulator, explanations, comparison; Ditto
    ("runtime", "run"),  # rank programs, collectives, buffer updates, virtual devices; processes
    ("session", "teach"),  # the notebook-facing model of a plan being tuned; exercises graded by the theory
    ("cli", "cli_commands"),  # the parser and the program; what each subcommand does
    ("widgets",),
    ("__main__", "__init__"),
)


def modules() -> dict[str, Path]:
    out = {}
    for pkg, d in PACKAGES.items():
        for f in sorted(d.rglob("*.py")):
            parts = [p for p in f.relative_to(d).with_suffix("").parts if p != "__init__"]
            out[".".join([pkg, *parts])] = f
    return out


def _targets(mod: str, path: Path, node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    assert isinstance(node, ast.ImportFrom)
    base = mod.split(".")
    if node.level:
        keep = len(base) - node.level + (1 if path.name == "__init__.py" else 0)
        base = base[:keep]
    target = ".".join(base + ([node.module] if node.module else []))
    return [target] + [f"{target}.{a.name}" for a in node.names]


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported module: line of the first import}, hapnb modules only, at any depth."""
    mods = modules()
    edges: dict[str, dict[str, int]] = {m: {} for m in mods}
    for m, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for t in _targets(m, f, node):
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if not t or t == m:
                    continue
                if mods[t].name == "__init__.py" and m.startswith(t + "."):
                    continue  # a package's own face
                edges[m].setdefault(t, node.lineno)
    return edges


def layer_of(mod: str) -> int:
    name = mod.removeprefix("hapnb.").removeprefix("hapnb")
    if mod == "hapnb":
        name = "__init__"
    head = name.split(".")[0]
    for k, layer in enumerate(LAYERS):
        if head in layer:
            return k
    raise AssertionError(
        f"{mod}: no layer; add it to LAYERS in tests/test_layers.py (and docs/architecture.md §2)"
    )


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_counting_function_local_imports():
    assert cycles(import_graph()) == []


def test_imports_point_down_the_layers():
    bad = []
    for m, deps in import_graph().items():
        for t, line in deps.items():
            if layer_of(t) > layer_of(m):
                bad.append(f"{m} imports {t} (line {line}): {t} is in a higher layer")
    assert bad == []


def test_display_is_a_leaf_and_hapnb_never_imports_the_ui():
    edges = import_graph()
    for m, deps in edges.items():
        if m.startswith("hapnb.display"):
            assert all(t.startswith("hapnb.display") for t in deps), (m, deps)
        if not m.startswith("hapnb.widgets"):
            assert not any(t.startswith("hapnb.widgets") for t in deps), (m, deps)
    for f in modules().values():
        if "widgets" not in f.parts:
            assert "ipywidgets" not in f.read_text(), f


#: the house sizes (CONTRIBUTING.md): split by meaning past these, never by folding lines
MODULE_LINES, FUNCTION_LINES = 800, 150


def test_every_module_has_a_layer_and_stays_small():
    for m, f in modules().items():
        layer_of(m)
        lines = sum(1 for _ in f.open())
        assert lines <= MODULE_LINES, f"{f.relative_to(ROOT)} has {lines} lines: split it by meaning"


def test_no_function_is_too_long():
    long = [
        f"{f.relative_to(ROOT)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
        for f in modules().values()
        for n in ast.walk(ast.parse(f.read_text()))
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        and n.end_lineno - n.lineno + 1 > FUNCTION_LINES
    ]
    assert not long, f"functions over {FUNCTION_LINES} lines (split them by meaning): {long}"


def test_the_checker_sees_function_local_imports(tmp_path, monkeypatch):
    """The checker itself: a lazy import that closes a circle is found, and so is an upward import."""
    pkg = tmp_path / "hapnb"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "forms.py").write_text("def f():\n    from .cost import g\n    return g\n")
    (pkg / "cost.py").write_text("from .forms import f\n\ndef g():\n    return f\n")
    monkeypatch.setitem(PACKAGES, "hapnb", pkg)
    monkeypatch.setitem(PACKAGES, "hapnb.widgets", tmp_path / "nowidgets")
    edges = import_graph()
    assert cycles(edges) == [["hapnb.cost", "hapnb.forms"]]
    assert edges["hapnb.forms"] == {"hapnb.cost": 2}
    with pytest.raises(AssertionError):
        test_imports_point_down_the_layers()


def test_test_folders_mirror_the_packages():
    """tests/<folder>/ holds the tests of hapnb/<folder>/ (or widgets/): a folder named after no package is a
    misplaced test."""
    packages = {p.name for p in (ROOT / "hapnb").iterdir() if (p / "__init__.py").exists()} | {"widgets"}
    folders = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    assert folders <= packages, f"test folders named after no package: {sorted(folders - packages)}"
    assert folders, "tests/ has no package folders"

"""Tests of the hapnb.rules package layout: one rule per op (double registration raises unless
``override=True``), the table each formerly double-registered op now has, one family module per
algebra, and imports that only point down."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest
import torch

from hapnb import rules
from hapnb.ir.forms import R
from hapnb.rules import registry
from hapnb.rules.checker import _single_op
from hapnb.rules.registry import _Cand, _register

RULES_DIR = Path(rules.__file__).parent


@pytest.fixture
def scratch_registry(monkeypatch):
    """A copy of the live table, so a test can register into it without leaking."""
    monkeypatch.setattr(registry, "_RULES", dict(registry._RULES))
    return registry._RULES


def _gen_nothing(g, op):
    return []


# ------------------------------------------------------------------------ double registration


def test_registering_an_op_twice_raises_naming_the_op_and_both_registrations(scratch_registry):
    before = scratch_registry["aten.relu.default"]
    with pytest.raises(ValueError) as info:
        _register(["aten.relu.default"], "test-family", _gen_nothing, reason="a second rule")
    msg = str(info.value)
    assert "aten.relu.default" in msg
    assert "'pointwise'" in msg and "hapnb.rules.pointwise" in msg  # the first registration
    assert "'test-family'" in msg and __name__ in msg and "a second rule" in msg  # the second one
    assert "override=True" in msg
    assert scratch_registry["aten.relu.default"] is before


def test_a_failed_registration_registers_none_of_its_targets(scratch_registry):
    with pytest.raises(ValueError, match="aten.relu.default"):
        _register(["aten.frobnicate.default", "aten.relu.default"], "test-family", _gen_nothing)
    assert "aten.frobnicate.default" not in scratch_registry
    with pytest.raises(ValueError, match="aten.frobnicate.default appears twice"):
        _register(["aten.frobnicate.default"] * 2, "test-family", _gen_nothing)
    assert "aten.frobnicate.default" not in scratch_registry


def test_override_replaces_the_rule(scratch_registry):
    def gen(g, op):
        return [_Cand("only-partial", (R,), (R,), "full")]

    _register(
        ["aten.relu.default"],
        "test-family",
        gen,
        flops=lambda i, o, a, k: 7.0,
        reason="replaced",
        override=True,
    )
    assert rules.family("aten.relu.default") == "test-family"
    assert rules.registered()["aten.relu.default"] == ("test-family", "replaced")
    assert rules.flops("aten.relu.default", [(4, 5)], [(4, 5)]) == 7.0
    g, op, _ = _single_op("aten.relu.default", (torch.randn(4, 5),), {})
    assert [s.name for s in rules.strategies(g, op)] == ["replicate", "only-partial"]


# ----------------------------------------------------------- one registration per op, from scratch


@pytest.fixture(scope="module")
def registrations():
    """Re-import every family module into an empty table, recording each registration as
    ``(target, family, module)``. The live table object is refilled by the re-import (so code that
    holds it keeps working); on failure it gets its old contents back."""
    table = registry._RULES
    saved = dict(table)
    real = registry._register
    calls: list[tuple[str, str, str]] = []

    def recording(targets, family, gen, **kw):
        targets = list(targets)
        calls.extend((t, family, gen.__module__) for t in targets)
        real(targets, family, gen, **kw)

    table.clear()
    registry._register = recording
    try:
        for m in rules._FAMILY_MODULES:
            importlib.reload(m)
    except BaseException:
        table.clear()
        table.update(saved)
        raise
    finally:
        registry._register = real
        for m in rules._FAMILY_MODULES:
            m._register = real
    assert set(table) == set(saved)
    return calls


def test_every_op_is_registered_exactly_once(registrations):
    targets = [t for t, _, _ in registrations]
    assert len(targets) == len(set(targets)) == len(registry._RULES)


@pytest.mark.parametrize(
    ("target", "family", "in_shapes", "flops"),
    [
        ("aten.neg.default", "linear", [(4, 5)], 20.0),  # one flop per element; linear: R -> R
        ("aten.positive.default", "linear", [(4, 5)], 0.0),  # identity
        ("aten.pow.Tensor_Scalar", "pointwise", [(4, 5)], 80.0),  # transcendental: 4 per element
        ("aten.pow.Tensor_Tensor", "pointwise", [(4, 5), (4, 5)], 80.0),
        ("aten.pow.Scalar", "pointwise", [(4, 5)], 80.0),
        ("aten.div.Tensor", "multiplicative", [(4, 5), (4, 5)], 20.0),
        ("aten.div.Scalar", "multiplicative", [(4, 5)], 20.0),
        ("aten.div.Tensor_mode", "pointwise", [(4, 5), (4, 5)], 20.0),
        ("aten.rsub.Scalar", "additive", [(4, 5)], 20.0),
        ("aten.rsub.Tensor", "pointwise", [(4, 5), (4, 5)], 20.0),
    ],
)
def test_formerly_double_registered_ops_have_one_table(registrations, target, family, in_shapes, flops):
    mine = [(f, m) for t, f, m in registrations if t == target]
    assert len(mine) == 1, mine
    assert mine[0] == (family, "hapnb.rules.pointwise")
    assert rules.family(target) == family
    assert rules.flops(target, in_shapes, [(4, 5)]) == flops


def test_neg_is_linear_and_pow_is_not():
    x = torch.randn(4, 5, dtype=torch.float64)
    for target, args, partial in (
        ("aten.neg.default", (x,), True),
        ("aten.positive.default", (x,), True),
        ("aten.pow.Tensor_Scalar", (x, 2), False),
        ("aten.pow.Tensor_Tensor", (x.abs() + 1, x), False),
    ):
        g, op, _ = _single_op(target, args, {})
        has_partial = any(R in s.inputs for s in rules.strategies(g, op))
        assert has_partial == partial, target
    assert rules.check(["aten.neg.default", "aten.pow.Tensor_Scalar"], trials=4).ok


# ---------------------------------------------------------------------------------- layout


def test_every_registered_op_maps_to_exactly_one_family_module(registrations):
    family_modules = {m.__name__ for m in rules._FAMILY_MODULES}
    module_of: dict[str, str] = {}
    modules_of_family: dict[str, set[str]] = {}
    for target, family, module in registrations:
        assert module in family_modules, (target, module)
        assert module_of.setdefault(target, module) == module
        modules_of_family.setdefault(family, set()).add(module)
    split = {f: ms for f, ms in modules_of_family.items() if len(ms) > 1}
    assert not split, f"families spread over several modules: {split}"
    assert set(module_of.values()) == family_modules  # every family module has a table
    # the live table agrees: each rule's generator lives in its family module
    for target, rule in registry._RULES.items():
        assert rule.module == module_of[target], target


def test_family_modules_are_documented_tables():
    for m in rules._FAMILY_MODULES:
        doc = m.__doc__ or ""
        assert "Algebra" in doc and "table" in doc, m.__name__
    # the package docstring lists every module of the package
    for path in RULES_DIR.glob("*.py"):
        if not path.stem.startswith("_"):
            assert f":mod:`.{path.stem}`" in rules.__doc__, path.stem


def test_every_rules_module_is_under_800_lines():
    sizes = {p.name: len(p.read_text().splitlines()) for p in RULES_DIR.glob("*.py")}
    assert sizes and all(n < 800 for n in sizes.values()), sizes


def _imports(path: Path) -> set[str]:
    """The hapnb modules ``path`` imports, at any depth (function-local imports count)."""
    pkg = "hapnb.rules"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("hapnb"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("hapnb"):
                continue
            subs = {f"{mod}.{a.name}" for a in node.names}
            known = {s for s in subs if _is_module(s)}
            out.update(known or {mod})
    return out


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def test_rules_imports_only_point_down():
    lower = {"hapnb.ir.forms", "hapnb.ir.graph", "hapnb.ops"}
    family_modules = {m.__name__ for m in rules._FAMILY_MODULES}
    for path in RULES_DIR.glob("*.py"):
        name = f"hapnb.rules.{path.stem}"
        got = _imports(path)
        outside = {m for m in got if not m.startswith("hapnb.rules")} - lower
        assert not outside, f"{name} imports {outside} (above hapnb.rules)"
        inside = {m for m in got if m.startswith("hapnb.rules")}
        if path.stem in ("registry", "truth", "cachedir"):
            assert not inside, f"{name} is a bottom module of hapnb.rules: it imports {inside}"
        elif name in family_modules:  # the tables and their ground-truth samples
            assert inside <= family_modules | {"hapnb.rules.registry", "hapnb.rules.truth"}, (name, inside)
        elif path.stem == "checker":
            assert "hapnb.rules" not in inside, "checker imports the package face"

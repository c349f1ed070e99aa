"""The examples in hapnb's docstrings run and print what they say (every module, every docstring)."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "hapnb"
MODULES = sorted(
    ".".join(["hapnb", *f.relative_to(ROOT).with_suffix("").parts]).removesuffix(".__init__")
    for f in ROOT.rglob("*.py")
    if f.name != "__main__.py"  # running it is the CLI
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, name):
        if test.docstring and test.filename and Path(test.filename).resolve().is_relative_to(ROOT):
            runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples failed in {name}"


def test_the_library_has_runnable_examples() -> None:
    """Not every example may be skipped: the public entry points show runnable ones."""
    attempted = 0
    for name in (
        "hapnb",
        "hapnb.tracing",
        "hapnb.plans.synthesis",
        "hapnb.hardware.cluster",
        "hapnb.ir.forms",
        "hapnb.synth.balance",
    ):
        tests = doctest.DocTestFinder().find(importlib.import_module(name), name)
        attempted += sum(len([e for e in t.examples if not e.options.get(doctest.SKIP)]) for t in tests)
    assert attempted >= 10

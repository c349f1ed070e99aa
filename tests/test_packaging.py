"""What users install is self-contained: the wheel holds every hapnb package (hapnb.widgets from the
top-level widgets/ folder included) and the package data (hapnb/data/), and an installed copy reads its
data through ``importlib.resources`` without the source checkout.

pyproject.toml lists the packages by hand (setuptools cannot discover them and also map hapnb.widgets to
widgets/), so one test checks the list against the folders: every folder under hapnb/, the data-only
hapnb/data/ included (setuptools warns about a data folder that is not a listed package). One builds the
wheel (a few seconds) from a copy of the sources, so the build leaves no build/ or *.egg-info in the
checkout, and checks its files; one imports hapnb from the unpacked wheel in a fresh process run outside
the checkout and reads the shipped data there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from fnmatch import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _package_folders() -> dict[str, Path]:
    """Every package of the source tree, by dotted name: hapnb/ and each folder below it (with an
    __init__.py, or data only, as hapnb/data/), and hapnb.widgets (widgets/)."""
    hapnb = ROOT / "hapnb"
    out = {"hapnb": hapnb}
    for d in sorted(p for p in hapnb.rglob("*") if p.is_dir()):
        rel = d.relative_to(ROOT)
        if "__pycache__" not in rel.parts and not any(s.startswith(".") for s in rel.parts):
            out[".".join(rel.parts)] = d
    out["hapnb.widgets"] = ROOT / "widgets"
    return out


def _sources(folder: Path) -> list[Path]:
    """The files of one package folder (not its sub-folders, nor caches)."""
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and p.suffix not in (".pyc", ".pyo") and not p.name.startswith(".")
    )


def test_pyproject_lists_every_package_folder():
    tool = _pyproject()["tool"]["setuptools"]
    listed = set(tool["packages"])
    folders = _package_folders()
    missing = sorted(set(folders) - listed)
    assert not missing, f"pyproject.toml [tool.setuptools] packages lacks {missing}: add them"
    stale = sorted(listed - set(folders))
    assert not stale, f"pyproject.toml [tool.setuptools] packages lists {stale}, which have no folder"
    assert tool["package-dir"] == {"hapnb.widgets": "widgets"}
    # every non-Python file of a package (hapnb/data/'s files) must be package data, or the wheel leaves
    # it out
    data = tool.get("package-data", {})
    for name, folder in folders.items():
        for f in _sources(folder):
            if f.suffix != ".py":
                assert any(fnmatch(f.name, g) for g in data.get(name, [])), (
                    f"{f.relative_to(ROOT)} is not package data: add it to [tool.setuptools.package-data]"
                )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in ("hapnb", "widgets"):
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    out = tmp / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q"]
    r = subprocess.run([*cmd, str(src), "-w", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"pip wheel failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    (whl,) = out.glob("hapnb-*.whl")
    return whl


def test_wheel_holds_every_package_and_the_data(wheel: Path):
    names = set(zipfile.ZipFile(wheel).namelist())
    for name, folder in _package_folders().items():
        where = name.replace(".", "/")
        for f in _sources(folder):
            assert f"{where}/{f.name}" in names, f"the wheel lacks {where}/{f.name}"
    assert {"hapnb/data/h100-lm-steps.json", "hapnb/data/README.md", "hapnb/widgets/__init__.py"} <= names
    assert not any(n.startswith(("widgets/", "tests/", "notebooks/", "docs/")) for n in names), sorted(names)
    info = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "hapnb = hapnb.cli:run" in zipfile.ZipFile(wheel).read(info).decode()


_INSTALLED_CHECK = """
import json, sys
from importlib import util
from pathlib import Path
import hapnb
from hapnb.hardware.catalogue import H100_MODEL
from hapnb.run.calibrate import load_measured, predict_step_s, run_features, shipped_runs

site = Path(sys.argv[1]).resolve()
runs = shipped_runs()
data = load_measured()
run = data["runs"][0]
f = run_features(run, {"vocab": data["model"]["vocab"]})
print(json.dumps({
    "hapnb": hapnb.__file__, "widgets": util.find_spec("hapnb.widgets").origin, "runs": str(runs),
    "n_runs": len(data["runs"]), "ratio": predict_step_s(H100_MODEL, f) / run["step_s_median"],
    "site": str(site),
}))
"""


def test_the_unpacked_wheel_reads_its_data_without_the_checkout(wheel: Path, tmp_path: Path):
    """The wheel unpacked into a bare folder (what pip's install puts in site-packages) and imported from
    there, in a process whose working directory is outside the checkout."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = dict(os.environ, PYTHONPATH=str(site), PYTHONNOUSERSITE="1")
    r = subprocess.run(
        [sys.executable, "-c", _INSTALLED_CHECK, str(site)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    site = site.resolve()
    for key in ("hapnb", "widgets", "runs"):
        assert Path(got[key]).resolve().is_relative_to(site), (key, got[key])
    assert Path(got["runs"]).name == "h100-lm-steps.json"
    assert got["n_runs"] == 12
    assert got["ratio"] == pytest.approx(1.0, abs=0.1)  # the shipped H100 model predicts the shipped run


@pytest.mark.slow
def test_the_unpacked_wheel_plans_displays_and_verifies(wheel: Path, tmp_path: Path):
    """What a user does first, from the installed package alone (outside the checkout): ``hapnb demo
    --no-verify`` (plan, explain, report) and one ``hapnb verify`` on 2 gloo ranks, whose workers import
    hapnb from the same place."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = dict(os.environ, PYTHONPATH=str(site), PYTHONNOUSERSITE="1")

    def hapnb(*args: str) -> str:
        r = subprocess.run(
            [sys.executable, "-m", "hapnb", *args], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
        assert r.returncode == 0, f"hapnb {' '.join(args)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        return r.stdout + r.stderr

    out = hapnb("demo", "--no-verify", "--report", "report.html")
    assert "faster" in out and (tmp_path / "report.html").stat().st_size > 10_000
    out = hapnb(
        "verify", "--model", "mlp", "--layers", "2", "--batch", "8", "--set", "hidden=16",
        "--cluster", "1xV100+1xP100", "--nproc", "2", "--steps", "2",
    )  # fmt: skip
    assert "verify mlp: OK on 2 ranks" in out

"""A real-browser test: notebook 01 run in JupyterLab by headless Chromium (driven by playwright).

JupyterLab starts on 127.0.0.1 on a free port with an empty token, on a temporary copy of the notebook
and with temporary Jupyter config/settings/workspace folders (the news announcements plugin disabled,
so its toast cannot cover the page). Chromium runs with a fresh profile. The test clicks Run > Run All
Cells, waits until every cell has run and the kernel is idle, then checks that the Explorer widget, a
bokeh chart and a graphviz drawing rendered and that no cell printed a traceback. JupyterLab and
Chromium are always stopped (no processes are left behind). Skipped, with the reason, when Chromium or
playwright is missing (``apt-get install chromium``; ``pip install playwright``, no
``playwright install`` needed).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "01_tour.ipynb"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
RUN_TIMEOUT_S = 180.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with code {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        time.sleep(0.3)
    raise TimeoutError(f"JupyterLab did not answer {url} within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen | None, grace: float = 20.0) -> None:
    """SIGTERM the server's process group (it shuts its kernels down), SIGKILL what is left."""
    if proc is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # kernels it started share the group
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def _start_lab(tmp: Path, port: int) -> tuple[subprocess.Popen, Path]:
    config = tmp / "jupyter-config"
    (config / "labconfig").mkdir(parents=True)
    disabled = {"@jupyterlab/apputils-extension:announcements": True}
    (config / "labconfig" / "page_config.json").write_text(json.dumps({"disabledExtensions": disabled}))
    # render every cell (no windowing), so the checks see outputs below the fold too; start the
    # notebook's kernel without the "Select Kernel" dialog
    tracker = tmp / "lab-settings" / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True)
    tracker.write_text(json.dumps({"windowingMode": "none", "autoStartDefaultKernel": True}))
    env = dict(
        os.environ,
        JUPYTER_CONFIG_DIR=str(config),
        JUPYTERLAB_SETTINGS_DIR=str(tmp / "lab-settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(tmp / "lab-workspaces"),
        JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
    )
    log = tmp / "jupyterlab.log"
    cmd = [
        sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root", f"--port={port}",
        "--ServerApp.ip=127.0.0.1", "--ServerApp.token=", "--ServerApp.password=",
        "--ServerApp.port_retries=0", f"--ServerApp.root_dir={tmp / 'nb'}",
        "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log


def _prompts(page) -> list[str]:
    return [p.strip() for p in page.locator(".jp-CodeCell .jp-InputArea-prompt").all_text_contents()]


def _dismiss_dialogs(page, seen: list[str]) -> None:
    """Accept any modal dialog (e.g. JupyterLab's kernel chooser when the session starts slowly) and
    remember its text for the failure message."""
    dialogs = page.locator(".jp-Dialog")
    for _ in range(3):
        if dialogs.count() == 0:
            return
        seen.append(" ".join(dialogs.first.inner_text().split())[:300])
        accept = dialogs.first.locator(".jp-Dialog-button.jp-mod-accept")
        if accept.count():
            accept.first.click()
        else:
            page.keyboard.press("Escape")
        time.sleep(0.5)


def _run_all_from_menu(
    page, dialogs: list[str], tries: int = 4, menu: str = "Run", command: str = "runmenu:run-all",
    label: str = r"^Run All Cells",
) -> None:  # fmt: skip
    """Click ``menu`` > the item (by ``command``, else by ``label``) until every cell is queued: the last
    cell's prompt changes to a queued or new one (the first click can land before the kernel is
    connected, when the command is still disabled). Dialogs (a kernel chooser, a restart confirmation)
    are accepted and remembered."""
    from playwright.sync_api import Error as PlaywrightError

    before = (_prompts(page) or [""])[-1]
    for _ in range(tries):
        _dismiss_dialogs(page, dialogs)
        try:
            page.locator(".lm-MenuBar-itemLabel", has_text=menu).first.click(timeout=10_000)
            item = page.locator(f".lm-Menu-item[data-command='{command}']")
            if item.count() == 0:  # another JupyterLab version: find it by its label
                item = page.locator(".lm-Menu-item", has_text=re.compile(label))
            item.first.click(timeout=10_000)
        except PlaywrightError:  # a dialog popped up over the menu: dismiss it and try again
            page.keyboard.press("Escape")
            continue
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            _dismiss_dialogs(page, dialogs)  # Run All on a notebook without a kernel asks for one
            prompts = _prompts(page)
            if prompts and prompts[-1] not in ("", "[ ]:", before):
                return
            time.sleep(0.3)
        page.keyboard.press("Escape")
    raise RuntimeError(
        f"{menu} > {label} did not queue the cells after {tries} tries: prompts {_prompts(page)[-3:]}, "
        f"dialogs seen: {dialogs}"
    )


def _wait_all_run(page, n_code: int, timeout: float) -> None:
    """Every code cell shows an execution count (no ``[*]`` / blank prompt) and the kernel is idle."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        prompts = _prompts(page)
        done = [p for p in prompts if p.startswith("[") and p[1:-2].strip().isdigit()]
        idle = page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").count() > 0
        last = f"{len(done)}/{n_code} cells done, prompts {prompts[-3:]}, idle={idle}"
        # a cell whose input is collapsed (a hidden solution) shows no prompt: its execution count does
        highest = max((int(p[1:-2]) for p in done), default=0)
        if (len(done) >= n_code or highest >= n_code) and idle:
            return
        time.sleep(0.5)
    errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    shown = "\n".join(t[-1500:] for t in errors.all_text_contents()[:2])
    raise TimeoutError(f"notebook did not finish within {timeout:.0f} s: {last}\n{shown}")


def _wait_explorer(page, console_errors: list[str], dialogs: list[str], n_code: int) -> None:
    """The Explorer's buttons render. Seen only inside the full suite on a busy machine (which is why
    scripts/test.sh runs this test on its own): the page's widget manager missed the kernel's widget
    messages for the whole page ("Error displaying widget: model not found", even after re-running the
    cell or restarting the kernel), while the same run alone or under CPU load renders. The fallback loads
    the page again (a new widget manager), restarts the kernel and runs every cell again; a second failure
    reports the cell's output, the browser's console errors and its failed requests."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    selector = ".jupyter-widgets .widget-button"
    try:
        page.wait_for_selector(selector, timeout=60_000)
        return
    except PlaywrightTimeout:
        pass
    cell = page.locator(".jp-CodeCell", has_text="Explorer(plan)").last
    first_output = " ".join(cell.locator(".jp-OutputArea").all_inner_texts())[:300]
    page.reload(timeout=90_000)
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)
    _run_all_from_menu(
        page, dialogs, menu="Kernel", command="notebook:restart-run-all", label=r"Restart Kernel and Run All"
    )
    _wait_all_run(page, n_code, RUN_TIMEOUT_S)
    try:
        page.wait_for_selector(selector, timeout=120_000)
    except PlaywrightTimeout as e:
        raise AssertionError(
            f"the Explorer did not render, even after a page reload and a kernel restart: its output was {first_output!r}, now "
            f"{' '.join(cell.locator('.jp-OutputArea').all_inner_texts())[:300]!r}; dialogs {dialogs}; "
            f"console errors: {list(dict.fromkeys(console_errors))[:8]}"
        ) from e
    print(f"the Explorer rendered after a page reload and a kernel restart (first output: {first_output!r})")


@contextlib.contextmanager
def _notebook_page(sync_api, tmp_path: Path, notebook: Path, console_errors: list[str]) -> Iterator:  # type: ignore[no-untyped-def]
    """A copy of ``notebook`` open in JupyterLab in headless Chromium, its kernel idle: yields the page.
    JupyterLab and Chromium always stop; a failure leaves a screenshot in ``tmp_path``."""
    (tmp_path / "nb").mkdir()
    shutil.copy(notebook, tmp_path / "nb" / notebook.name)
    port = _free_port()
    lab: subprocess.Popen | None = None
    pw = context = None
    try:
        lab, log = _start_lab(tmp_path, port)
        base = f"http://127.0.0.1:{port}"
        _wait_http(f"{base}/api/status", lab, log)
        pw = sync_api.sync_playwright().start()
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1000},
        )  # fmt: skip
        page = context.pages[0] if context.pages else context.new_page()
        page.on("console", lambda m: console_errors.append(m.text[:600]) if m.type == "error" else None)
        page.on("requestfailed", lambda r: console_errors.append(f"request failed: {r.url} ({r.failure})"))
        page.goto(f"{base}/lab/tree/{notebook.name}", timeout=90_000)
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)
        yield page
    except BaseException:
        if context is not None and context.pages:
            with contextlib.suppress(Exception):
                context.pages[0].screenshot(path=str(tmp_path / "failure.png"))
        raise
    finally:
        if context is not None:
            with contextlib.suppress(Exception):
                context.close()
        if pw is not None:
            with contextlib.suppress(Exception):
                pw.stop()
        _stop(lab)


def _tracebacks(page) -> list[str]:  # type: ignore[no-untyped-def]
    """The error outputs of the notebook's cells."""
    stderr = page.locator(".jp-RenderedText[data-mime-type='application/vnd.jupyter.stderr']")
    return [t for t in stderr.all_inner_texts() if "Traceback" in t]


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
def test_tour_notebook_runs_and_renders_in_jupyterlab(tmp_path: Path) -> None:
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install playwright)"
    )
    if shutil.which("dot") is None:
        pytest.skip("graphviz 'dot' is not installed (apt-get install -y graphviz): no drawing to check")
    n_code = sum(c["cell_type"] == "code" for c in json.loads(NOTEBOOK.read_text())["cells"])
    console_errors: list[str] = []
    dialogs: list[str] = []
    with _notebook_page(sync_api, tmp_path, NOTEBOOK, console_errors) as page:
        _run_all_from_menu(page, dialogs)
        if dialogs:
            print("dismissed JupyterLab dialogs:", dialogs)
        _wait_all_run(page, n_code, RUN_TIMEOUT_S)
        _wait_explorer(page, console_errors, dialogs, n_code)
        page.wait_for_selector("div[data-root-id] canvas, .bk-root canvas", state="attached", timeout=120_000)

        tracebacks = _tracebacks(page)
        assert not tracebacks, f"error outputs in the notebook: {tracebacks[:2]}"
        assert page.locator(".jupyter-widgets").count() > 0
        assert page.locator(".widget-button").count() >= 3, "the Explorer's buttons did not render"
        buttons = " ".join(page.locator(".widget-button").all_inner_texts())
        assert "Step" in buttons, f"no Step button among {buttons!r}"
        assert page.locator("div[data-root-id] canvas, .bk-root canvas").count() > 0, "no bokeh canvas"
        # JupyterLab shows image/svg+xml outputs as <img src="data:image/svg+xml,..."> (or inline <svg>)
        drawings = [
            urllib.parse.unquote(src)
            for src in page.locator(".jp-RenderedSVG img").evaluate_all("els => els.map(e => e.src)")
        ] + page.locator(".jp-RenderedSVG svg").evaluate_all("els => els.map(e => e.outerHTML)")
        assert len(drawings) >= 3, f"expected the graph, search-tree and proof drawings, got {len(drawings)}"
        assert all("<svg" in d for d in drawings), "a drawing output is not SVG"
        assert "matmul" in drawings[0], "the graph drawing does not show the matmul op"
        assert page.locator(".jp-RenderedSVG img").first.evaluate("e => e.naturalWidth") > 0
        assert not [e for e in console_errors if "bokeh" in e.lower()], f"bokeh errors: {console_errors}"

        # the widget talks to the kernel: Reset, then Step, and the panel reports the new search state
        panel = page.locator(".jupyter-widgets").first
        panel.locator(".widget-button", has_text="Reset").first.click()
        panel.get_by_text(re.compile(r"\b0 expansions")).first.wait_for(timeout=120_000)
        panel.locator(".widget-button", has_text=re.compile(r"^\W*Step$")).first.click()
        panel.get_by_text(re.compile(r"\b1 expansions?")).first.wait_for(timeout=120_000)


#: set to 1 to run every notebook in the browser (about half a minute each; a release check, not CI's)
ALL_NOTEBOOKS = os.environ.get("HAPNB_BROWSER_ALL") == "1"


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
@pytest.mark.skipif(not ALL_NOTEBOOKS, reason="every notebook in the browser: set HAPNB_BROWSER_ALL=1")
@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "notebooks").glob("[0-9]*.ipynb")))
def test_every_notebook_runs_and_shows_a_picture_in_jupyterlab(name: str, tmp_path: Path) -> None:
    """Each notebook: Run All in JupyterLab, no traceback in any output, and at least one rendered widget,
    bokeh canvas or SVG drawing."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    notebook = ROOT / "notebooks" / name
    for extra in ("docs", "examples"):  # what notebooks read next to themselves (the measured figures)
        if (ROOT / extra).is_dir():
            shutil.copytree(ROOT / extra, tmp_path / extra)
    n_code = sum(c["cell_type"] == "code" for c in json.loads(notebook.read_text())["cells"])
    with _notebook_page(sync_api, tmp_path, notebook, []) as page:
        _run_all_from_menu(page, [])
        _wait_all_run(page, n_code, RUN_TIMEOUT_S)
        tracebacks = _tracebacks(page)
        assert not tracebacks, f"{name}: error outputs: {tracebacks[:2]}"
        pictures = {
            "widget": page.locator(".jupyter-widgets").count(),
            "bokeh": page.locator("div[data-root-id] canvas, .bk-root canvas").count(),
            "svg": page.locator(
                ".jp-RenderedSVG img, .jp-RenderedSVG svg, .jp-RenderedHTMLCommon svg"
            ).count(),
        }
        print(name, pictures)
        assert any(pictures.values()), f"{name}: no widget, chart or drawing rendered"

"""The notebook explorer in a real browser: JupyterLab on 127.0.0.1 with a token, driven through
Playwright by the machine's Chromium. A notebook creates the Explorer on the demo session; the test
starts generation from the page, checks that the grids, bars and controls rendered and that the grid
redraws while generating, removes a sequence with its button and checks the grid and the status, then
measures on a 16k-cell cache how often the grid redraws while generating and how long a cell takes to
run meanwhile. Screenshots and numbers go to $KVSCOPE_BROWSER_OUT (default: the test's temporary folder).

Skips (with the reason) when Chromium, Playwright or JupyterLab is missing; CI here has all three."""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from tests.jupyter_browser import JupyterLab, find_chromium, notebook

playwright_api = pytest.importorskip("playwright.sync_api", reason="the browser test needs playwright (the dev extra)")
pytest.importorskip("jupyterlab", reason="the browser test needs jupyterlab (the dev extra)")
pytest.importorskip("ipywidgets", reason="the browser test needs ipywidgets (the dev extra)")
CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium or Chrome on the PATH (set KVSCOPE_CHROMIUM)")

DEMO_CELL = "from explorer import Explorer\nx = Explorer(columns=32, start=False)\nx"
PROBE_CELL = ("n_probe = globals().get('n_probe', 0) + 1\nprint(f'probe {n_probe}')\n"
              "import statistics\nfor name in ('x', 'big'):\n    if name in globals():\n"
              "        print(name, 'update ms', round(1e3 * statistics.median(globals()[name].update_seconds), 1))")
BIG_CELL = ("x.close()\n"
            "big = Explorer(None, '-c 16384 -np 4 -kvu --workload parallel --sequences 100000 -n 4000 --speed 0 --start',"
            " columns=128, history=False)\nbig")
# a grid update that reached the page: the picture of the first lane's cells changed (plotly draws a
# heatmap as an image; a relayout of titles alone leaves it as it was)
COUNT_REDRAWS = """(k) => { const gd = document.querySelectorAll('.jp-Cell')[k].querySelector('.js-plotly-plot');
    window.__redraws = 0; let last = null;
    if (window.__counter) clearInterval(window.__counter);
    window.__counter = setInterval(() => {
        const image = gd.querySelector('.heatmaplayer image');
        const now = image ? image.getAttribute('href') || image.getAttribute('xlink:href') : null;
        if (now !== null && last !== null && now !== last) window.__redraws += 1;
        last = now; }, 20); }"""


def button(page, name: str):
    """The button whose text is `name` (an icon's glyph is no text of it)."""
    return page.locator("button").filter(has_text=re.compile(rf"^\s*{re.escape(name)}\s*$"))


def status_text(page) -> str:
    return page.locator(".widget-html-content", has_text=re.compile(r"step \d+")).first.inner_text()


def step_of(page) -> int:
    return int(re.search(r"step (\d+)", status_text(page)).group(1))


def used_cells(page, cache: str = "base") -> int:
    return int(re.search(rf"{cache} (\d+)/\d+", status_text(page)).group(1))


def run_cell(page, k: int) -> float:
    """Run cell k with shift+enter; the time it was asked."""
    page.locator(".jp-Cell").nth(k).locator(".cm-content").click()
    asked = time.monotonic()
    page.keyboard.press("Shift+Enter")
    return asked


def wait_for_text(page, text: str, timeout_s: float) -> float:
    page.locator(f"text=/{re.escape(text)}/").first.wait_for(timeout=timeout_s * 1000)
    return time.monotonic()


def test_the_explorer_renders_runs_and_takes_commands_in_a_real_browser(tmp_path):
    out = Path(os.environ.get("KVSCOPE_BROWSER_OUT", tmp_path / "out"))
    out.mkdir(parents=True, exist_ok=True)
    root = tmp_path / "notebooks"
    root.mkdir()
    (root / "explorer.ipynb").write_text(json.dumps(notebook([DEMO_CELL, PROBE_CELL, BIG_CELL, PROBE_CELL])))
    lab = JupyterLab(root, tmp_path / "jupyter")
    report: dict[str, float] = {}
    try:
        lab.wait_ready()
        with playwright_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1500, "height": 1600})
            page.goto(lab.notebook_url("explorer.ipynb"))
            try:
                drive(page, out, report)
            except Exception:
                page.screenshot(path=str(out / "failure.png"))
                raise
            browser.close()
    finally:
        lab.stop()
    (out / "browser-report.json").write_text(json.dumps(report, indent=1))
    print("browser test:", json.dumps(report))
    assert report["16k grid redraws per second"] >= 2, report
    assert report["cell during generation, s"] <= 3, report


def drive(page, out: Path, report: dict) -> None:
    if True:
        if True:
            page.wait_for_function("document.body.innerText.includes('| Idle')", timeout=120_000)

            # the explorer renders: three plotly figures (grids, window, bars) and the controls
            run_cell(page, 0)
            page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 3", timeout=120_000)
            page.locator(".js-plotly-plot .heatmaplayer image").first.wait_for(timeout=60_000)
            for name in ("start", "step", "rm", "cp", "keep", "context shift", "clear", "save", "load", "Estimate"):
                assert button(page, name).count() >= 1, name
            assert "kvscope-demo-gemma3" in page.locator(".widget-html-content").first.inner_text()
            assert page.locator(".js-plotly-plot .bars, .js-plotly-plot .barlayer").count() >= 1

            # generation from the page: the grid redraws and the step count goes up
            page.evaluate(COUNT_REDRAWS, 0)
            step_before = step_of(page)
            button(page, "start").click()
            page.wait_for_function("window.__redraws >= 3", timeout=30_000)
            time.sleep(3)
            assert step_of(page) > step_before
            report["demo grid redraws"] = page.evaluate("window.__redraws")

            # a sequence operation from its button: pause, select seq 1, rm; its cells are freed
            button(page, "pause").click()
            page.get_by_text("paused", exact=True).first.wait_for(timeout=15_000)
            time.sleep(1.0)
            used = used_cells(page)
            page.locator(".widget-dropdown", has_text="sequence").locator("select").select_option("1")
            page.locator("text=/seq 1: its next token/").first.wait_for(timeout=15_000)
            redraws = page.evaluate("window.__redraws")
            button(page, "rm").click()
            page.get_by_text("seq 1 removed", exact=True).wait_for(timeout=15_000)
            page.wait_for_function(f"window.__redraws > {redraws}", timeout=15_000)
            page.wait_for_function(f"""() => {{ const m = document.body.innerText.match(/base (\\d+)\\/256/);
                                        return m && Number(m[1]) < {used}; }}""", timeout=15_000)
            assert used_cells(page) < used
            # the picture for the README: another sequence selected, its window shown
            page.locator(".widget-dropdown", has_text="sequence").locator("select").select_option("2")
            page.locator("text=/seq 2: its next token/").first.wait_for(timeout=15_000)
            time.sleep(1.0)
            page.locator(".jp-Cell").nth(0).locator(".jp-OutputArea").screenshot(path=str(out / "explorer.png"))

            # 16k cells, generating as fast as it goes: grid redraws per second, and a cell run meanwhile
            run_cell(page, 1)
            run_cell(page, 2)
            page.locator("text=/base 0\\/16384|base \\d+\\/16384/").first.wait_for(timeout=120_000)
            page.wait_for_function("document.querySelectorAll('.jp-Cell')[2].querySelectorAll('.js-plotly-plot').length >= 3",
                                   timeout=120_000)
            page.wait_for_function("""() => { const m = document.body.innerText.match(/step (\\d+)/g);
                                      return m && m.some(s => Number(s.slice(5)) > 20); }""", timeout=120_000)
            page.evaluate(COUNT_REDRAWS, 2)
            t0 = time.monotonic()
            time.sleep(8)
            report["16k grid redraws per second"] = page.evaluate("window.__redraws") / (time.monotonic() - t0)
            asked = run_cell(page, 3)
            report["cell during generation, s"] = wait_for_text(page, "probe 2", 30) - asked
            report["16k update in the kernel, ms"] = float(
                page.locator("text=/big update ms/").first.inner_text().split()[-1])
            page.screenshot(path=str(out / "explorer-16k.png"))

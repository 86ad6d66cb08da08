"""`commfuse report` opened in a real headless browser (Chromium from Debian's packages, driven by
Playwright's Python package; no browser download).

* The hostile page (the TP+SP Llama block's dumps with ``<script>`` planted in a refusal, a group
  name and a trace event) loads from disk without console errors, shows every section, lists
  collectives, decodes every picture and shows the planted markup as text without running it.
* The demo's program (``commfuse demo``'s 2-layer TP+SP Llama, on 4 fake ranks) and a 32-layer stack's dumps: the
  first screen (1280x800) shows the summary's figures, the gloo lowering apart, groups named by
  mesh dim and a predicted timeline; a click shows a graph at full size; the collectives stay
  one line per layer until opened. Screenshots go to ``docs/images/report-*.png``
  (docs/reports.md shows them).

Skipped locally when Chromium or Playwright is missing; under CI (``CI`` set) their absence is a
failure, because `.ci/run` installs both.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from commfuse.reports.html import write_html

from test_reports import HOSTILE, compile_dumped, plant_hostile_names

CHROMIUM = "/usr/bin/chromium"
IMAGES = Path(__file__).resolve().parents[1] / "docs" / "images"
VIEWPORT = {"width": 1280, "height": 800}


def _browser_or_skip():
    missing = []
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
        missing.append("the playwright Python package (pip install -e '.[test]')")
    if not Path(CHROMIUM).exists():
        missing.append(f"{CHROMIUM} (apt-get install chromium)")
    if missing:
        reason = "browser test needs " + " and ".join(missing)
        if os.environ.get("CI"):
            pytest.fail(reason + "; .ci/run installs them", pytrace=False)
        pytest.skip(reason)
    return sync_playwright


@pytest.fixture(scope="module")
def page_path(tmp_path_factory):
    d = tmp_path_factory.mktemp("browser")
    compile_dumped(d / "dumps")
    hostile = d / "hostile"
    shutil.copytree(d / "dumps", hostile)
    plant_hostile_names(hostile)
    return write_html(hostile, d / "report.html", title=f"report {HOSTILE}")


@pytest.mark.slow(reason="starts headless Chromium")
def test_report_page_in_chromium(page_path):
    sync_playwright = _browser_or_skip()
    console, dialogs, failed = [], [], []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            page.on("requestfailed", lambda r: failed.append(r.url))
            page.goto(page_path.as_uri(), wait_until="load")
            headings = page.locator("h2").all_inner_texts()
            page.evaluate("document.querySelectorAll('details').forEach(d => d.open = true)")
            rows = page.locator("table.collectives tr.collective")
            row_text = rows.first.inner_text()
            n_rows = rows.count()
            images = page.evaluate("Array.from(document.images).map(i => [i.complete, i.naturalWidth])")
            scripts = page.evaluate("document.querySelectorAll('script').length")
            body = page.inner_text("body")
            title = page.title()
            timelines = page.locator("svg.timeline.predicted").count()
        finally:
            browser.close()
    assert console == [], console
    assert dialogs == [] and failed == []
    assert headings == [
        "What commfuse did",
        "Communication volume",
        "Collectives",
        "Pass decisions",
        "Graphs",
        "Timelines",
    ]
    assert n_rows > 0 and ("all_gather" in row_text or "reduce_scatter" in row_text), row_text
    assert images and all(ok and w > 0 for ok, w in images), images  # every graph picture decoded
    assert timelines == 2 + 2 * 2  # as run on the first screen; before and as run under Timelines
    # planted markup is shown as text, never run
    assert scripts == 0
    assert HOSTILE in body and HOSTILE in title


# ----------------------------------------------------------------------------- the first screen
def _first_screen(page_path: Path, shot: Path | None, *, zoom_shot: Path | None = None) -> dict:
    """Open the page at 1280x800 and read what the first screen shows; click the first graph
    picture and measure it. Screenshots of both when asked."""
    sync_playwright = _browser_or_skip()
    console = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
            page.goto(page_path.as_uri(), wait_until="load")
            if shot is not None:
                page.screenshot(path=str(shot))
            figures = {
                c.get_attribute("data-figure"): (
                    c.get_attribute("data-before"),
                    c.get_attribute("data-after"),
                    c.inner_text(),
                )
                for c in page.locator("td.figure").all()
            }
            in_view = page.evaluate("""() => Array.from(document.querySelectorAll(
                'table.summary, svg.timeline.predicted, div.executor')).filter(e => {
                const r = e.getBoundingClientRect(); return r.top < innerHeight && r.bottom > 0 && r.width > 0;
            }).map(e => e.tagName.toLowerCase() + '.' + e.getAttribute('class').split(' ')[0])""")
            summary_text = page.inner_text("section:first-of-type")
            layer_blocks = page.locator("details.layer").count()
            open_layers = page.evaluate("document.querySelectorAll('details.layer[open]').length")
            zoom = None
            img = page.locator("img.graph").first
            if img.count():
                img.scroll_into_view_if_needed()
                before = img.bounding_box()["width"]
                img.click()
                page.wait_for_timeout(100)
                natural = img.evaluate("i => i.naturalWidth")
                after = img.bounding_box()["width"]
                fixed = img.evaluate("i => getComputedStyle(i.parentElement).position")
                if zoom_shot is not None:
                    page.screenshot(path=str(zoom_shot))
                img.click()  # closes again
                page.wait_for_timeout(100)
                zoom = {
                    "before": before,
                    "natural": natural,
                    "after": after,
                    "fixed": fixed,
                    "closed": img.bounding_box()["width"],
                }
        finally:
            browser.close()
    assert console == [], console
    return {
        "figures": figures,
        "in_view": in_view,
        "summary": summary_text,
        "layers": layer_blocks,
        "open_layers": open_layers,
        "zoom": zoom,
    }


@pytest.fixture(scope="module")
def demo_dumps(tmp_path_factory):
    """The demo's program (``commfuse demo``: the 2-layer TP+SP Llama, mesh dim ``tp``, gloo's
    lowering) compiled on 4 fake ranks with dumps: the demo's graphs without its processes."""
    import torch

    import commfuse
    from commfuse.models import llama
    from commfuse.testing.fake_pg import fake_mesh

    out = tmp_path_factory.mktemp("demo") / "dumps"
    with fake_mesh(4, mesh_dim_names=("tp",)) as mesh:
        commfuse.setup(mesh=mesh)
        try:
            cfg = llama.LlamaConfig(n_layers=2, dim=64, n_heads=8, ffn_dim=128)
            model = llama.parallelize_llama(llama.build_llama(cfg, seed=0), mesh, sequence_parallel=True)
            batch = llama.make_inputs(cfg, 2, 32, rank=0, world_size=4, sequence_parallel=True, seed=0)
            torch._dynamo.reset()
            be = commfuse.backend(inner_compiler="eager", dump_dir=str(out))
            compiled = torch.compile(model, backend=be, fullgraph=True)
            llama.loss_fn(compiled(batch.inputs), batch).backward()
        finally:
            commfuse.session.reset()
    return out


def _f(figures: dict, key: str) -> tuple[float, float]:
    b, a, _ = figures[key]
    return float(b), float(a)


@pytest.mark.slow(reason="compiles the demo's model and starts headless Chromium")
def test_demo_report_first_screen(demo_dumps, tmp_path):
    page_path = write_html(
        demo_dumps,
        tmp_path / "report.html",
        title="commfuse demo: TP+SP Llama (2 layers, mesh dim tp, 4 ranks)",
    )
    IMAGES.mkdir(parents=True, exist_ok=True)
    got = _first_screen(page_path, IMAGES / "report-summary.png", zoom_shot=IMAGES / "report-graph-zoom.png")
    fig = got["figures"]
    # like with like: forward vs forward, backward vs backward, and the step
    assert {
        "time-forward",
        "time-backward",
        "time-step",
        "exposed-step",
        "wire-forward",
        "wire-backward",
        "count-forward",
        "count-backward",
        "count-step",
    } <= set(fig)
    for key in ("time-step", "exposed-step"):
        b, a = _f(fig, key)
        assert 0 < a <= b * 1.001, (key, b, a)  # a prediction, never worse than before
    for g in ("forward", "backward"):
        b, a = _f(fig, f"wire-{g}")
        assert b == a > 0  # TP+SP on gloo: commfuse moves the collectives, the bytes stay
        assert _f(fig, f"count-{g}") == (
            8.0,
            8.0,
        )  # 2 layers x (attention, MLP) x (all_gather, reduce_scatter)
    # the gloo lowering is shown apart, and not in the figures above
    assert "div.executor" in got["in_view"] and "gloo_reduce_scatter" in got["summary"]
    assert "reduce_scatter → " in got["summary"] and "all_to_all" in got["summary"]
    assert "tp (mesh dim)" in got["summary"]  # the timeline's stream, named by the mesh dim
    assert "cpu-gloo" in got["summary"] and "prediction" in got["summary"]
    assert "table.summary" in got["in_view"] and "svg.timeline" in got["in_view"]
    # a click shows a graph at full size, in a fixed frame; another click closes it
    z = got["zoom"]
    assert z is not None and z["fixed"] == "fixed" and abs(z["after"] - z["natural"]) <= 4, z  # 1 px border
    assert z["before"] < z["natural"] and abs(z["closed"] - z["before"]) < 2, z


def dump_32_layers(out: Path) -> None:
    """A 32-layer TP+SP MLP stack (all_gather of the sequence, two linears, reduce_scatter back),
    traced with make_fx on 4 fake ranks and run through commfuse's scheduling pipeline with dumps:
    the forward graph a 32-layer model gives, in seconds. Graphviz is left out (a 32-layer
    picture takes minutes), so the page shows DOT sources there."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.nn as nn
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    import commfuse
    from commfuse.api import pipeline_for
    from commfuse.ir.graph_ir import CollectiveIR
    from commfuse.passmgr.base import Stage
    from commfuse.testing.fake_pg import fake_process_group

    class Layer(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.w1, self.w2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

        def forward(self, x):
            g = funcol.all_gather_single(x, 1, dist.group.WORLD)
            y = self.w2(torch.relu(self.w1(g)))
            return x + funcol.reduce_scatter_single(y, "sum", 1, dist.group.WORLD)

    class Stack(nn.Module):
        def __init__(self, n: int, d: int = 16) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Layer(d) for _ in range(n))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    with fake_process_group(4), pytest.MonkeyPatch.context() as mp:
        mp.setattr("commfuse.passmgr.dumps.dot_to_svg", lambda dot, **kw: None)
        torch.manual_seed(0)
        x = torch.randn(2, 2, 16)
        with torch.no_grad():
            gm = make_fx(Stack(32), tracing_mode="real")(x)
        FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(x)
        # make_fx records no module path in real mode: each layer holds one all_gather and one
        # reduce_scatter, in order, so the k-th pair is layers.k (what Dynamo's graphs say themselves)
        for i, c in enumerate(CollectiveIR(gm).collectives):
            c.start.meta["nn_module_stack"] = {f"layers.{i // 2}": (f"layers.{i // 2}", Layer)}
        cfg = commfuse.Config(dump_dir=str(out), group_roles={dist.group.WORLD.group_name: "tp"})
        pipeline_for(cfg).run(gm, graph_kind="forward", stages={Stage.SCHEDULE})


@pytest.mark.slow(reason="traces a 32-layer graph and starts headless Chromium")
def test_32_layer_report_first_screen(tmp_path):
    dump_32_layers(tmp_path / "dumps")
    page_path = write_html(
        tmp_path / "dumps", tmp_path / "report.html", title="commfuse report: 32-layer TP+SP stack"
    )
    got = _first_screen(page_path, IMAGES / "report-32-layers.png")
    fig = got["figures"]
    assert _f(fig, "count-forward") == (64.0, 64.0)
    b, a = _f(fig, "time-forward")
    assert 0 < a <= b * 1.001
    assert "table.summary" in got["in_view"] and "svg.timeline" in got["in_view"]
    assert "gloo_reduce_scatter" in got["summary"]
    # 64 collectives before and 64 after: one closed block per layer, not 128 rows
    assert got["layers"] == 32 and got["open_layers"] == 0

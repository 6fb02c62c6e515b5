"""`hlo-tools report` in a real browser: headless Chromium opens the page from disk.

The dump comes from a real JAX program compiled at test time: eager
initialisation (jax.random, broadcasts, ...: twenty-odd small modules that the
passes leave alone) and then the shard_map data-parallel step of
tests/helpers/real_programs.py, all under
`xla_passes.jax.enable("collective-fusion,dce", dump_to=...)`, with XLA's own
all-reduce combiners off so that collective-fusion has all-reduces to combine.
The tests check what a reader sees: graphs drawn (non-empty SVG boxes with
the combined all-reduce and the all-reduces it replaced, by name), each graph
opened on what changed, the changed module first and the others folded,
--module keeping one module, a screenshot that is not blank and shows the
graphs' colours, nothing fetched, and no console errors.

Chromium and chromedriver are Debian's `chromium` and `chromium-driver`
packages (.ci/run installs them); the driver is selenium. Where they are
missing the test skips, except under CI=true, where it fails.
"""
from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import hlo_tools
from hlo_tools import cli
from support import xla_flags_for_tests

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_ROOT = os.path.dirname(TESTS_DIR)
HELPERS_DIR = os.path.join(TESTS_DIR, "helpers")  # real_programs, which DUMP_PROGRAM imports
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1400,1000")
NO_XLA_COMBINER_FLAGS = xla_flags_for_tests("--xla_disable_hlo_passes=all-reduce-combiner,cpu-all-reduce-combiner")
# Colours the graphs use (hlo_tools.inspection.graph): a collective's fill, an added node's outline.
COLLECTIVE_FILL = (0xFF, 0xD8, 0xA8)
ADDED_STROKE = (0x2B, 0x8A, 0x3E)

DUMP_PROGRAM = """
import sys
import jax
import jax.numpy as jnp
import real_programs
import xla_passes.jax

xla_passes.jax.enable("collective-fusion,dce", dump_to=sys.argv[1])
step, args = real_programs.shard_map_mlp_step()
# Eager initialisation: each jax.random call and jnp operation is a small module of its own.
key = jax.random.key(0)
w1 = jax.random.normal(key, (16, 32)) * 0.1
w2 = jnp.clip(jax.random.uniform(jax.random.fold_in(key, 1), (32, 4)), 0.0, 0.5)
x = jnp.tanh(jnp.broadcast_to(jnp.arange(16, dtype=jnp.float32), (64, 16)) / 16)
y = jnp.exp(jnp.zeros((64, 4))) - jnp.ones((64, 4)).T.T + jnp.mean(x)
params = (jax.device_put(w1, args[0][0].sharding), jax.device_put(w2, args[0][1].sharding))
inputs = (params, jax.device_put(x, args[1].sharding), jax.device_put(y, args[2].sharding))
jax.block_until_ready(step(*inputs))
"""


def _browser_or_skip():
    """chromium, chromedriver and selenium's webdriver; a skip (a failure under CI=true) if one is missing."""
    chromium = shutil.which("chromium")
    chromedriver = shutil.which("chromedriver")
    try:
        from selenium import webdriver
    except ImportError:
        webdriver = None
    missing = [what for what, found in (("chromium", chromium), ("chromedriver", chromedriver),
                                        ("selenium", webdriver)) if found is None]
    if missing:
        message = (f"{', '.join(missing)} not installed (apt-get install chromium chromium-driver; "
                   f"pip install -e '.[test]')")
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the browser test: {message}")
        pytest.skip(message)
    return chromium, chromedriver, webdriver


@pytest.fixture(scope="module")
def browser():
    chromium, chromedriver, webdriver = _browser_or_skip()
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    profile = tempfile.mkdtemp(prefix="report-browser-")
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(chromedriver))
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def collective_fusion_dump(tmp_path_factory):
    """The dump directory of the real JAX program compiled with collective-fusion and dce: the
    step and the small modules of its initialisation."""
    dump = tmp_path_factory.mktemp("dump")
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PASSES")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=NO_XLA_COMBINER_FLAGS, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, HELPERS_DIR, env.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", DUMP_PROGRAM, str(dump)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return dump


def _combined_replaced_simplified(dump) -> tuple[list[str], list[str], list[str]]:
    """Names of the all-reduces collective-fusion made (tuple-shaped), of those it removed, and of
    those its all-reduce-simplifier turned into another op under the same name (a psum of a
    replicated value becomes a multiply; none where every reader is a fusion that multiplies
    itself, so that the psum's name goes with it)."""
    def entry(path) -> dict[str, hlo_tools.HloInstruction]:
        return {i.name: i for i in hlo_tools.parse_module(path.read_text()).entry.instructions}

    (before_path,) = dump.glob("module_*.jit_step.before_xla_passes.txt")
    (after_path,) = dump.glob("module_*.jit_step.0001.after_collective-fusion.txt")
    before, after = entry(before_path), entry(after_path)
    before_all_reduces = [name for name, instr in before.items() if instr.opcode == "all-reduce"]
    combined = [name for name, instr in after.items()
                if instr.opcode == "all-reduce" and instr.shape.is_tuple and name not in before]
    replaced = [name for name in before_all_reduces if name not in after]
    simplified = [name for name in before_all_reduces if name in after and after[name].opcode != "all-reduce"]
    assert combined and replaced, (sorted(before), sorted(after))
    return combined, replaced, simplified


def _module_number(dump, name: str) -> int:
    (before,) = dump.glob(f"module_*.{name}.before_xla_passes.txt")
    return int(before.name.split(".")[0].removeprefix("module_"))


def test_report_renders_in_chromium_with_graphs_and_no_console_errors(browser, collective_fusion_dump,
                                                                      tmp_path, capsys):
    combined, replaced, simplified = _combined_replaced_simplified(collective_fusion_dump)
    page = tmp_path / "report.html"
    assert cli.main(["report", str(collective_fusion_dump), "-o", str(page), "--module", "jit_step"]) == 0
    assert "1 module, 3 steps" in capsys.readouterr().out

    browser.get(page.as_uri())
    assert browser.execute_script("return document.readyState") == "complete"
    assert browser.title == f"HLO dump report: {collective_fusion_dump}"
    assert browser.execute_script("""return [...document.querySelectorAll('section.module h2')]
                                      .map(h => h.textContent)""") == [
        f"module_{_module_number(collective_fusion_dump, 'jit_step'):04d} jit_step (xla_passes)"]

    # Every graph is drawn: a non-empty box holding nodes with text.
    graphs = browser.execute_script("""
        return [...document.querySelectorAll('svg.hlo-graph')].map(svg => {
            const box = svg.getBoundingClientRect();
            const nodes = [...svg.querySelectorAll('g.node')];
            return {width: box.width, height: box.height, nodes: nodes.length,
                    drawn: nodes.filter(g => { const b = g.getBBox(); return b.width > 20 && b.height > 20; }).length,
                    texts: nodes.map(g => g.querySelector('text').textContent)};
        });""")
    assert len(graphs) >= 2  # the collective-fusion step's before and after
    for drawn in graphs:
        assert drawn["width"] > 200 and drawn["height"] > 100, drawn
        assert drawn["nodes"] > 0 and drawn["drawn"] == drawn["nodes"], drawn
        assert all(drawn["texts"]), drawn

    def side_nodes(side: str) -> dict[str, str]:
        return dict(browser.execute_script(f"""
            const step = [...document.querySelectorAll('section.pass')]
                .find(s => s.querySelector('h3').textContent.startsWith('collective-fusion'));
            return [...step.querySelectorAll('.side.{side} g.node')]
                .map(g => [g.dataset.name, g.getAttribute('class')]);"""))

    after, before = side_nodes("after"), side_nodes("before")
    for name in combined:  # the new tuple all-reduces: highlighted as collectives, marked added
        assert set(after[name].split()) >= {"node", "collective", "added"}, after.get(name)
    for name in replaced:  # the all-reduces they replace, on the before side, marked removed
        assert set(before[name].split()) >= {"node", "collective", "removed"}, before.get(name)
    for name in simplified:  # the same name on both sides, a collective only before: marked changed
        assert set(before[name].split()) >= {"node", "collective", "changed"}, before.get(name)
        assert "changed" in after[name].split() and "collective" not in after[name].split(), after.get(name)

    # What the reader sees: scroll the combined all-reduce into view and take a screenshot.
    node = browser.find_element("css selector", f'.side.after g.node[data-name="{combined[0]}"]')
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", node)
    assert node.is_displayed() and combined[0] in node.text
    from PIL import Image

    pixels = np.asarray(Image.open(io.BytesIO(browser.get_screenshot_as_png())).convert("RGB")).reshape(-1, 3)
    assert pixels.std() > 20  # not a blank page
    assert len(np.unique(pixels, axis=0)) > 50
    for colour in (COLLECTIVE_FILL, ADDED_STROKE):
        assert (pixels == colour).all(axis=1).sum() > 50, f"no {colour} pixels: graphs not drawn"

    # "fit graphs to width" (CSS only) shrinks every graph into its box.
    def widest_overflow() -> float:
        return browser.execute_script("""
            return Math.max(...[...document.querySelectorAll('.side svg.hlo-graph')].map(
                svg => svg.getBoundingClientRect().width - svg.parentElement.clientWidth));""")

    assert widest_overflow() > 0  # the after graph is wider than its half of the page
    browser.find_element("css selector", "label.fit").click()
    assert widest_overflow() <= 0

    # Self-contained: nothing was fetched, and the console has no errors.
    assert browser.execute_script("return performance.getEntriesByType('resource').length") == 0
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert errors == []


# Where each node and its graph box are on screen: the box's inside (client area, without its
# scroll bars) and the node's bounding box, in viewport coordinates.
NODE_AND_BOX_GEOMETRY = """
    const geometry = (node) => {
        const box = node.closest('.side'), outer = box.getBoundingClientRect(), rect = node.getBoundingClientRect();
        const left = outer.left + box.clientLeft, top = outer.top + box.clientTop;
        return {name: node.dataset.name, box: [left, top, left + box.clientWidth, top + box.clientHeight],
                node: [rect.left, rect.top, rect.right, rect.bottom],
                scrolled: [box.scrollLeft, box.scrollTop], scrollable: [box.scrollWidth > box.clientWidth,
                                                                        box.scrollHeight > box.clientHeight]};
    };
"""


def _inside(geometry: dict) -> bool:
    (left, top, right, bottom), (x1, y1, x2, y2) = geometry["box"], geometry["node"]
    return left <= x1 and x2 <= right and top <= y1 and y2 <= bottom


def test_many_modules_changed_first_unchanged_folded_graphs_open_on_the_change(browser, collective_fusion_dump,
                                                                                tmp_path, capsys):
    modules = [path.name.split(".")[1] for path in collective_fusion_dump.glob("*.before_xla_passes.txt")]
    assert len(modules) >= 20 and "jit_step" in modules and "jit__normal" in modules
    page = tmp_path / "report.html"
    assert cli.main(["report", str(collective_fusion_dump), "-o", str(page), "--hops", "2"]) == 0
    assert f"{len(modules)} modules" in capsys.readouterr().out
    browser.get(page.as_uri())

    # The step, which collective-fusion changed, is the first module; the others are folded into one line.
    order = browser.execute_script("""
        const folded = document.querySelector('details#unchanged-modules');
        return {sections: [...document.querySelectorAll('section.module')].map(s => ({
                    title: s.querySelector('h2').textContent, folded: folded.contains(s),
                    changed: s.querySelectorAll('section.pass').length})),
                summary: folded.querySelector('summary').textContent, open: folded.open,
                visible: [...document.querySelectorAll('section.module')].filter(s => s.checkVisibility()).length};""")
    sections = order["sections"]
    assert sections[0]["title"].endswith("jit_step (xla_passes)") and sections[0]["changed"] >= 1
    assert not sections[0]["folded"] and all(s["folded"] and s["changed"] == 0 for s in sections[1:])
    assert order["summary"].startswith(f"{len(sections) - 1} unchanged modules: ") and "jit__normal" in order["summary"]
    assert not order["open"] and order["visible"] == 1

    # Every graph box of the step opens scrolled to what changed: the first marked node (the script
    # centres on all of them when they fit) lies inside the box's visible part, and for some box only
    # because it was scrolled there.
    opened = browser.execute_script(NODE_AND_BOX_GEOMETRY + """
        return [...document.querySelectorAll('section.pass .side')].map(box =>
            box.querySelector('g.node.added, g.node.removed, g.node.changed')).filter(n => n).map(geometry);""")
    assert len(opened) >= 2
    for geometry in opened:
        assert _inside(geometry), geometry
    assert any(any(g["scrolled"]) for g in opened), opened
    assert all(sum(g["scrolled"]) == 0 for g in opened if not any(g["scrollable"]))

    # The side panel lists the combined all-reduce: its link outlines the node (CSS :target) in view,
    # its diff link opens the text diff at its line.
    combined, replaced, _ = _combined_replaced_simplified(collective_fusion_dump)
    item = browser.find_element("css selector", f'aside.changes li.added[data-name="{combined[0]}"]')
    item.find_element("link text", "after").click()
    target = browser.execute_script(NODE_AND_BOX_GEOMETRY + """
        const node = document.querySelector(':target');
        return node && Object.assign(geometry(node), {classes: node.getAttribute('class')});""")
    assert target["name"] == combined[0] and "added" in target["classes"].split() and _inside(target), target
    item.find_element("link text", "diff").click()
    line = browser.execute_script("""const line = document.querySelector(':target');
        return [line.textContent, line.closest('details').open];""")
    assert line[0].startswith("+") and f"{combined[0]} = " in line[0] and line[1], line
    removed = browser.find_element("css selector", f'aside.changes li.removed[data-name="{replaced[0]}"]')
    assert [a.text for a in removed.find_elements("css selector", "a")] == ["before", "diff"]

    assert browser.execute_script("return performance.getEntriesByType('resource').length") == 0
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []

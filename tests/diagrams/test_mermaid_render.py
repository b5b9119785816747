"""The README's Mermaid diagram as Mermaid 11 draws it, in headless Chromium.

Needs Debian's `chromium` and a pinned Mermaid from npm (`.ci/run` installs both: `npm pack mermaid@11.17.2`, then
KVSTATE_MERMAID_JS names its `package/dist/mermaid.min.js`); without them the render test is skipped, saying why.
A page holds the diagram and a probe that reports, through the console, every state box, every edge path (as points)
and every edge label (its text lines' boxes and its background). Checked: every transition line is drawn with its
label, the self-loop of the state that defers events carries every deferred label (and the offload loop of the held
state its own), the bundle's pseudo-node is a point with no text (not a state), no label overlaps another label or
a state, and every label is opaque enough (alpha >= 0.9) that an edge Mermaid's layout passes under it cannot strike
its text through.

Without a browser, every character the diagrams draw is checked against the glyphs common fonts have.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvstate.diagrams import render_sources
from kvstate.diagrams.dot import COMMON_GLYPHS
from kvstate.diagrams.ir import EdgeKind
from kvstate.diagrams.mermaid import ANY_STATE_ID, KIND_MARKS, LOOP_JOIN
from kvstate.spec import load_spec

MERMAID_VERSION = "11.17.2"  # the version .ci/run installs; GitHub renders README diagrams with Mermaid 11
MERMAID_JS = os.environ.get("KVSTATE_MERMAID_JS", "")
BROWSER = next((shutil.which(n) for n in ("chromium", "chromium-browser") if shutil.which(n)), None)
CONSOLE = re.compile(r':CONSOLE(?::\d+|\(\d+\))\] "PROBE (?P<json>.*)", source:')
TRANSITION = re.compile(r"^\s*(?P<source>\S+) --> (?P<dest>\S+)(?: : (?P<label>.*))?$")

PROBE = """
function probe() {
  var svg = document.querySelector('pre.mermaid svg');
  function box(r) { return [r.left, r.top, r.right, r.bottom]; }
  function alpha(el) {
    var m = getComputedStyle(el).backgroundColor.match(/rgba?\\(([^)]*)\\)/);
    if (!m) { return 0; }
    var parts = m[1].split(',');
    return parts.length === 4 ? parseFloat(parts[3]) : 1;
  }
  var nodes = [], labels = [], paths = [];
  svg.querySelectorAll('g.node').forEach(function (g) {
    nodes.push({id: g.id, box: box(g.getBoundingClientRect()), text: g.textContent.trim()});
  });
  svg.querySelectorAll('g.edgeLabel').forEach(function (g) {
    var text = g.textContent.trim();
    if (!text) { return; }
    var inner = g.querySelector('p') || g.querySelector('span') || g;
    var clear = 1;
    [g.querySelector('span'), g.querySelector('p')].forEach(function (e) { if (e) { clear *= 1 - alpha(e); } });
    labels.push({text: text, box: box(inner.getBoundingClientRect()), opacity: 1 - clear});
  });
  svg.querySelectorAll('g.edgePaths path').forEach(function (p) {
    var total = p.getTotalLength(), m = p.getScreenCTM(), pts = [];
    for (var d = 0; d <= total; d += 3) {
      var q = p.getPointAtLength(d), s = svg.createSVGPoint();
      s.x = q.x; s.y = q.y; s = s.matrixTransform(m);
      pts.push([s.x, s.y]);
    }
    paths.push(pts);
  });
  return {nodes: nodes, labels: labels, paths: paths};
}
mermaid.initialize({startOnLoad: false, securityLevel: 'strict'});
mermaid.run().then(function () { console.log('PROBE ' + JSON.stringify(probe())); })
  .catch(function (e) { console.log('PROBE ' + JSON.stringify({error: String(e && e.message || e)})); });
"""


def test_the_diagrams_draw_only_glyphs_common_fonts_have() -> None:
    """ASCII and `COMMON_GLYPHS` only (Liberation Sans, Arial and DejaVu Sans have them all): the marks that
    rendered as empty boxes are gone."""
    for name, text in render_sources(load_spec()).items():
        odd = sorted({c for c in text if ord(c) > 127 and c not in COMMON_GLYPHS})
        assert odd == [], f"{name} draws {odd}"


def rendered(tmp_path: Path, source: str) -> dict:
    page = tmp_path / "mermaid.html"
    page.write_text(
        '<!DOCTYPE html><html><head><meta charset="utf-8">'
        f'<script src="{Path(MERMAID_JS).resolve().as_uri()}"></script></head>'
        f'<body><pre class="mermaid">{html.escape(source)}</pre><script>{PROBE}</script></body></html>',
        encoding="utf-8",
    )
    done = subprocess.run(
        [
            BROWSER,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--enable-logging=stderr",
            "--v=0",
            "--window-size=1280,2000",
            "--virtual-time-budget=20000",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    found = CONSOLE.search(done.stderr)
    assert found, f"the page reported nothing: {done.stderr[-2000:]}"
    data = json.loads(found["json"])
    assert "error" not in data, data
    return data


def overlap(a, b) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


@pytest.mark.skipif(BROWSER is None, reason="needs Debian's chromium (apt-get install chromium)")
@pytest.mark.skipif(
    not Path(MERMAID_JS).is_file(),
    reason=f"needs Mermaid {MERMAID_VERSION}: set KVSTATE_MERMAID_JS to its dist/mermaid.min.js (npm pack mermaid)",
)
def test_mermaid_11_draws_every_transition_without_overprinting(tmp_path: Path) -> None:
    assert f'"{MERMAID_VERSION}"' in Path(MERMAID_JS).read_text(encoding="utf-8"), "the pinned version"
    source = render_sources(load_spec())["lifecycle.mmd"]
    lines = [m for line in source.splitlines() if (m := TRANSITION.match(line))]
    data = rendered(tmp_path, source)
    labelled = [m for m in lines if m["label"]]
    assert len(data["paths"]) == len(lines), "one path per transition line"
    texts = [label["text"] for label in data["labels"]]
    assert len(texts) == len(labelled), "one label per labelled transition line"
    for m in labelled:
        first = m["label"].split(LOOP_JOIN)[0]
        assert any(first.split(" ")[0] in text for text in texts)
    loops = [m for m in lines if m["source"] == m["dest"]]
    deferring = [m for m in loops if m["label"].startswith(KIND_MARKS[EdgeKind.DEFER])]
    assert deferring, "the spec defers events in a state: a self-loop"
    assert len(loops) > len(deferring), "and offloads held blocks in another: a self-loop that moves the KV it keeps"
    for loop in loops:
        parts = loop["label"].split(LOOP_JOIN)
        deferred = [p.startswith(KIND_MARKS[EdgeKind.DEFER]) for p in parts]
        assert (len(parts) >= 2 and all(deferred)) if loop in deferring else not any(deferred)
        drawn = next(text for text in texts if parts[0][:20] in text)
        assert all(part.split(" / ")[0].split(" ", 1)[-1] in drawn for part in parts), "every deferred event"
        state = next(n for n in data["nodes"] if f"-state-{loop['source']}-" in n["id"])
        near = [
            p
            for p in data["paths"]
            if all(overlap((x - 1, y - 1, x + 1, y + 1), state["box"]) for x, y in (p[0], p[-1]))
        ]
        assert near, "the self-loop is drawn: a path that leaves and enters its state"
    bundle = next(n for n in data["nodes"] if f"-state-{ANY_STATE_ID}-" in n["id"])
    assert bundle["text"] == "", "the bundle's pseudo-node is a point, not a state box"
    states = [n for n in data["nodes"] if n["text"]]
    for i, label in enumerate(data["labels"]):
        assert label["opacity"] >= 0.9, label
        for other in data["labels"][i + 1 :]:
            assert not overlap(label["box"], other["box"]), (label["text"], other["text"])
        for state in states:
            assert not overlap(label["box"], state["box"]), (label["text"], state["text"])

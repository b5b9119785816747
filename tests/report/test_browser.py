"""report.html in a real headless browser (Chromium), where one is installed: it renders, logs no console message,
opens every diagram fitted to the width of a 1280 px window with its edge labels still at >= 11 CSS px,
and its zoom buttons work.

A copy of the page gets a probe script appended that measures in the browser and reports through the console
(`PROBE ...` lines); every other console line is an error of the page itself.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from kvstate.report.html import MIN_LABEL_PX

BROWSER = next(
    (shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome") if shutil.which(name)), None
)
pytestmark = pytest.mark.skipif(
    BROWSER is None or shutil.which("dot") is None, reason="needs Chromium and Graphviz `dot` installed"
)
WINDOW = "1280,2000"  # the default page width
CONSOLE = re.compile(r":CONSOLE(?::\d+|\(\d+\))\] \"(?P<message>.*)\", source: (?P<source>.*)")

PROBE = """<script>
(function () {
  var result = [];
  document.querySelectorAll('.diagram').forEach(function (box) {
    var svg = box.querySelector('svg'), scale = svg.getScreenCTM().a, smallest = Infinity;
    svg.querySelectorAll('text').forEach(function (t) {
      smallest = Math.min(smallest, parseFloat(t.getAttribute('font-size')) * scale);
    });
    var before = svg.getBoundingClientRect().width;
    var bar = document.querySelector('.zoom[data-target="' + box.id + '"]');
    bar.querySelector('[data-zoom="fit"]').click();
    var fitted = svg.getBoundingClientRect().width;
    bar.querySelector('[data-zoom="natural"]').click();
    result.push({box: box.id, smallest_px: smallest, opened: before, fitted: fitted,
                 natural: svg.viewBox.baseVal.width * 4 / 3,
                 restored: svg.getBoundingClientRect().width, box_width: box.clientWidth});
  });
  console.log('PROBE ' + JSON.stringify(result));
})();
</script>"""


def run_browser(page, screenshot):
    done = subprocess.run(
        [
            BROWSER,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--enable-logging=stderr",
            "--v=0",
            f"--window-size={WINDOW}",
            f"--screenshot={screenshot}",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    messages = [match for line in done.stderr.splitlines() if (match := CONSOLE.search(line))]
    return done, messages


def test_page_renders_legibly_without_console_messages(small_report, tmp_path):
    """One browser run (a few seconds): the probed copy differs from the page only by the probe script."""
    probed = small_report.html.with_name("probed.html")
    probed.write_text(small_report.html.read_text().replace("</body>", PROBE + "</body>"))
    screenshot = tmp_path / "page.png"
    done, messages = run_browser(probed, screenshot)
    assert done.returncode == 0, done.stderr[-2000:]
    errors = [m["message"] for m in messages if not m["message"].startswith("PROBE ")]
    assert errors == [], "the page logged to the console"
    data = screenshot.read_bytes()
    assert data[:4] == b"\x89PNG" and len(data) > 20_000, "a blank screenshot is a few kB"
    probes = [json.loads(m["message"].removeprefix("PROBE ")) for m in messages if m["message"].startswith("PROBE ")]
    assert len(probes) == 1 and len(probes[0]) == 2, done.stderr[-2000:]
    for box in probes[0]:
        assert box["smallest_px"] >= MIN_LABEL_PX, box
        assert box["opened"] <= box["box_width"] + 1, f"opens fitted to the 1280 px window: {box}"
        if box["natural"] > box["box_width"]:
            assert box["fitted"] <= box["box_width"] + 1, box
        assert abs(box["restored"] - box["natural"]) < 1, box

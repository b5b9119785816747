"""Escapes at their edges: each test kills a mutant the suite let through."""

from __future__ import annotations

import pytest

from kvstate.diagrams.escape import md_text, safe_svg


def test_an_ampersand_in_markdown_renders_literally():
    assert md_text("&amp; & &lt;") == "&amp;amp; &amp; &amp;lt;"
    markdown_it = pytest.importorskip("markdown_it")
    html = markdown_it.MarkdownIt("commonmark").render(md_text("a &amp; b"))
    assert html.strip() == "<p>a &amp;amp; b</p>"  # shows "&amp;", as the spec's meaning says


@pytest.mark.parametrize(
    "value", ["data:image/png;base64,AAAA", "DATA:text/html,x", "url(#x)", "javascript:alert(1)", "expression(x)"]
)
def test_safe_svg_drops_an_attribute_holding_an_active_value(value):
    clean = safe_svg(f'<svg xmlns="http://www.w3.org/2000/svg"><polygon fill="{value}" stroke="black"/></svg>')
    assert 'stroke="black"' in clean and "fill" not in clean and value.split(":")[0].lower() not in clean.lower()

"""Every relative link of README.md and of the docs/ pages leads somewhere: the file exists, and a `#anchor` names a
heading of the page it points into (as GitHub makes anchors of headings)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCED = re.compile(r"^```.*?^```$", flags=re.S | re.M)


def links(page: Path) -> list[str]:
    """The relative link targets of `page`, outside fenced code blocks."""
    text = FENCED.sub("", page.read_text(encoding="utf-8"))
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of `page`: lower case, punctuation dropped, spaces as hyphens."""
    text = FENCED.sub("", page.read_text(encoding="utf-8"))
    headings = re.findall(r"^#+ (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def test_the_readme_links_to_every_page_under_docs():
    linked = {(ROOT / target.split("#")[0]).resolve() for target in links(ROOT / "README.md")}
    assert {page.resolve() for page in (ROOT / "docs").glob("*.md")} <= linked


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_every_relative_link_leads_somewhere(page: Path):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{target}: no heading {anchor!r} in {destination.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)

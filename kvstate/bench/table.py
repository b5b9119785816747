"""The rich table of every figure and the JSON document of a run."""

from __future__ import annotations

import json
import math
from pathlib import Path

from kvstate.bench.results import Section


def document(sections: list[Section], meta: dict) -> dict:
    """The JSON-ready record of a run: metadata, then every section's rows (with ratios) and raw data."""
    return {"meta": meta, "sections": [section.to_dict() for section in sections]}


def write_json(doc: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, allow_nan=False, default=_finite) + "\n", encoding="utf-8")
    return path


def _finite(value: object) -> object:
    raise TypeError(f"not JSON serializable: {value!r}")


def _num(x: float) -> str:
    if math.isnan(x):
        return "-"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.3g}" if abs(x) < 1 else f"{x:.2f}"


def render_table(sections: list[Section], title: str):
    """One row per figure: measured value, baseline measured beside it, ratio, target and verdict."""
    from rich.table import Table

    table = Table(title=title, show_lines=False)
    for name, justify in (("group", "left"), ("figure", "left"), ("ours", "right"), ("baseline (same run)", "right"),
                          ("ratio", "right"), ("target", "left"), ("met", "center"), ("note", "left")):
        table.add_column(name, justify=justify, overflow="fold")
    for section in sections:
        for row in section.rows:
            verdict = "" if row.met is None else ("[green]yes[/green]" if row.met else "[red]no[/red]")
            arrow = "↑" if row.better == "higher" else "↓"
            table.add_row(row.group, row.name, f"{_num(row.value)} {row.unit}",
                          f"{_num(row.baseline)} {row.unit}  {row.baseline_name}", f"{_num(row.ratio)} {arrow}",
                          row.target, verdict, row.note)
        table.add_section()
    return table

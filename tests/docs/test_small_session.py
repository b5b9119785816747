"""The README's small session runs under memory pressure through both preemption paths: its demo's
trace has a suspension and a recompute-pause (events found by the roles of the states they leave and enter)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from kvstate.roles import ACTIVE, DROPPED, OFFLOADED, PENDING_RESET

README = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")


def test_the_small_session_takes_both_preemption_paths(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from kvstate import load_spec
    from kvstate.cli import main
    from kvstate.trace import read_trace

    session = re.search(r"A small session.*?```bash\n(.*?)```", README, flags=re.S)[1]
    demo = shlex.split(next(line for line in session.splitlines() if line.startswith("kvstate demo")))
    trace = tmp_path / "demo.ndjson"
    args = [*demo[1 : demo.index("--trace")], "--trace", str(trace)]
    assert main(args) == 0
    spec = load_spec()
    moves = {(line["from"], line["to"]) for line in read_trace(trace)}
    assert (spec.role(ACTIVE), spec.role(OFFLOADED)) in moves, "a suspension"
    assert {(spec.role(ACTIVE), spec.role(DROPPED)), (spec.role(ACTIVE), spec.role(PENDING_RESET))} & moves

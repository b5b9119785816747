"""`kvstate diagram --diff` and `kvstate check --diff` on real spec changes: a guard tightened, an edge
added, a policy rule changed; and a counterexample written as a trace that `kvstate report` draws."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import tomli_w

from kvstate.cli import main
from kvstate.diagrams.diff import ADDED, CHANGED, diff_specs, render_diff_dot, summary_markdown
from kvstate.spec import load_spec, packaged_spec_path


def changed(tmp_path: Path, name: str, change) -> Path:
    data = tomllib.loads(packaged_spec_path().read_text(encoding="utf-8"))
    change(data)
    path = tmp_path / f"{name}.toml"
    path.write_text(tomli_w.dumps(data), encoding="utf-8")
    return path


def event(data: dict, name: str) -> dict:
    return next(e for e in data["events"] if e["name"] == name)


def tighten_admit(data: dict) -> None:
    event(data, "admit")["transitions"][0]["guard"] = "gpu_room_for_offloaded_blocks"


def add_edge(data: dict) -> None:
    event(data, "lose_host_copy")["transitions"].append(
        {"source": ["replaying"], "dest": "recompute_paused", "effect": "release_kv_and_reset"}
    )


def drop_exclusion(data: dict) -> None:
    data["policy"]["victim_exclusions"] = [x for x in data["policy"]["victim_exclusions"] if x != "about_to_finish"]


def test_a_guard_tightened_an_edge_added_and_a_policy_rule_changed_are_named(tmp_path: Path) -> None:
    old = load_spec()
    for name, change, expected in (
        ("tightened", tighten_admit, CHANGED),
        ("added", add_edge, ADDED),
    ):
        new = load_spec(changed(tmp_path, name, change))
        diff = diff_specs(old, new)
        assert [c.change for c in diff.edges] == [expected], diff
        dot, summary = render_diff_dot(old, new, diff), summary_markdown(old, new, diff)
        assert f"[{expected}]" in dot and f"| {expected} |" in summary
    tightened = diff_specs(old, load_spec(changed(tmp_path, "t2", tighten_admit)))
    assert tightened.edges[0].details == ("guard gpu_room_for_first_chunk → gpu_room_for_offloaded_blocks",)
    policy = diff_specs(old, load_spec(changed(tmp_path, "policy", drop_exclusion)))
    assert [rule for rule, _, _ in policy.policy] == ["victim_exclusions"] and not policy.edges
    assert diff_specs(old, old).empty and "No transition" in summary_markdown(old, old)


def test_diagram_diff_command_writes_the_picture_and_the_summary(tmp_path: Path, capsys) -> None:
    new = changed(tmp_path, "tightened", tighten_admit)
    assert main(["diagram", "--diff", str(packaged_spec_path()), str(new), "--out", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert "| changed | `admit` |" in out
    assert (tmp_path / "d" / "spec-diff.md").read_text().startswith("### Spec change")
    assert "[changed]" in (tmp_path / "d" / "spec-diff.dot").read_text()


def no_release_at_finish(data: dict) -> None:
    event(data, "finish")["transitions"][0].pop("effect")


@pytest.mark.skipif(pytest.importorskip("matplotlib") is None, reason="needs matplotlib")
def test_check_diff_names_the_verdicts_that_changed_and_draws_the_counterexample(tmp_path: Path, capsys) -> None:
    broken = changed(tmp_path, "leaky", no_release_at_finish)
    code = main(
        [
            "check",
            "--bound",
            "no_host",
            "--spec",
            str(broken),
            "--diff",
            str(packaged_spec_path()),
            "--counterexample-dir",
            str(tmp_path / "cx"),
            "--no-refinement",
        ]
    )
    out = capsys.readouterr().out
    assert code == 1 and "invariant(s) changed" in out and "holds -> violated (no_host)" in out
    traces = list((tmp_path / "cx").glob("*.ndjson"))
    assert len(traces) == 1 and f"wrote counterexample trace {traces[0]}" in out
    assert "counterexample drawn: file://" in out
    page = next((tmp_path / "cx").glob("*-report/report.html"))
    assert "data:image/png;base64," in page.read_text()
    from kvstate.trace import read_trace

    lines = list(read_trace(traces[0]))
    assert lines and lines[-1]["event"] == "finish", "the trace ends at the transition that broke the invariant"

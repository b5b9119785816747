"""`kvstate diagram --diff` on proposals that do not validate: a transition dropped with the only use of its guard,
a guard renamed. The change is drawn, the new spec's validation problems are listed in the picture, in the summary
and on stderr, and the exit status is 1; a new spec whose structure cannot be drawn is unusable input (2)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import tomli_w

from kvstate.cli import main
from kvstate.diagrams.diff import REMOVED, diff_specs
from kvstate.errors import SpecError
from kvstate.spec import load_spec, packaged_spec_path
from kvstate.validate import spec_problems

DRAWN_BUT_INVALID, UNUSABLE = 1, 2


def _data() -> dict:
    return tomllib.loads(packaged_spec_path().read_text(encoding="utf-8"))


def _write(tmp_path: Path, name: str, data: dict) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(tomli_w.dumps(data), encoding="utf-8")
    return path


def _guard_uses(spec) -> dict[str, int]:
    uses: dict[str, int] = {}
    for t in spec.transitions:
        if t.guard is not None:
            uses[t.guard] = uses.get(t.guard, 0) + 1
    return uses


def dropped_event(tmp_path: Path) -> tuple[Path, str, str]:
    """The packaged spec without an event of one transition whose guard no other transition uses; (path, event,
    guard)."""
    spec = load_spec()
    uses = _guard_uses(spec)
    event = next(e for e in spec.events if len(e.transitions) == 1 and uses.get(e.transitions[0].guard) == 1)
    data = _data()
    data["events"] = [e for e in data["events"] if e["name"] != event.name]
    return _write(tmp_path, "dropped", data), event.name, event.transitions[0].guard


def renamed_guard(tmp_path: Path) -> tuple[Path, str, str]:
    """The packaged spec with a guard used once renamed; (path, old name, new name)."""
    spec = load_spec()
    guard = next(g for g, n in sorted(_guard_uses(spec).items()) if n == 1)
    data = _data()
    for event in data["events"]:
        for t in event["transitions"]:
            if t.get("guard") == guard:
                t["guard"] = f"{guard}_renamed"
    return _write(tmp_path, "renamed", data), guard, f"{guard}_renamed"


def _diff(tmp_path: Path, new: Path, capsys) -> tuple[int, str, str, str, str]:
    out = tmp_path / f"{new.stem}-diff"
    code = main(["diagram", "--diff", str(packaged_spec_path()), str(new), "--out", str(out)])
    captured = capsys.readouterr()
    dot = (out / "spec-diff.dot").read_text(encoding="utf-8") if (out / "spec-diff.dot").exists() else ""
    md = (out / "spec-diff.md").read_text(encoding="utf-8") if (out / "spec-diff.md").exists() else ""
    return code, dot, md, captured.out, captured.err


def _problems(path: Path) -> list[str]:
    try:
        load_spec(path)
    except SpecError:
        pass
    else:
        raise AssertionError(f"{path} validates; the test needs a proposal that does not")
    problems = spec_problems(load_spec(path, validate=False))
    assert problems
    return problems


def test_a_dropped_transition_is_drawn_with_the_unused_guard_listed(tmp_path: Path, capsys) -> None:
    path, event, guard = dropped_event(tmp_path)
    problems = _problems(path)
    assert any(guard in p for p in problems)
    code, dot, md, out, err = _diff(tmp_path, path, capsys)
    assert code == DRAWN_BUT_INVALID
    diff = diff_specs(load_spec(), load_spec(path, validate=False))
    assert [c.change for c in diff.edges if c.key[0] == event] == [REMOVED]
    assert "[removed]" in dot and "NOT WELL FORMED" in dot and guard in dot.split("NOT WELL FORMED", 1)[1]
    assert "not well formed" in md and "| removed |" in md
    assert "not well formed" in err and all(p in err for p in problems)
    assert "Spec change" in out


def test_a_renamed_guard_is_drawn_as_a_change_with_both_problems_listed(tmp_path: Path, capsys) -> None:
    path, old_name, new_name = renamed_guard(tmp_path)
    problems = _problems(path)
    assert any(old_name in p and new_name not in p for p in problems)  # the old one is unused
    assert any(new_name in p for p in problems)  # the new one has no semantics
    code, dot, md, _, err = _diff(tmp_path, path, capsys)
    assert code == DRAWN_BUT_INVALID
    assert "[changed]" in dot and f"guard {old_name} → {new_name}" in dot
    legend = dot.split("NOT WELL FORMED", 1)[1]
    assert "problem 1" in legend and "problem 2" in legend
    assert md.count("\n* ") >= len(problems) and all(p in err for p in problems)


def test_a_well_formed_change_still_exits_0_and_an_undrawable_one_2(tmp_path: Path, capsys) -> None:
    data = _data()
    data["policy"]["victim_exclusions"] = data["policy"]["victim_exclusions"][1:]
    code, dot, md, _, err = _diff(tmp_path, _write(tmp_path, "policy", data), capsys)
    assert code == 0 and "NOT WELL FORMED" not in dot and "not well formed" not in md + err
    broken = _data()
    broken["events"][0]["transitions"][0]["dest"] = "no_such_state"
    code, dot, _, _, err = _diff(tmp_path, _write(tmp_path, "broken", broken), capsys)
    assert code == UNUSABLE and dot == "" and "no_such_state" in err

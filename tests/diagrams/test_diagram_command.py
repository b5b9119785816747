"""`kvstate diagram`: writing, `--check`, errors and SVG rendering, called through `kvstate.cli.main`."""

from __future__ import annotations

import shutil
from pathlib import Path
from xml.etree import ElementTree

import pytest

from kvstate.cli import main
from kvstate.diagrams import SVG_FILE, SVG_FILES, TEXT_FILES
from kvstate.spec import load_spec, packaged_spec_path

DIAGRAMS = Path(__file__).parents[2] / "diagrams"


def test_out_writes_files_identical_to_the_committed_ones(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagram", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.splitlines()
    for name in TEXT_FILES:
        assert (tmp_path / name).read_bytes() == (DIAGRAMS / name).read_bytes()
        assert f"wrote {tmp_path / name}" in printed
    assert len(printed) == len(TEXT_FILES) + len(SVG_FILES), "one line per file written, plus one per SVG"


def test_check_passes_on_the_committed_files(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagram", "--check", "--out", str(DIAGRAMS)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"ok: {DIAGRAMS / name}" for name in TEXT_FILES]


def test_check_fails_with_a_diff_when_a_label_changes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    event = load_spec().events[0]
    original = f'label = "{event.label}"'
    changed = f'label = "{event.label} renamed"'
    text = packaged_spec_path().read_text(encoding="utf-8")
    assert text.count(original) == 1
    modified = tmp_path / "lifecycle.toml"
    modified.write_text(text.replace(original, changed), encoding="utf-8")

    assert main(["diagram", "--spec", str(modified), "--check", "--out", str(DIAGRAMS)]) == 1
    out = capsys.readouterr().out
    assert "DIFFERS:" in out
    assert any(line.startswith("+") and f"{event.label} renamed" in line for line in out.splitlines())
    assert any(
        line.startswith("-") and f"{event.label} renamed" not in line and event.label in line
        for line in out.splitlines()
        if not line.startswith("---")
    )


def test_check_counts_missing_files_as_differing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagram", "--check", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert all(f"--- {tmp_path / name} (missing)" in out for name in TEXT_FILES)
    assert not any(tmp_path.iterdir()), "--check writes nothing"


def test_unreadable_spec_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "absent.toml"
    assert main(["diagram", "--spec", str(missing), "--out", str(tmp_path / "out")]) == 2
    assert f"--spec {missing} does not exist" in capsys.readouterr().err  # checked before any work
    assert not (tmp_path / "out").exists()


def test_svg_is_skipped_with_a_message_without_dot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    assert main(["diagram", "--out", str(tmp_path)]) == 0
    assert f"skipped {tmp_path / SVG_FILE}: Graphviz `dot` is not installed" in capsys.readouterr().out
    assert not (tmp_path / SVG_FILE).exists()
    assert all((tmp_path / name).exists() for name in TEXT_FILES)


def test_svg_parses_and_names_every_state(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if shutil.which("dot") is None:
        pytest.skip("Graphviz `dot` is not installed; SVG rendering is skipped")
    assert main(["diagram", "--out", str(tmp_path)]) == 0
    assert f"wrote {tmp_path / SVG_FILE}" in capsys.readouterr().out
    root = ElementTree.parse(tmp_path / SVG_FILE).getroot()
    texts = {element.text for element in root.iter() if element.text}
    for state in load_spec().states:
        assert state.name in texts, f"state {state.name} is not drawn in the SVG"


def test_all_edges_draws_every_transition_and_the_default_bundles(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = load_spec()
    assert main(["diagram", "--all-edges", "--out", str(tmp_path / "all")]) == 0
    assert main(["diagram", "--out", str(tmp_path / "bundled")]) == 0
    capsys.readouterr()

    def arrows(directory: Path) -> int:
        return sum(" -> " in line for line in (directory / "lifecycle.dot").read_text().splitlines()) - 1

    assert arrows(tmp_path / "all") == len(spec.transitions)
    assert arrows(tmp_path / "bundled") < len(spec.transitions)
    assert main(["diagram", "--all-edges", "--check", "--out", str(DIAGRAMS)]) == 1, "committed files are bundled"


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf"])
def test_bad_dot_timeout_is_a_usage_error(value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagram", "--dot-timeout", value, "--out", str(tmp_path)]) == 2
    assert "--dot-timeout" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("diff", [False, True], ids=["diagram", "diff"])
def test_a_spec_with_a_huge_state_name_is_one_line_exit_2(
    diff: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = packaged_spec_path().read_text(encoding="utf-8")
    terminal = load_spec().terminal_states[0]
    spec = tmp_path / "long.toml"
    spec.write_text(text.replace(f'"{terminal}"', f'"{"d" * 1_000}"'), encoding="utf-8")
    out = tmp_path / "out"
    args = ["--diff", str(packaged_spec_path()), str(spec)] if diff else ["--spec", str(spec)]
    assert main(["diagram", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{spec}:" in err and "field 'name' is 1000 characters long" in err
    assert not any(out.glob("*.dot")), "nothing is drawn"

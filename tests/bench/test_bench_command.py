"""`kvstate bench`'s group selection (`--only` means only), its summary line of targets and `--strict`, and its
`--nano-vllm` checks: what the command does with the rows, with the benchmarks themselves replaced (no timing)."""

from __future__ import annotations

import json

import pytest

import executor.bench
from executor.bench import GROUPS, PEER_GROUPS
from executor.bench.results import Row, Section
from kvstate.cli import main


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """`run_all` replaced: it records the groups asked for and returns one targeted row per group, met unless
    the group is `overhead`."""
    asked: list[tuple[str, ...]] = []

    def run_all(*, groups, **options) -> list[Section]:
        asked.append(groups)
        return [
            Section(g, [Row(g, "figure", 1.0, "x", "base", 2.0, target="ratio <= 1", met=g != "overhead")])
            for g in groups
        ]

    monkeypatch.setattr(executor.bench, "run_all", run_all)
    return asked


def _groups(asked: list[tuple[str, ...]]) -> list[str]:
    return [g for groups in asked for g in groups]


def test_only_runs_exactly_the_groups_it_names_also_with_peers(ran, tmp_path) -> None:
    path = tmp_path / "b.json"
    assert main(["bench", "--peers", "--only", "vllm", "--json", str(path)]) == 0
    assert _groups(ran) == ["vllm"] and json.loads(path.read_text())["meta"]["groups"] == ["vllm"]
    ran.clear()
    assert main(["bench", "--only", "pressure", "--only", "migration"]) == 0
    assert _groups(ran) == ["migration", "pressure"]  # in the order of GROUPS
    ran.clear()
    assert main(["bench", "--peers"]) == 0
    assert _groups(ran) == list(PEER_GROUPS)
    ran.clear()
    assert main(["bench"]) == 0
    assert _groups(ran) == list(GROUPS)


def test_peers_with_an_only_that_is_no_peer_group_is_a_usage_error(ran, capsys) -> None:
    assert main(["bench", "--peers", "--only", "migration"]) == 2
    assert "--only migration is not a peer group" in capsys.readouterr().err and not ran


def test_the_summary_counts_targets_and_strict_exits_1_on_a_miss(ran, capsys) -> None:
    assert main(["bench", "--only", "pressure", "--only", "overhead"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == "targets: 1 met, 1 not met (overhead: figure)"
    assert main(["bench", "--only", "pressure", "--only", "overhead", "--strict"]) == 1
    assert main(["bench", "--only", "pressure", "--strict"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "targets: 1 met, 0 not met"


def test_nano_vllm_must_be_a_directory_and_only_for_its_group(ran, tmp_path, capsys) -> None:
    assert main(["bench", "--only", "nano-vllm", "--nano-vllm", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "not a directory" in err and "git clone https://github.com/GeeeekExplorer/nano-vllm" in err
    assert main(["bench", "--only", "vllm", "--nano-vllm", str(tmp_path)]) == 2
    assert "--nano-vllm applies to the nano-vllm group" in capsys.readouterr().err and not ran

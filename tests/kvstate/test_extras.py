"""Every optional dependency is named with the extra that installs it, and that extra is declared."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from kvstate.extras import EXTRA_OF, MissingExtra, install_command, missing_extra, require

PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text(encoding="utf-8"))
PROJECT = PYPROJECT["project"]


def _names(requirements: list[str]) -> set[str]:
    """The distribution names of `requirements` (before any version, extra or marker), lower case."""
    names = set()
    for requirement in requirements:
        name = requirement
        for stop in "<>=![;~ ":
            name = name.partition(stop)[0]
        names.add(name.lower().replace("_", "-"))
    return names


def test_each_extra_named_is_declared_and_installs_its_module() -> None:
    extras = PROJECT["optional-dependencies"]
    for module, extra in EXTRA_OF.items():
        assert extra in extras, f"{module}: extra {extra!r} is not declared"
        assert module in _names(extras[extra]), f"the {extra} extra does not install {module}"


def test_the_core_installs_none_of_them() -> None:
    assert not _names(PROJECT["dependencies"]) & set(EXTRA_OF)


def test_a_missing_module_of_an_extra_is_one_line_naming_it() -> None:
    err = ModuleNotFoundError("No module named 'torch.cuda'", name="torch.cuda")
    assert missing_extra(err) == f"needs torch, which is not installed: {install_command('executor')}"
    assert install_command("executor") == "pip install 'kvstate[executor]'"


def test_a_module_no_extra_installs_is_not_explained() -> None:
    assert missing_extra(ModuleNotFoundError("No module named 'kvstate.nope'", name="kvstate.nope")) is None
    assert missing_extra(ModuleNotFoundError("no name")) is None


def test_require_names_the_extra_of_a_module_that_is_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(EXTRA_OF, "json", "report")
    require("json")  # installed: nothing raised
    monkeypatch.setitem(EXTRA_OF, "kvstate_no_such_module", "report")
    with pytest.raises(MissingExtra, match=r"needs kvstate_no_such_module, .*pip install 'kvstate\[report\]'"):
        require("kvstate_no_such_module")


def test_the_test_extra_installs_every_module_an_extra_brings() -> None:
    """The README's test command installs the test extra alone: it must bring everything the suite can reach."""
    assert set(EXTRA_OF) <= _resolved("test")


def _resolved(extra: str) -> set[str]:
    """The distribution names `extra` installs, with the kvstate extras it names (`kvstate[NAME]`) expanded."""
    names = set()
    for requirement in PROJECT["optional-dependencies"][extra]:
        if requirement.startswith("kvstate["):
            for named in requirement.removeprefix("kvstate[").partition("]")[0].split(","):
                names |= _resolved(named)
        else:
            names |= _names([requirement])
    return names

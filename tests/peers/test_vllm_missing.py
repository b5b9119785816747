"""Without vLLM, importing the adapter fails at once with an error that says how to install it (no peers marker:
this runs in the default suite, where vLLM is usually absent)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest


def test_importing_the_adapter_without_vllm_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` sees when it is not installed
    monkeypatch.delitem(sys.modules, "kvstate.adapters.vllm", raising=False)
    with pytest.raises(ImportError, match="vllm is not installed: run scripts/install-peers"):
        importlib.import_module("kvstate.adapters.vllm")


def test_the_adapters_package_imports_no_engine() -> None:
    code = "import sys, kvstate.adapters; print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"

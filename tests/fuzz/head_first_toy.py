"""A HypoFuzz target: the conformance machine over the toy scheduler whose victims are taken head-first.

The toy (`tests/stateful/test_declared_policy.py`) declares vLLM's policy, tail-first victims, and takes them from the
head of its running queue: a planted bug. This module is not named ``test_*.py``, so the default suite does not
collect it (it fails by design); HypoFuzz runs it when named:
``hypothesis fuzz -- tests/fuzz/head_first_toy.py``. Its settings are those of the profile loaded: HypoFuzz fuzzes
only a machine that is not derandomized and uses the profile's database, where it records what it finds.
"""

from __future__ import annotations

from kvstate.testing import conformance_machine
from tests.stateful.test_declared_policy import ToyAdapter

HeadFirstToyMachine = conformance_machine(lambda: ToyAdapter(head_first=True), name="HeadFirstToyMachine")
TestHeadFirstToy = HeadFirstToyMachine.TestCase

"""An adapter that breaks the `SchedulerAdapter` contract is told which member or key is wrong, when its machine is
defined, not with a bare `KeyError` or an empty list of names."""

from __future__ import annotations

import pytest

from kvstate.config import SchedulerConfig
from kvstate.testing import AdapterContractError, KVStateAdapter, conformance_machine

SMALL = SchedulerConfig(gpu_blocks=8, host_blocks=4, block_size=4)


class NoHostKeys(KVStateAdapter):
    """Reports only the GPU tier's counts."""

    def block_usage(self):
        return {k: v for k, v in super().block_usage().items() if k.startswith("gpu_")}


def test_a_usage_mapping_without_a_key_names_the_key() -> None:
    with pytest.raises(AdapterContractError, match=r"block_usage\(\) lacks the key\(s\) 'host_capacity', 'host_free'"):
        conformance_machine(lambda: NoHostKeys(SMALL), name="NoHostKeys")


def test_a_usage_that_is_not_a_mapping_says_so() -> None:
    class Listing(KVStateAdapter):
        def block_usage(self):
            return list(super().block_usage().values())

    with pytest.raises(AdapterContractError, match=r"block_usage\(\) returned list; it must return a mapping"):
        conformance_machine(lambda: Listing(SMALL), name="Listing")


def test_a_member_set_to_none_is_named() -> None:
    class NoUsage(KVStateAdapter):
        block_usage = None  # type: ignore[assignment]

    with pytest.raises(TypeError, match=r"NoUsage, which lacks block_usage \(is NoneType, not a method\) of"):
        conformance_machine(lambda: NoUsage(SMALL), name="NoUsage")


def test_a_missing_member_is_named() -> None:
    class Bare:
        gpu_token_capacity, block_size = 8, 4

    with pytest.raises(TypeError, match=r"lacks submit \(missing\), step \(missing\),"):
        conformance_machine(Bare, name="Bare")

"""What a conformance machine class is bound to: `MachineConfig`, how it drives its adapter, and `MachineBinding`, what
it derives once, when the class is defined, from that configuration and a probe adapter.

Probing refuses, when the class is defined, an adapter that breaks the `SchedulerAdapter` contract, a spec that
lacks what the machine checks, and a policy that the adapter cannot be checked against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hypothesis import strategies as st

from kvstate.declared import preset, with_policy
from kvstate.sim import DEFAULT_VOCAB
from kvstate.spec import Policy, Spec, default_spec
from kvstate.testing.adapter import SchedulerAdapter, checked_usage, contract_gaps
from kvstate.testing.errors import AdapterContractError
from kvstate.testing.inferred_passes import OBSERVABLE_EXCLUSIONS, observable_policy
from kvstate.testing.spec_model import POLICY_INVARIANTS, SpecModel
from kvstate.testing.strategies import invalid_submissions, valid_submissions

__all__ = ["MachineBinding", "MachineConfig", "declared_policy"]


@dataclass(frozen=True)
class MachineConfig:
    """How a conformance machine drives its adapter; every field has a default.

    `spec`: the specification held against (default: the packaged one). `vocab_size`: token ids are drawn below
    it (default: the adapter's `vocab_size` attribute, else `kvstate.sim.DEFAULT_VOCAB`). `max_new_tokens`: the
    most tokens one request may generate (default: half the GPU token capacity). `max_stop_tokens`: stop tokens
    per request. `max_steps_per_rule`: iterations one `step` rule runs at most. `liveness_base`,
    `liveness_per_token`: LIVE-DONE's bound once arrivals stop, in steps (base + per_token x the tokens of the
    unfinished requests). `cancel_event`: the spec event that cancels a request. `policy`: the scheduling policy
    its passes are checked against, a `kvstate.spec.Policy` or a preset name of `kvstate.declared.PRESETS` (default:
    the adapter's `policy` attribute, else the spec's `[policy]`); checked only if the adapter has `take_passes` and
    `check_policy` is True (False: a test of another property that a policy check would catch first). Without
    `take_passes`, each step's pass is inferred from its state changes and held to the policy's victim and admission
    rules when `infer_policy` is True and the observation decides every victim exclusion the policy declares
    (`kvstate.testing.inferred_passes`).
    """

    spec: Spec | None = None
    vocab_size: int | None = None
    max_new_tokens: int | None = None
    max_stop_tokens: int = 2
    max_steps_per_rule: int = 8
    liveness_base: int = 50
    liveness_per_token: int = 20
    cancel_event: str = "cancel"
    policy: Policy | str | None = None
    check_policy: bool = True
    infer_policy: bool = True


def reports_passes(adapter: object) -> bool:
    return callable(getattr(adapter, "take_passes", None))


def inferred_policy(spec: Spec, config: MachineConfig, adapter: object) -> tuple[str, Spec] | None:
    """For an adapter without `take_passes`: the policy its inferred passes are checked against, or None (no check).
    A policy it declares whose victim exclusions the observation does not decide is refused."""
    if reports_passes(adapter) or not config.infer_policy:
        return None
    declared = declared_policy(spec, config, adapter)
    if declared is None or observable_policy(declared[1]):
        return declared
    if config.policy is None and getattr(adapter, "policy", None) is None:
        return None  # the spec's own policy, not observable: checked only with take_passes
    hidden = sorted(set(declared[1].policy.victim_exclusions) - OBSERVABLE_EXCLUSIONS)
    raise AdapterContractError(
        f"{type(adapter).__name__} declares {declared[0]}, whose victim exclusions {', '.join(hidden)} no state "
        "change shows, but has no take_passes() to report its scheduling passes; implement it "
        "(kvstate.testing.PassReporting), declare a policy whose exclusions are observable, or pass "
        "infer_policy=False"
    )


def declared_policy(spec: Spec, config: MachineConfig, adapter: object) -> tuple[str, Spec] | None:
    """The name of the policy `adapter`'s passes are checked against and the spec that carries it, or None when no
    policy is checked (see `MachineConfig.policy`)."""
    declared = config.policy if config.policy is not None else getattr(adapter, "policy", None)
    if not config.check_policy:
        return None
    if declared is None:
        return "the spec's [policy]", spec
    if isinstance(declared, str):
        return f"preset {declared!r}", with_policy(spec, preset(declared, spec))
    if not isinstance(declared, Policy):
        raise AdapterContractError(
            f"policy {declared!r} is neither a kvstate.spec.Policy nor a preset name of kvstate.declared.PRESETS"
        )
    return "the declared policy", with_policy(spec, declared)


@dataclass(frozen=True)
class MachineBinding:
    """What a machine class derives once, when it is defined, from its `MachineConfig` and a probe adapter: the
    spec model, the adapter's sizes and the strategies the rules draw from.

    Invariants: valid submissions fit the probed GPU token capacity alone and invalid ones never do; token ids
    are below the vocabulary; the spec has every invariant the machine checks and the configured cancel event;
    `policy_spec` is the spec with the declared policy in place of its `[policy]` (None: the adapter reports no
    passes, and no policy is checked).
    """

    config: MachineConfig
    model: SpecModel
    adapter_name: str
    capacity: int
    block_size: int
    initial_host: int
    valid: st.SearchStrategy
    invalid: st.SearchStrategy
    steps: st.SearchStrategy
    live_states: st.SearchStrategy
    any_state: st.SearchStrategy
    policy_name: str = ""
    policy_spec: Spec | None = None
    inferred_spec: Spec | None = None  # the policy spec a black-box adapter's inferred passes are checked against

    @property
    def checks_policy(self) -> bool:
        return self.policy_spec is not None

    @classmethod
    def probe(cls, adapter_factory: Callable[[], SchedulerAdapter], config: MachineConfig) -> MachineBinding:
        """Check the spec, call `adapter_factory()` once and derive the binding from what that adapter reports."""
        model = SpecModel(config.spec if config.spec is not None else default_spec(), config.cancel_event)
        probe = adapter_factory()
        gaps = contract_gaps(probe)
        if gaps:
            raise TypeError(
                f"adapter_factory() returned {type(probe).__name__}, which lacks {', '.join(gaps)} "
                "of kvstate.testing.SchedulerAdapter; implement them"
            )
        declared = declared_policy(model.spec, config, probe) if reports_passes(probe) else None
        inferred = inferred_policy(model.spec, config, probe)
        if inferred is not None:
            declared, inferred_spec = None, inferred[1]
            model.require(POLICY_INVARIANTS, "the inferred policy check (kvstate.policy.check_observable)")
        else:
            inferred_spec = None
        if declared is not None:
            model.require(POLICY_INVARIANTS, "the policy check (kvstate.policy.check_pass)")
        capacity, block_size = int(probe.gpu_token_capacity), int(probe.block_size)
        if capacity < 2 or block_size < 1:
            raise ValueError(
                f"gpu_token_capacity={capacity} and block_size={block_size}: the GPU tier must fit at "
                "least a one-token prompt plus one new token"
            )
        vocab = config.vocab_size
        if vocab is None:
            vocab = int(getattr(probe, "vocab_size", DEFAULT_VOCAB))
        if vocab < 1:
            raise ValueError(f"vocab_size={vocab}: token ids are drawn from range(vocab_size), so it must be >= 1")
        max_new = max(1, min(config.max_new_tokens or capacity // 2, capacity - 1))
        return cls(
            config,
            model,
            type(probe).__name__,
            capacity,
            block_size,
            int(checked_usage(probe)["host_capacity"]),
            valid=valid_submissions(capacity, block_size, vocab, max_new, config.max_stop_tokens, probe.reference),
            invalid=invalid_submissions(capacity, vocab),
            steps=st.integers(1, max(1, config.max_steps_per_rule)),
            live_states=st.sampled_from(model.live_states),
            any_state=st.sampled_from(model.state_names),
            policy_name=declared[0] if declared else inferred[0] if inferred else "",
            policy_spec=declared[1] if declared else None,
            inferred_spec=inferred_spec,
        )

"""Fault injection: a seeded, declarative plan of memory-tier faults the engine injects into its own run.

Kinds (`FAULT_KINDS`) and what the engine does when one fires (spec events in `spec/SPEC.md`, "Faults"):

| kind | decided | effect |
|---|---|---|
| ``host_alloc`` | once, at engine start (iteration 0) | the host tier cannot be allocated: GPU-only fallback |
| ``copy_to_host`` | per offload copy (iteration, request) | the copy fails mid-way: `lose_host_copy`, replay |
| ``copy_to_gpu`` | per resume copy (iteration, request) | the copy fails mid-way: `recompute_pause`, replay |
| ``corrupt_host`` | per completed offload (iteration, request) | one value of the host copy changes at rest |
| ``host_loss`` | per iteration, before scheduling | the host tier goes: suspended requests with host blocks replay |

A `FaultSpec` fires at the iterations it lists, and otherwise with probability `rate`. The decision is a pure
function of (plan seed, kind, iteration, request id) — a keyed hash, not a shared random stream — so it does not
depend on the order of the questions, and two runs of one plan inject the same faults.

Invariants kept: `FaultPlan` and `FaultSpec` are immutable values; `FaultInjector` only counts what fired.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from kvstate.errors import KVStateError

FAULT_KINDS = ("host_alloc", "copy_to_host", "copy_to_gpu", "corrupt_host", "host_loss")
# rate used when a kind is given without one (`--inject KIND`)
DEFAULT_RATES = {"host_alloc": 1.0, "copy_to_host": 0.1, "copy_to_gpu": 0.1, "corrupt_host": 0.1, "host_loss": 0.01}


class FaultPlanError(KVStateError, ValueError):
    """A fault plan or `--inject` option is malformed; the message names the accepted forms."""


def _uniform(seed: int, kind: str, iteration: int, key: Hashable) -> float:
    """A number in [0, 1) determined by (seed, kind, iteration, key) alone."""
    text = f"{seed}\x1f{kind}\x1f{iteration}\x1f{type(key).__name__}:{key}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") / 2.0**64


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """One fault kind: fires at every iteration in `iterations`, and elsewhere with probability `rate`."""

    kind: str
    rate: float = 0.0
    iterations: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise FaultPlanError(f"unknown fault kind {self.kind!r}; choose one of {', '.join(FAULT_KINDS)}")
        if isinstance(self.rate, bool) or not isinstance(self.rate, (int, float)) or not 0.0 <= self.rate <= 1.0:
            raise FaultPlanError(f"fault {self.kind!r}: rate must be a probability in [0, 1], got {self.rate!r}")
        iterations = frozenset(self.iterations)
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in iterations):
            raise FaultPlanError(f"fault {self.kind!r}: iterations must be integers >= 0, got {sorted(iterations)!r}")
        object.__setattr__(self, "iterations", iterations)
        object.__setattr__(self, "rate", float(self.rate))

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """``KIND`` (its default rate), ``KIND:RATE`` (a probability) or ``KIND@I,J,...`` (iteration numbers)."""
        forms = "use KIND, KIND:RATE (0..1) or KIND@ITERATION[,ITERATION...]"
        kind, sep, rest = text.partition("@")
        if sep:
            try:
                iterations = frozenset(int(i) for i in rest.split(",") if i.strip())
            except ValueError:
                raise FaultPlanError(f"--inject {text!r}: iterations must be integers; {forms}") from None
            if not iterations:
                raise FaultPlanError(f"--inject {text!r}: no iteration after '@'; {forms}")
            return cls(kind.strip(), 0.0, iterations)
        kind, sep, rate = text.partition(":")
        kind = kind.strip()
        if kind not in FAULT_KINDS:
            raise FaultPlanError(
                f"--inject {text!r}: unknown fault kind {kind!r}; kinds: {', '.join(FAULT_KINDS)}; {forms}"
            )
        if not sep:
            return cls(kind, DEFAULT_RATES[kind])
        try:
            value = float(rate)
        except ValueError:
            raise FaultPlanError(f"--inject {text!r}: rate {rate!r} is not a number; {forms}") from None
        return cls(kind, value)

    def fires(self, seed: int, iteration: int, key: Hashable = 0) -> bool:
        if iteration in self.iterations:
            return True
        return self.rate > 0.0 and _uniform(seed, self.kind, iteration, key) < self.rate

    def __str__(self) -> str:
        parts = [f"{self.kind}:{self.rate:g}"] if self.rate or not self.iterations else []
        if self.iterations:
            parts.append(f"{self.kind}@{','.join(map(str, sorted(self.iterations)))}")
        return " ".join(parts)


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """Which faults to inject, with the seed every decision derives from. At most one `FaultSpec` per kind."""

    seed: int
    faults: tuple[FaultSpec, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise FaultPlanError(
                f"FaultPlan.seed must be an integer (every random choice is seeded), got {self.seed!r}"
            )
        faults = tuple(self.faults)
        kinds = [f.kind for f in faults]
        repeated = sorted({k for k in kinds if kinds.count(k) > 1})
        if repeated:
            raise FaultPlanError(f"fault kinds {repeated} are given more than once; give each kind once")
        object.__setattr__(self, "faults", faults)

    @classmethod
    def parse(cls, texts: Iterable[str], seed: int) -> FaultPlan:
        """A plan from ``--inject`` values (see `FaultSpec.parse`); a kind given twice is refused."""
        return cls(seed, tuple(FaultSpec.parse(t) for t in texts))

    @classmethod
    def of(cls, seed: int, **rates: float | Sequence[int]) -> FaultPlan:
        """``FaultPlan.of(0, copy_to_host=0.1, host_loss=[40])``: a float is a rate, a sequence lists iterations."""
        specs = []
        for kind, value in rates.items():
            if isinstance(value, bool):
                raise FaultPlanError(f"{kind}={value!r}: give a rate (a float) or the iterations (ints), not a bool")
            if isinstance(value, (int, float)):
                specs.append(FaultSpec(kind, value))
            else:
                specs.append(FaultSpec(kind, 0.0, frozenset(value)))
        return cls(seed, tuple(specs))

    def spec(self, kind: str) -> FaultSpec | None:
        if kind not in FAULT_KINDS:
            raise FaultPlanError(f"unknown fault kind {kind!r}; choose one of {', '.join(FAULT_KINDS)}")
        return next((f for f in self.faults if f.kind == kind), None)

    def fires(self, kind: str, iteration: int, key: Hashable = 0) -> bool:
        """Whether fault `kind` fires at `iteration` for `key` (a request id; 0 for engine-wide faults)."""
        spec = self.spec(kind)
        return spec is not None and spec.fires(self.seed, iteration, key)

    def __str__(self) -> str:
        return " ".join(map(str, self.faults)) or "none"


@dataclass
class FaultInjector:
    """Asks `plan` and counts the faults that fired, by kind (`injected`), with a log of (iteration, kind, key)."""

    plan: FaultPlan
    injected: Counter = field(default_factory=Counter)
    log: list[tuple[int, str, Hashable]] = field(default_factory=list)

    def fire(self, kind: str, iteration: int, key: Hashable = 0) -> bool:
        """True when the fault fires now; only call it where the fault can take effect (it is counted)."""
        if not self.plan.fires(kind, iteration, key):
            return False
        self.injected[kind] += 1
        self.log.append((iteration, kind, key))
        return True

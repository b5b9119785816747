"""`KVStateAdapter`: the `SchedulerAdapter` of this package's own `Scheduler`, driven by the slot-level `SimExecutor`.

It reports every scheduling pass with the snapshot taken just before it (`take_passes`), so the machine checks its
policy too.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import cast

from kvstate.config import SchedulerConfig
from kvstate.declared import ObservedPass
from kvstate.policy import snapshot
from kvstate.scheduler import Scheduler, SchedulingPass
from kvstate.sim import DEFAULT_VOCAB, SimExecutor, reference_output
from kvstate.spec import Spec, default_spec

__all__ = ["KVStateAdapter"]


class KVStateAdapter:
    """`SchedulerAdapter` over this package's `Scheduler` driven by the slot-level `SimExecutor`.

    Every pass the scheduler runs is kept, with a snapshot of the requests taken just before it, until `take_passes`
    hands it over.

    `scheduler_factory(config, spec)` and `executor_factory(scheduler, vocab, check_invariants=...)` let tests
    substitute subclasses (for instance deliberately broken ones). `deep_checks` turns the scheduler's own
    `check_invariants` on (inside every step and in `check_invariants()`).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        spec: Spec | None = None,
        vocab: int = DEFAULT_VOCAB,
        deep_checks: bool = True,
        scheduler_factory: Callable[[SchedulerConfig, Spec], Scheduler] = Scheduler,
        executor_factory: Callable[..., SimExecutor] = SimExecutor,
    ) -> None:
        self.config = config
        self.vocab = vocab
        self.deep_checks = deep_checks
        self.scheduler = scheduler_factory(config, spec if spec is not None else default_spec())
        self.executor = executor_factory(self.scheduler, vocab, check_invariants=deep_checks)
        self.gpu_token_capacity = config.gpu_token_capacity
        self.block_size = config.block_size
        self.vocab_size = vocab
        self._passes: list[ObservedPass] = []
        self._schedule = self.scheduler.schedule
        self.scheduler.schedule = self._observed_schedule  # type: ignore[method-assign]

    def _observed_schedule(self):
        """The scheduler's own pass, kept with the snapshot taken just before it (`take_passes`)."""
        before = snapshot(self.scheduler)
        out = self._schedule()
        done = cast("SchedulingPass", self.scheduler.last_pass)  # schedule() keeps every pass it ran there
        self._passes.append(ObservedPass(before, done.record, out))
        return out

    def take_passes(self) -> list[ObservedPass]:
        passes, self._passes = self._passes, []
        return passes

    def __repr__(self) -> str:
        return f"KVStateAdapter({self.config!r})"

    def submit(self, prompt: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int] = ()) -> Hashable:
        return self.scheduler.submit(list(prompt), max_new_tokens, stop_token_ids=stop_token_ids).request_id

    def step(self) -> None:
        self.executor.step()

    def cancel(self, request_id: Hashable) -> None:
        self.scheduler.cancel(request_id)

    def states(self) -> dict[Hashable, str]:
        s = self.scheduler
        return {rid: r.state for table in (s.finished, s.requests) for rid, r in table.items()}

    def outputs(self) -> dict[Hashable, list[int]]:
        s = self.scheduler
        return {rid: list(r.generated) for table in (s.finished, s.requests) for rid, r in table.items()}

    def block_usage(self) -> dict[str, int]:
        """The pool's usage in the kit's terms (`USAGE_KEYS`): `*_held` is what the pool calls owned."""
        usage = self.scheduler.pool.usage()
        return {
            **{key: usage[key] for key in ("gpu_capacity", "gpu_free", "gpu_fenced")},
            "gpu_held": usage["gpu_owned"],
            **{key: usage[key] for key in ("host_capacity", "host_free", "host_fenced")},
            "host_held": usage["host_owned"],
        }

    def check_invariants(self) -> None:
        if self.deep_checks:
            self.scheduler.check_invariants()

    def set_host_capacity(self, blocks: int) -> bool:
        self.scheduler.set_host_capacity(blocks)
        self.executor.sync_host_tier()
        return True

    def reference(self, prompt: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int] = ()) -> list[int]:
        return reference_output(prompt, max_new_tokens, stop_token_ids, self.vocab)

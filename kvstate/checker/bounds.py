"""Named bounds of the model checker, read from `spec/bounds.toml`.

A bound fixes everything that makes the state space finite: the requests (prompt length, max new tokens), the GPU
and host tiers (host 0 = no host tier), the block size, the prefill chunk, the pipeline depth, and how much
environment nondeterminism the scheduler refinement injects (cancellations, aborts, lost host copies, failed
copies), and optionally the scheduler's batch budgets (`max_batch_size`, `max_num_tokens`), its preemption cap
(`max_preemptions`, A3) and no-progress limit (`no_progress_limit`, A4) (left out: the `SchedulerConfig` defaults),
and stop tokens (`stop_at`: per request, the position of its output that is a stop token, -1 for none), whether the
scheduler may recompute-pause a victim (`recompute_pause`, default true) and its capacity policy (`capacity_policy`:
`max_utilization`, the default, or `guaranteed_no_evict`, which admits a request only when every resident request's
worst case fits beside it), and the offload policy the scheduler refinement runs (`offload`: one of the spec's
`[policy] offload` rules, in place of the spec's own; left out: the spec's).
Executor timing: `micro_batches` (default 1) is how many scheduler outputs the refinement's executor keeps in flight
at most (`SimExecutor(micro_batches=)`, pipeline stages > 1 only; the oldest may land earlier), so a request may be
preempted while its decode step is in flight and receive its token while suspended or awaiting consensus (a deferred
finish); `copy_delay` (default 0) is how many passes after the pass that issued it a copy may still be in flight
(it completes at the end of its own step at the earliest, after the forward pass). The abstract model is the same
for every depth of the pipeline and every copy delay. `cancel = false` keeps cancel and abort out of both models.
`abstract_model = false` marks a bound whose abstract model is too large to enumerate (the pipeline livelock
bound: five requests): `kvstate check` runs only its scheduler refinement there, which checks every state
predicate and LIVE-DONE on the real scheduler but cannot match its states against the model's (REFINES).

Invariants kept: every request of a bound fits the GPU tier alone (LIVE-REFUSE: a request that cannot is refused
at submission, so it never belongs to a bound; the loader refuses such a bound with a clear message); the scheduler
configuration of every bound (`Bound.scheduler_config`) is one `SchedulerConfig` accepts (a configuration it refuses
is refused as the bound, `ConfigRefused`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from kvstate.checker.bounds_schema import BOUND_FIELDS, BoundsError, check_table, key_locator, world_problem
from kvstate.config import CAPACITY_POLICIES, ConfigError, SchedulerConfig
from kvstate.policy import VOCABULARY
from kvstate.untrusted import Limits, UntrustedFileError, read_toml, shown

DEFAULT_SET_KEY = "default_set"


class ConfigRefused(BoundsError):
    """The bound's scheduler configuration is one `SchedulerConfig` refuses; the message names the bound."""


@dataclass(frozen=True)
class Bound:
    """One finite instance of the model. `requests` = ((prompt_len, max_new_tokens), ...) in arrival order."""

    name: str
    requests: tuple[tuple[int, int], ...]
    gpu_blocks: int
    host_blocks: int = 0
    block_size: int = 1
    chunk_size: int = 2
    pipeline_stages: int = 1
    micro_batches: int = 1  # refinement: scheduler outputs in flight at once, at most (pipeline_stages > 1)
    copy_delay: int = 0  # refinement: passes a copy may still be in flight after the pass that issued it
    cancel: bool = True  # cancel and abort may hit any request in any state (false: in neither model)
    env_cancels: int = 1  # refinement: cancellations the environment may inject in one run
    env_aborts: int = 0  # refinement: aborts the environment may inject in one run
    env_host_losses: int = 0  # refinement: host copies the environment may lose in one run
    env_copy_failures: int = 0  # refinement: copies the executor may report failed in one run
    recompute_pause: bool = True  # SchedulerConfig.enable_recompute_pause
    capacity_policy: str = "max_utilization"  # SchedulerConfig.capacity_policy
    max_batch_size: int | None = None  # refinement: SchedulerConfig.max_batch_size (None: the config's default)
    max_num_tokens: int | None = None  # refinement: SchedulerConfig.max_num_tokens (None: the config's default)
    max_preemptions: int | None = None  # refinement: SchedulerConfig.max_preemptions_per_request (A3)
    no_progress_limit: int | None = None  # refinement: SchedulerConfig.no_progress_limit (A4; None: the default)
    stop_at: tuple[int, ...] = ()  # per request: the position of its output that is a stop token (-1: none)
    abstract_model: bool = True  # False: too large to enumerate; only the scheduler refinement runs (no REFINES)
    offload: str | None = None  # refinement: the [policy] offload rule in place of the spec's (None: the spec's)
    description: str = ""
    groups: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        where = f"bound {self.name!r}"
        check_table(self.fields(), BOUND_FIELDS, where)  # exact types and ranges (bounds_schema), no coercion
        object.__setattr__(self, "requests", tuple(tuple(r) for r in self.requests))
        object.__setattr__(self, "stop_at", tuple(self.stop_at))
        object.__setattr__(self, "groups", tuple(sorted(set(self.requests))))
        tiers = world_problem(self.gpu_blocks, self.host_blocks, self.block_size, self.pipeline_stages)
        if tiers is not None:
            raise BoundsError(f"{where}: {tiers}")
        if self.micro_batches < 1 or (self.micro_batches > 1 and self.pipeline_stages == 1):
            raise BoundsError(
                f"{where}: micro_batches must be >= 1, and > 1 only with pipeline_stages > 1 (one stage "
                f"has nothing in flight), got {self.micro_batches} on {self.pipeline_stages} stage(s)"
            )
        if self.stop_at and (
            len(self.stop_at) != len(self.requests)
            or not all(
                isinstance(p, int) and not isinstance(p, bool) and -1 <= p < m
                for p, (_, m) in zip(self.stop_at, self.requests, strict=False)
            )
        ):
            raise BoundsError(
                f"{where}: stop_at must list, for each request, the position (0 .. max_new_tokens - 1) of its output "
                f"that is a stop token, or -1 for none; got {list(self.stop_at)!r}"
            )
        self._check_offload(where)
        self._check_scheduler_config(where)
        for prompt, new in self.requests:
            if prompt + new > self.gpu_blocks * self.block_size:
                raise BoundsError(
                    f"{where}: request [{prompt}, {new}] can never fit the GPU tier alone "
                    f"({self.gpu_blocks} blocks x {self.block_size} tokens); the scheduler refuses it at submission "
                    "(LIVE-REFUSE), so it cannot be part of a bound: shrink it or enlarge gpu_blocks"
                )

    def _check_offload(self, where: str) -> None:
        if self.offload is not None and self.offload not in VOCABULARY["offload"]:
            raise BoundsError(
                f"{where}: offload must be one of the policy's offload rules {sorted(VOCABULARY['offload'])} (or left "
                f"out for the spec's own), got {self.offload!r}"
            )

    def _check_scheduler_config(self, where: str) -> None:
        if not isinstance(self.recompute_pause, bool):
            raise BoundsError(f"{where}: recompute_pause must be true or false, got {self.recompute_pause!r}")
        if self.capacity_policy not in CAPACITY_POLICIES:
            raise BoundsError(
                f"{where}: capacity_policy must be one of {list(CAPACITY_POLICIES)}, got {self.capacity_policy!r}"
            )
        try:
            self.scheduler_config()
        except ConfigError as err:
            raise ConfigRefused(f"{where}: the scheduler refuses its configuration: {err}") from err

    def scheduler_config(self) -> SchedulerConfig:
        """The scheduler configuration of the bound; a budget the bound leaves out is the configuration's default."""
        budgets = {
            option: getattr(self, name)
            for name, option in (
                ("max_batch_size", "max_batch_size"),
                ("max_num_tokens", "max_num_tokens"),
                ("max_preemptions", "max_preemptions_per_request"),
                ("no_progress_limit", "no_progress_limit"),
            )
            if getattr(self, name) is not None
        }
        return SchedulerConfig(
            gpu_blocks=self.gpu_blocks,
            host_blocks=self.host_blocks,
            block_size=self.block_size,
            prefill_chunk_size=self.chunk_size,
            pipeline_stages=self.pipeline_stages,
            enable_recompute_pause=self.recompute_pause,
            capacity_policy=self.capacity_policy,
            **budgets,
        )

    @property
    def stop_tokens(self) -> bool:
        """Some request of the bound has a stop token (the abstract model lets any produced token be one)."""
        return any(p >= 0 for p in self.stop_at)

    def group_of(self, index: int) -> int:
        """The symmetry group of request `index`: requests with equal parameters are interchangeable."""
        return self.groups.index(self.requests[index])

    def fields(self) -> dict:
        """The bound's fields by name, as given (`groups`, derived, left out)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "groups"}

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "requests": [list(r) for r in self.requests],
            "gpu_blocks": self.gpu_blocks,
            "host_blocks": self.host_blocks,
            "block_size": self.block_size,
            "chunk_size": self.chunk_size,
            "pipeline_stages": self.pipeline_stages,
            "micro_batches": self.micro_batches,
            "copy_delay": self.copy_delay,
            "cancel": self.cancel,
            "env_cancels": self.env_cancels,
            "env_aborts": self.env_aborts,
            "env_host_losses": self.env_host_losses,
            "env_copy_failures": self.env_copy_failures,
            "recompute_pause": self.recompute_pause,
            "capacity_policy": self.capacity_policy,
            "max_batch_size": self.max_batch_size,
            "max_num_tokens": self.max_num_tokens,
            "max_preemptions": self.max_preemptions,
            "no_progress_limit": self.no_progress_limit,
            "stop_at": list(self.stop_at),
            "abstract_model": self.abstract_model,
            "offload": self.offload,
            "description": self.description,
        }

    @classmethod
    def from_dict(cls, data: dict, name: str | None = None, source: Path | None = None) -> Bound:
        """The bound of one table; `source` (the file it was read from) locates a refused field by its line."""
        data = dict(data)
        data["name"] = name or data.get("name", "bound")
        where = f"bound {data['name']!r}"
        known = set(cls.__dataclass_fields__) - {"groups"}
        unknown = set(data) - known
        if unknown:
            raise BoundsError(f"{where}: unknown keys {sorted(unknown)}; known keys: {sorted(known)}")
        for required, what in (("requests", "a list of [prompt_len, max_new_tokens]"), ("gpu_blocks", "an integer")):
            if required not in data:
                raise BoundsError(f"{source or ''}{': ' if source else ''}{where}: {required!r} is required ({what})")
        locate = key_locator(source, f"bounds.{data['name']}") if source is not None else None
        check_table(data, BOUND_FIELDS, where, locate)  # before anything is built from it
        return cls(
            **{**data, "requests": tuple(tuple(r) for r in data["requests"]), "stop_at": tuple(data.get("stop_at", ()))}
        )


def packaged_bounds_path() -> Path:
    return Path(str(resources.files("kvstate.spec_files").joinpath("bounds.toml")))


def load_bounds(path: str | Path | None = None) -> tuple[dict[str, Bound], tuple[str, ...]]:
    """All bounds of the file (in file order) and the names of the default set."""
    source = Path(path) if path is not None else packaged_bounds_path()
    try:  # a bounds file may come from anyone: bounded size, nesting and integers; failures name the file
        data = read_toml(source, Limits(max_bytes=1 << 20, max_depth=8), "bounds file")
    except UntrustedFileError as err:
        raise BoundsError(str(err)) from (err.__cause__ or err)
    tables = data.get("bounds")
    if not isinstance(tables, dict) or not tables:
        raise BoundsError(f"{source}: expected tables [bounds.NAME]")
    for name, entry in tables.items():
        if not isinstance(entry, dict):
            raise BoundsError(f"{source}: [bounds.{name}] must be a table, got {shown(entry)}")
    bounds = {name: Bound.from_dict(entry, name, source) for name, entry in tables.items()}
    listed = data.get(DEFAULT_SET_KEY, list(bounds))
    if not isinstance(listed, list) or not all(isinstance(n, str) for n in listed):
        raise BoundsError(
            f"{key_locator(source, '')(DEFAULT_SET_KEY)}{DEFAULT_SET_KEY} must be a list of bound names, got "
            f"{shown(listed)}"
        )
    default = tuple(listed)
    missing = [n for n in default if n not in bounds]
    if missing:
        raise BoundsError(f"{source}: {DEFAULT_SET_KEY} names unknown bounds {missing}")
    return bounds, default


def select_bounds(names: list[str] | None, path: str | Path | None = None) -> list[Bound]:
    """The bounds named (the default set when `names` is empty), refusing unknown names."""
    bounds, default = load_bounds(path)
    chosen = names or list(default)
    unknown = [n for n in chosen if n not in bounds]
    if unknown:
        raise BoundsError(f"unknown bound(s) {unknown}; known bounds: {', '.join(bounds)}")
    return [bounds[n] for n in chosen]

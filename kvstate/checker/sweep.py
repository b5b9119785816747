"""Swept bounds: every small configuration up to a size, each checked by the scheduler refinement (`kvstate check
--sweep NAME`), with a summary table of configurations x verdicts.

A sweep (`[sweeps.NAME]` in `spec/bounds.toml`) names, per dimension, the values to take: request counts, prompt
lengths and max-new-token counts (every sequence of that many requests of those shapes, in arrival order), the GPU
tier from the smallest that fits each request alone to `gpu_extra` blocks more, host tiers, block sizes, prefill
chunks, pipeline depths (each with 1..stages micro-batches in flight), copy delays and offload policies (both with a
host tier only: without one nothing is copied, and every offload policy offloads nothing), the scheduler's settings
(`recompute_pauses`, `capacity_policies`; a configuration the scheduler refuses is left out), plus the environment
every configuration gets (its fault budgets). A sweep of `parts` joins the configurations of the sweeps it names, so
that costly dimensions (fault budgets, deeper pipelines) are swept over fewer sizes. Each configuration is a `Bound`
checked by `check_bound` (the abstract model too, unless `abstract_model = false`: the refinement's step refinement
then checks REFINES action by action); a violation writes its counterexample as a regression test.

The configurations run on a `SweepRunner` (`kvstate.checker.sweep_runners`): this process, a local Dask cluster or
a Dask cluster at an address. Whichever ran them, the report and the counterexample files are the same: a worker
returns its files' texts and they are written here.

Invariants: `Sweep.bounds()` lists each configuration once, in a fixed order, and every one is a valid `Bound`
(every request fits the GPU tier alone, and the scheduler accepts its configuration); `SweepReport` has one `Outcome`
per configuration, in that order.
"""

from __future__ import annotations

import itertools
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvstate.checker.bounds import Bound, BoundsError, ConfigRefused, packaged_bounds_path
from kvstate.checker.bounds_schema import SWEEP_FIELDS, Locate, check_table, key_locator
from kvstate.checker.explore import HOLDS, INCOMPLETE, VIOLATED
from kvstate.checker.runner import check_bound
from kvstate.checker.sweep_runners import InProcessRunner, Lost, SweepRunner, local_dask_runner
from kvstate.config import CAPACITY_POLICIES
from kvstate.errors import KVStateError
from kvstate.policy import VOCABULARY
from kvstate.pool import ceil_div
from kvstate.spec import Spec, load_spec
from kvstate.untrusted import Limits, UntrustedFileError, read_toml, shown

DIMENSIONS = (
    "request_counts",
    "prompt_lens",
    "max_new_tokens",
    "gpu_extra",
    "host_blocks",
    "block_sizes",
    "chunk_sizes",
    "pipeline_stages",
    "copy_delays",
)
POLICIES = ("offloads",)  # dimensions of policy rules: lists of rule names (`Bound.offload`)
SCHEDULER = ("recompute_pauses", "capacity_policies")  # dimensions of scheduler settings (`Bound` fields)
ENVIRONMENT = ("env_cancels", "env_aborts", "env_host_losses", "env_copy_failures", "cancel", "abstract_model")
MAX_CONFIGURATIONS = 100_000  # configurations of one sweep, counted before any is built (`Sweep.count`)


@dataclass(frozen=True)
class Sweep:
    """One `[sweeps.NAME]` table: the values of each dimension, and the environment every configuration gets."""

    name: str
    request_counts: tuple[int, ...] = ()
    prompt_lens: tuple[int, ...] = ()
    max_new_tokens: tuple[int, ...] = ()
    gpu_extra: tuple[int, ...] = (0,)
    host_blocks: tuple[int, ...] = (0,)
    block_sizes: tuple[int, ...] = (1,)
    chunk_sizes: tuple[int, ...] = (2,)
    pipeline_stages: tuple[int, ...] = (1,)
    copy_delays: tuple[int, ...] = (0,)
    offloads: tuple[str | None, ...] = (None,)  # None: the spec's own offload rule
    recompute_pauses: tuple[bool, ...] = (True,)  # `Bound.recompute_pause`
    capacity_policies: tuple[str, ...] = ("max_utilization",)  # `Bound.capacity_policy`
    env_cancels: int = 0
    env_aborts: int = 0
    env_host_losses: int = 0
    env_copy_failures: int = 0
    cancel: bool = False
    abstract_model: bool = False
    description: str = ""
    parts: tuple[Sweep, ...] = ()  # a sweep of parts: their configurations, in order, and no dimensions of its own

    @classmethod
    def from_dict(
        cls, data: dict, name: str, sweeps: dict[str, Sweep] | None = None, source: Path | None = None
    ) -> Sweep:
        """The sweep of one table; `parts = [NAME, ...]` names sweeps of `sweeps` whose configurations it joins.
        `source` (the file it was read from) locates a refused field by its line. A sweep of more than
        `MAX_CONFIGURATIONS` configurations is refused (`Sweep.count`, before any is built)."""
        locate = key_locator(source, f"sweeps.{name}") if source is not None else None
        sweep = (
            cls._of_parts(data, name, sweeps or {}, locate) if "parts" in data else cls._of_table(data, name, locate)
        )
        count = sweep.count()
        if count > MAX_CONFIGURATIONS:
            place = f"{source}: " if source is not None else ""
            raise BoundsError(
                f"{place}sweep {name!r} spans {_count_text(count)} configurations, more than the limit of "
                f"{MAX_CONFIGURATIONS:,} configurations a sweep may span: split it into parts over fewer sizes"
            )
        return sweep

    @classmethod
    def _of_table(cls, data: dict, name: str, locate: Locate | None) -> Sweep:
        where = f"sweep {name!r}"
        known = set(DIMENSIONS) | set(POLICIES) | set(SCHEDULER) | set(ENVIRONMENT) | {"description"}
        unknown = set(data) - known
        if unknown:
            raise BoundsError(f"{where}: unknown keys {sorted(unknown)}; known keys: {sorted(known)}")
        values: dict = {"name": name}
        for key in DIMENSIONS:
            if key not in data:
                if key in ("request_counts", "prompt_lens", "max_new_tokens"):
                    place = locate(key) if locate is not None else ""
                    raise BoundsError(f"{place}{where}: '{key}' is required (a list of positive integers)")
                continue
            listed = data[key]
            positive = key not in ("gpu_extra", "host_blocks", "copy_delays")
            if (
                not isinstance(listed, list)
                or not listed
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= int(positive) for v in listed)
            ):
                floor = "positive" if positive else "non-negative"
                place = locate(key) if locate is not None else ""
                raise BoundsError(
                    f"{place}{where}: '{key}' must be a non-empty list of {floor} integers, got {shown(listed)}"
                )
            values[key] = tuple(listed)
        if "offloads" in data:
            listed = data["offloads"]
            rules = sorted(VOCABULARY["offload"])
            if not isinstance(listed, list) or not listed or not all(v in rules for v in listed):
                raise BoundsError(
                    f"{where}: 'offloads' must be a non-empty list of offload rules {rules}, got {listed!r}"
                )
            values["offloads"] = tuple(listed)
        values.update(_scheduler_dimensions(data, where))
        check_table(data, SWEEP_FIELDS, where, locate)  # exact types and ranges (bounds_schema)
        for key in ENVIRONMENT:
            if key in data:
                values[key] = data[key]
        if "description" in data:
            values["description"] = str(data["description"])
        return cls(**values)

    def count(self) -> int:
        """How many configurations `_configurations` yields (those `bounds` keeps are among them), by arithmetic
        on the sizes of the dimensions: nothing is enumerated."""
        if self.parts:
            return sum(part.count() for part in self.parts)
        shapes = len(self.prompt_lens) * len(self.max_new_tokens)
        sequences = sum(shapes**count for count in self.request_counts)
        no_host = self.host_blocks.count(0)
        per_host = no_host * self.copy_delays.count(0) * self.offloads.count(self.offloads[0]) + (
            len(self.host_blocks) - no_host
        ) * len(self.copy_delays) * len(self.offloads)
        return (
            sequences
            * len(self.block_sizes)
            * len(self.gpu_extra)
            * len(self.chunk_sizes)
            * sum(self.pipeline_stages)  # each depth with 1..stages micro-batches
            * len(self.recompute_pauses)
            * len(self.capacity_policies)
            * per_host
        )

    @classmethod
    def _of_parts(cls, data: dict, name: str, sweeps: dict[str, Sweep], locate: Locate | None) -> Sweep:
        where = f"sweep {name!r}"
        unknown = set(data) - {"parts", "description"}
        if unknown:
            raise BoundsError(f"{where}: a sweep of parts has only 'parts' and 'description', not {sorted(unknown)}")
        check_table(data, SWEEP_FIELDS, where, locate)
        listed = data["parts"]
        if not isinstance(listed, list) or not listed or not all(isinstance(v, str) for v in listed):
            raise BoundsError(f"{where}: 'parts' must be a non-empty list of sweep names, got {listed!r}")
        missing = [v for v in listed if v not in sweeps or sweeps[v].parts]
        if missing:
            raise BoundsError(f"{where}: 'parts' names {missing}, which are not sweeps (of dimensions) of the file")
        return cls(name=name, description=str(data.get("description", "")), parts=tuple(sweeps[v] for v in listed))

    def bounds(self) -> list[Bound]:
        """Every configuration of the sweep the scheduler accepts (`iter_bounds`), as a list."""
        return list(self.iter_bounds())

    def iter_bounds(self) -> Iterator[Bound]:
        """Every configuration of the sweep the scheduler accepts, one at a time, as a bound named after its index
        (one the scheduler refuses, such as no way to preempt a victim, has nothing to check)."""
        index = 0
        parts = self.parts or (self,)
        for config in itertools.chain.from_iterable(part._configurations() for part in parts):
            try:
                bound = Bound(name=f"{self.name}-{index}", **config)
            except ConfigRefused:
                continue
            index += 1
            yield bound

    def _configurations(self) -> Iterator[dict]:
        shapes = [(p, m) for p in self.prompt_lens for m in self.max_new_tokens]
        pipelines = [(s, mb) for s in self.pipeline_stages for mb in range(1, s + 1)]
        for count in self.request_counts:
            for requests in itertools.product(shapes, repeat=count):
                for block in self.block_sizes:
                    fits = max(ceil_div(p + m, block) for p, m in requests)  # the smallest GPU tier for each alone
                    for extra, host, chunk, (stages, micro), delay, offload, pause, capacity in itertools.product(
                        self.gpu_extra,
                        self.host_blocks,
                        self.chunk_sizes,
                        pipelines,
                        self.copy_delays,
                        self.offloads,
                        self.recompute_pauses,
                        self.capacity_policies,
                    ):
                        if not host and (delay or offload != self.offloads[0]):
                            continue  # nothing is copied without a host tier: every delay is 0, every offload alike
                        yield {
                            "requests": requests,
                            "gpu_blocks": fits + extra,
                            "host_blocks": host,
                            "block_size": block,
                            "chunk_size": chunk,
                            "pipeline_stages": stages,
                            "micro_batches": micro,
                            "copy_delay": delay,
                            "offload": offload,
                            "recompute_pause": pause,
                            "capacity_policy": capacity,
                            **{key: getattr(self, key) for key in ENVIRONMENT},
                        }


def _count_text(count: int) -> str:
    """A count as a message writes it: in full up to 30 digits, else its order of magnitude."""
    digits = len(str(count)) if count.bit_length() < 4000 else int(count.bit_length() * 0.30103) + 1
    return f"{count:,}" if digits <= 30 else f"about 10^{digits - 1}"


def _scheduler_dimensions(data: dict, where: str) -> dict:
    """The sweep's lists of scheduler settings (`SCHEDULER`), each checked for its kind of value."""
    values: dict = {}
    if "recompute_pauses" in data:
        listed = data["recompute_pauses"]
        if not isinstance(listed, list) or not listed or not all(isinstance(v, bool) for v in listed):
            raise BoundsError(f"{where}: 'recompute_pauses' must be a non-empty list of true / false, got {listed!r}")
        values["recompute_pauses"] = tuple(listed)
    if "capacity_policies" in data:
        listed = data["capacity_policies"]
        if not isinstance(listed, list) or not listed or not all(v in CAPACITY_POLICIES for v in listed):
            raise BoundsError(
                f"{where}: 'capacity_policies' must be a non-empty list of {list(CAPACITY_POLICIES)}, got {listed!r}"
            )
        values["capacity_policies"] = tuple(listed)
    return values


def load_sweeps(path: str | Path | None = None) -> dict[str, Sweep]:
    """The `[sweeps.NAME]` tables of a bounds file (default: the packaged `spec/bounds.toml`)."""
    source = Path(path) if path is not None else packaged_bounds_path()
    try:  # read as bounds files are: bounded, failures name the file
        data = read_toml(source, Limits(max_bytes=1 << 20, max_depth=8), "bounds file")
    except UntrustedFileError as err:
        raise BoundsError(str(err)) from (err.__cause__ or err)
    tables = data.get("sweeps", {})
    if not isinstance(tables, dict):
        raise BoundsError(f"{source}: expected tables [sweeps.NAME]")
    sweeps: dict[str, Sweep] = {}
    for name, entry in sorted(tables.items(), key=lambda item: isinstance(item[1], dict) and "parts" in item[1]):
        if not isinstance(entry, dict):
            raise BoundsError(f"{source}: [sweeps.{name}] must be a table")
        sweeps[name] = Sweep.from_dict(entry, name, sweeps, source)
    return {name: sweeps[name] for name in tables}  # in file order


def select_sweep(name: str, path: str | Path | None = None) -> Sweep:
    """The sweep called `name`, refusing an unknown name."""
    sweeps = load_sweeps(path)
    if name not in sweeps:
        raise BoundsError(f"unknown sweep {name!r}; known sweeps: {', '.join(sweeps) or 'none'}")
    return sweeps[name]


@dataclass(frozen=True, slots=True)
class Outcome:
    """What checking one configuration gave."""

    bound: Bound
    verdict: str
    invariant: str | None
    states: int
    seconds: float
    counterexample_file: str | None
    lost: str | None = None  # why no worker returned a verdict (the verdict is then incomplete)


@dataclass
class SweepReport:
    sweep: Sweep
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0
    where: str = "this process"  # the runner's description

    @property
    def verdict(self) -> str:
        verdicts = {o.verdict for o in self.outcomes}
        return VIOLATED if VIOLATED in verdicts else INCOMPLETE if INCOMPLETE in verdicts else HOLDS

    def table(self) -> list[str]:
        """Configurations x verdicts, per value of each dimension, as a Markdown table."""
        rows = [
            ("requests", lambda b: len(b.requests)),
            (
                "GPU blocks over the smallest fit",
                lambda b: b.gpu_blocks - max(ceil_div(p + m, b.block_size) for p, m in b.requests),
            ),
            ("host blocks", lambda b: b.host_blocks),
            ("block size", lambda b: b.block_size),
            ("chunk", lambda b: b.chunk_size),
            ("stages x micro-batches", lambda b: f"{b.pipeline_stages}x{b.micro_batches}"),
            ("copy delay", lambda b: b.copy_delay),
            ("offload", lambda b: b.offload or "the spec's"),
            ("fault budgets", _faults),
            ("recompute-pause", lambda b: "on" if b.recompute_pause else "off"),
            ("capacity policy", lambda b: b.capacity_policy),
        ]
        out = [
            "| dimension | value | configurations | holds | violated | incomplete | states |",
            "|---|---|---|---|---|---|---|",
        ]
        for label, key in rows:
            groups: dict = {}
            for o in self.outcomes:
                groups.setdefault(key(o.bound), []).append(o)
            for value in sorted(groups, key=str):
                out.append(_row(label, value, groups[value]))
        out.append(_row("all", "", self.outcomes))
        return out

    def scope(self) -> str:
        """What the configurations span beyond their sizes: pipeline depths, fault budgets, scheduler settings."""
        bounds = [o.bound for o in self.outcomes]
        stages = sorted({b.pipeline_stages for b in bounds})
        faulted = [b for b in bounds if _faults(b) != "none"]
        most = {label: max((getattr(b, key) for b in bounds), default=0) for key, label in FAULTS}
        return (
            f"scope: pipeline stages {', '.join(map(str, stages))} (1..stages micro-batches in flight); fault budgets "
            f"in {len(faulted)} of {len(bounds)} configurations (at most "
            + ", ".join(f"{n} {label}" for label, n in most.items())
            + f" per run); recompute-pause off in {sum(not b.recompute_pause for b in bounds)}; guaranteed_no_evict "
            f"in {sum(b.capacity_policy == 'guaranteed_no_evict' for b in bounds)}"
        )

    def lines(self) -> list[str]:
        counts = Counter(o.verdict for o in self.outcomes)
        out = [
            f"sweep {self.sweep.name}: {len(self.outcomes)} configurations, {sum(o.states for o in self.outcomes)} "
            f"scheduler states, {self.seconds:.1f} s on {self.where}: "
            + ", ".join(f"{counts[v]} {v}" for v in (HOLDS, VIOLATED, INCOMPLETE)),
            self.scope(),
            *self.table(),
        ]
        for o in self.outcomes:
            if o.verdict != HOLDS:
                out.append(
                    f"  {o.bound.name} ({o.verdict}{', ' + o.invariant if o.invariant else ''}): "
                    f"{o.bound.to_dict()}"
                    + (f"; not checked: {o.lost}" if o.lost else "")
                    + (f"; regression test {o.counterexample_file}" if o.counterexample_file else "")
                )
        return out


FAULTS = (
    ("env_cancels", "cancels"),
    ("env_aborts", "aborts"),
    ("env_host_losses", "lost host copies"),
    ("env_copy_failures", "failed copies"),
)


def _faults(bound: Bound) -> str:
    """The environment's fault budgets of `bound` (failed copies and lost host copies only with a host tier, where
    they apply), or "none"."""
    host = ("env_host_losses", "env_copy_failures")
    budgets = [
        f"{getattr(bound, key)} {label}"
        for key, label in FAULTS
        if getattr(bound, key)
        and (bound.cancel or key not in ("env_cancels", "env_aborts"))
        and (bound.host_blocks or key not in host)
    ]
    return ", ".join(budgets) or "none"


def _row(label: str, value: object, outcomes: list[Outcome]) -> str:
    counts = Counter(o.verdict for o in outcomes)
    states = sum(o.states for o in outcomes)
    return (
        f"| {label} | {value} | {len(outcomes)} | {counts[HOLDS]} | {counts[VIOLATED]} | {counts[INCOMPLETE]} "
        f"| {states} |"
    )


def run_sweep(
    sweep: Sweep,
    *,
    spec_path: str | None = None,
    workers: int = 1,
    runner: SweepRunner | None = None,
    max_states: int | None = None,
    counterexample_dir: Path | None = None,
    progress: Callable[[int, int], None] | None = None,
    bounds: list[Bound] | None = None,
) -> SweepReport:
    """Check every configuration of `sweep` on `runner` (default: this process for one worker, a local Dask cluster
    of `workers` processes for more); `progress(done, total)` after each. Counterexample files are written here,
    into `counterexample_dir`, whichever machine checked the configuration. Dask spawns its worker processes: a
    script that calls this with `workers > 1` needs the `if __name__ == "__main__":` guard. `bounds`, where the
    caller has already listed them, are `sweep.bounds()`."""
    if runner is None and workers > 1:
        with local_dask_runner(workers) as local:
            return run_sweep(
                sweep,
                spec_path=spec_path,
                runner=local,
                max_states=max_states,
                counterexample_dir=counterexample_dir,
                progress=progress,
                bounds=bounds,
            )
    runner = runner or InProcessRunner()
    spec = load_spec(spec_path)
    bounds = sweep.bounds() if bounds is None else bounds
    start = time.perf_counter()
    report = SweepReport(sweep, where=runner.description)
    jobs = [(bound, max_states, counterexample_dir is not None) for bound in bounds]
    outcomes: dict[int, Outcome] = {}
    for index, result in runner.run(check_configuration, spec, jobs):  # in the order they finish
        outcomes[index] = _keep(bounds[index], result, counterexample_dir)  # its files written at once
        if progress is not None:
            progress(len(outcomes), len(bounds))
    report.outcomes = [outcomes[index] for index in range(len(bounds))]
    report.seconds = time.perf_counter() - start
    return report


@dataclass(frozen=True, slots=True)
class Checked:
    """One configuration's outcome as a worker returns it, with its counterexample files (name, text): a worker
    on another machine cannot write into the directory they belong in."""

    outcome: Outcome
    files: tuple[tuple[str, str], ...] = ()


def check_configuration(spec: Spec, job: tuple[Bound, int | None, bool]) -> Checked:
    """Check one configuration (a runner's task: it runs wherever the runner puts it)."""
    bound, max_states, write_counterexample = job
    with tempfile.TemporaryDirectory(prefix="kvstate-sweep-") as scratch:
        directory = Path(scratch) if write_counterexample else None
        report = check_bound(bound, spec=spec, max_states=max_states, counterexample_dir=directory)
        files = tuple((p.name, p.read_text(encoding="utf-8")) for p in sorted(Path(scratch).iterdir()))
    refinement = report.refinement
    outcome = Outcome(
        bound,
        report.verdict,
        report.violated_invariant,
        (refinement.states if refinement else 0) + report.abstract.states,
        (refinement.seconds if refinement else 0.0) + report.abstract.seconds,
        report.counterexample_file.name if report.counterexample_file else None,
    )
    return Checked(outcome, files)


def _keep(bound: Bound, result: Checked | Lost, counterexample_dir: Path | None) -> Outcome:
    """The outcome of one configuration, its counterexample files written into `counterexample_dir`."""
    if isinstance(result, Lost):
        return Outcome(bound, INCOMPLETE, None, 0, 0.0, None, lost=result.reason)
    outcome = result.outcome
    if counterexample_dir is None or not result.files:
        return outcome
    for name, text in result.files:
        path = counterexample_dir / name
        try:
            path.write_text(text, encoding="utf-8")
        except OSError as err:
            raise KVStateError(f"cannot write {path}: {err.strerror}; pass a writable --counterexample-dir") from err
    written = str(counterexample_dir / outcome.counterexample_file) if outcome.counterexample_file else None
    return replace(outcome, counterexample_file=written)

"""Simulation of the scheduler refinement (`kvstate check --simulate N`): seeded random walks over the refinement's
own actions, for bounds too large to search exhaustively.

A walk starts from the refinement's initial world and, until its world is final (every request arrived and ended,
no copy and no output in flight) or it has taken `depth` actions, takes one of the actions `Environment.actions`
offers there, drawn by its own random generator, through `Refinement.apply`: each action is checked exactly as the
exhaustive search checks an edge (spec edges, the policy on every pass, the invariants, step refinement, OUT-EQUIV,
a stall of the no-progress detector as LIVE-DONE). Each kind of action has a weight the walk draws for itself, so a
choice that is rare under a uniform draw (never landing an output early, say) is the habit of some walks. A walk
that comes back to a world it passed (the same fingerprint: no budgeted action between) while a request is
unfinished has found a cycle the exhaustive search reports as a livelock (LIVE-DONE). The abstraction is not
matched against the abstract model's reachable set, which a bound this large does not enumerate.

Walk k's seed is derived from the run's seed and k alone (`walk_seed`), so a run is repeatable and its walks do not
depend on one another. A violation is shrunk by delta debugging on the actions its walk took: chunks of them are
dropped while the rest, replayed from the initial world (skipping an action no longer offered), still violates the
same invariant; the shortest found is the counterexample, written as the exhaustive checker writes its own.

"Holds" here means: none of the walks of the scope (`SimulationScope`) violated a check; an unvisited world may.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvstate.checker.bounds import Bound
from kvstate.checker.counterexample_trace import CounterexampleTrace, trace_path, write_refinement
from kvstate.checker.explore import HOLDS, INCOMPLETE, VIOLATED
from kvstate.checker.observed import ObservedScheduler
from kvstate.checker.refinement import Refinement, RefinementResult
from kvstate.checker.runner import EXIT_CODES, combine, describe_bound, write_refinement_test
from kvstate.checker.world import World, fingerprint
from kvstate.errors import InvariantViolation
from kvstate.spec import Spec, default_spec

DEFAULT_SEED = 0
DEFAULT_DEPTH = 2000  # actions per walk: many times the no-progress detector's default limit of passes
DEFAULT_SHRINK_SECONDS = 60.0
CHECKPOINT_EVERY = 8  # actions between two copies of the run a shrinking candidate may resume from


@dataclass(frozen=True, slots=True)
class SimulationScope:
    """What a simulation covers: `walks` walks of at most `depth` actions each, walk k seeded by
    `walk_seed(seed, k)`."""

    walks: int
    depth: int = DEFAULT_DEPTH
    seed: int = DEFAULT_SEED

    def describe(self) -> str:
        return f"{self.walks} random walk(s) of at most {self.depth} actions, seed {self.seed}"


def walk_seed(seed: int, walk: int) -> int:
    """The seed of walk `walk` (0, 1, ...) of a run seeded `seed`: the first 63 bits of SHA-256 of both."""
    digest = hashlib.sha256(f"kvstate-simulate/{seed}/{walk}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


@dataclass(frozen=True, slots=True)
class WalkViolation:
    """A check a walk violated: the walk's number and seed, the invariant and its message, the actions the walk took
    up to and including the violating one (`found`), and the shrunk counterexample (`shrunk`, same invariant;
    `loop_start`: where the part of it that repeats begins, for a livelock)."""

    walk: int
    seed: int
    invariant: str
    message: str
    found: tuple[tuple, ...]
    shrunk: tuple[tuple, ...]
    loop_start: int | None = None


@dataclass
class SimulationResult:
    """What one bound's simulation gave: its verdict, the walks and actions it took in `seconds`, the distinct
    worlds (by fingerprint) they visited, and the violation if one was found (shrunk in `shrink_seconds`)."""

    bound: Bound
    scope: SimulationScope
    verdict: str = HOLDS
    walks: int = 0
    final_walks: int = 0  # walks that reached a final world
    cut_walks: int = 0  # walks stopped at the depth (the others reached a final world or violated a check)
    steps: int = 0
    distinct: int = 0
    seconds: float = 0.0
    seconds_to_violation: float | None = None  # from the start to the end of the violating walk
    shrink_seconds: float = 0.0  # spent shrinking the violation (not in `seconds`)
    stop_reason: str = ""
    violation: WalkViolation | None = None
    counterexample: RefinementResult | None = field(default=None, repr=False)
    counterexample_file: Path | None = None  # the regression test written for the counterexample
    counterexample_trace: CounterexampleTrace | None = None  # the counterexample as a trace (kvstate report)

    @property
    def rate(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else float(self.steps)


@dataclass
class _Run:
    """One run of actions from the initial world. Invariant: `seen[fp]` is the index in `taken` after which the
    world had fingerprint `fp`, and `unfinished[i]` whether it then had an unfinished request."""

    world: World
    taken: list[tuple] = field(default_factory=list)
    seen: dict[tuple, int] = field(default_factory=dict)
    unfinished: list[bool] = field(default_factory=list)


class _Livelock(Exception):
    """A run came back to a world it passed with a request unfinished; `loop_start`: where the cycle begins."""

    def __init__(self, loop_start: int, steps: int) -> None:
        super().__init__(
            f"livelock: a cycle of {steps} action(s) comes back to the world it left with an unfinished request; "
            "it repeats forever (every action on it spends no environment budget)"
        )
        self.loop_start = loop_start


class _Weights:
    """A walk's weight per kind of action (the action's name, and whether it fails a copy), each drawn from
    `CHOICES` by the walk's generator the first time the walk meets that kind; `pick` draws an index by weight."""

    CHOICES = (0.02, 0.2, 1.0)

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.by_kind: dict[tuple[str, bool], float] = {}

    def of(self, action: tuple) -> float:
        kind = (action[0], "fail" in action[1:2])
        if kind not in self.by_kind:
            self.by_kind[kind] = self.rng.choice(self.CHOICES)
        return self.by_kind[kind]

    def pick(self, actions: Sequence[tuple]) -> int:
        weights = [self.of(a) for a in actions]
        point = self.rng.random() * sum(weights)
        for i, weight in enumerate(weights):
            point -= weight
            if point < 0:
                return i
        return len(actions) - 1


class Simulator:
    """Random walks over the worlds of one bound, driven by the refinement's own actions and checks.

    Invariant: every action a walk or a replay takes is one `Environment.actions` offers in the world it is taken
    in, carried out by `Refinement.apply` (on a copy of the world when the environment may refuse it after acting).
    """

    def __init__(self, refinement: Refinement, scope: SimulationScope) -> None:
        self.refinement = refinement
        self.scope = scope
        self.environment = refinement.environment

    # ---- one run
    def start(self) -> _Run:
        run = _Run(self.refinement.initial())
        run.seen[fingerprint(run.world)] = 0
        run.unfinished.append(run.world.scheduler.has_unfinished)
        return run

    def is_final(self, world: World) -> bool:
        """Every request arrived and ended, and nothing is in flight: no action but an idle step is left."""
        done = world.submitted == len(self.refinement.bound.requests) and not world.scheduler.has_unfinished
        return done and not world.sim.copies and not world.sim.pipeline

    def take(self, run: _Run, action: tuple) -> tuple | None:
        """Take `action` in `run`; its fingerprint afterwards, or None when the environment refused it. Raises
        `InvariantViolation` on a failed check and `_Livelock` on a cycle through an unfinished world (the action
        is in `run.taken` then)."""
        from kvstate.checker.environment import NotEnabled

        world = self.refinement.clone(run.world) if self.environment.may_refuse(action) else run.world
        try:
            self.refinement.apply(world, action)
        except NotEnabled:
            return None
        except InvariantViolation:
            run.taken.append(action)
            raise
        run.world = world
        run.taken.append(action)
        key = fingerprint(world)
        run.unfinished.append(world.scheduler.has_unfinished)
        back = run.seen.get(key)
        if back is not None and any(run.unfinished[back:]):
            raise _Livelock(back, len(run.taken) - back)
        run.seen[key] = len(run.taken)
        return key

    def walk(self, run: _Run, rng: random.Random, visited: set[int], deadline: float | None) -> bool | None:
        """Walk on from `run`; True when it reached a final world, False at its depth, None past `deadline`.
        Raises as `take` does; `visited` gains the hash of every world's fingerprint.

        Each kind of action gets a weight of its own per walk (`_Weights`), so some walks rarely land early,
        complete copies early or fail them, and reach the runs that need a rare choice many times in a row."""
        weights = _Weights(rng)
        while len(run.taken) < self.scope.depth:
            if self.is_final(run.world):
                return True
            if deadline is not None and time.perf_counter() > deadline:
                return None
            actions = self.environment.actions(run.world)
            while actions:
                action = actions.pop(weights.pick(actions))
                key = self.take(run, action)
                if key is not None:
                    visited.add(hash(key))
                    break
        return self.is_final(run.world)

    # ---- shrinking
    def replay(
        self, actions: Sequence[tuple], invariant: str, start: _Run | None = None
    ) -> tuple[list[tuple], str, int | None] | None:
        """Replay `actions` from the initial world (or from a copy of `start`), skipping each one not offered (or
        refused) where it comes; (the actions taken up to the violation, its message, its loop start) when
        `invariant` is violated, else None (another invariant's violation counts as none)."""
        run = self.start() if start is None else self.copy(start)
        for action in actions:
            if action not in self.environment.actions(run.world):
                continue
            try:
                self.take(run, action)
            except _Livelock as err:
                return (run.taken, str(err), err.loop_start) if invariant == "LIVE-DONE" else None
            except InvariantViolation as err:
                return (run.taken, str(err), None) if err.invariant_id == invariant else None
        return None

    def copy(self, run: _Run) -> _Run:
        return _Run(self.refinement.clone(run.world), list(run.taken), dict(run.seen), list(run.unfinished))

    def checkpoints(self, actions: Sequence[tuple], every: int) -> list[_Run]:
        """Copies of the run of `actions` (each taken where it comes, as in a replay that returned them) after
        0, `every`, 2 * `every`, ... of them, up to the last action."""
        run, saved = self.start(), []
        for n, action in enumerate(actions[:-1]):
            if n % every == 0:
                saved.append(self.copy(run))
            self.take(run, action)
        return saved or [self.start()]

    def shrink(
        self, actions: Sequence[tuple], invariant: str, deadline: float
    ) -> tuple[list[tuple], str, int | None] | None:
        """Delta debugging: drop chunks of `actions` (halving their size when no chunk can go) while the replay
        still violates `invariant`; the shortest violating replay found by `deadline`. A candidate drops a chunk
        after a prefix the best replay so far shares, so it resumes from a checkpoint of that replay."""
        best = self.replay(actions, invariant)
        if best is None:  # cannot happen for a walk's own actions: its checks are deterministic
            return None
        chunk, every = len(best[0]) // 2, CHECKPOINT_EVERY
        saved = self.checkpoints(best[0], every)
        while chunk >= 1 and time.perf_counter() < deadline:
            i, dropped = 0, False
            while i < len(best[0]) and time.perf_counter() < deadline:
                base = min(i // every, len(saved) - 1)
                rest = best[0][base * every : i] + best[0][i + chunk :]
                candidate = self.replay(rest, invariant, saved[base])
                if candidate is not None and len(candidate[0]) < len(best[0]):
                    best, dropped = candidate, True
                    saved = self.checkpoints(best[0], every)
                else:
                    i += chunk
            if not dropped:
                chunk //= 2
        return best

    # ---- a whole simulation
    def run(
        self,
        *,
        time_limit: float | None = None,
        shrink_seconds: float = DEFAULT_SHRINK_SECONDS,
        progress: Callable[[SimulationResult], None] | None = None,
    ) -> SimulationResult:
        """Every walk of the scope, or up to the first violation (shrunk) or `time_limit` (verdict incomplete)."""
        start = time.perf_counter()
        deadline = start + time_limit if time_limit else None
        result = SimulationResult(self.refinement.bound, self.scope)
        visited: set[int] = set()
        try:
            self.refinement.checks.refusal()
        except InvariantViolation as err:
            result.verdict, result.seconds = VIOLATED, time.perf_counter() - start
            result.violation = WalkViolation(-1, 0, err.invariant_id, str(err), (), ())
            return result
        for k in range(self.scope.walks):
            seed = walk_seed(self.scope.seed, k)
            violation = self._one_walk(k, seed, visited, deadline, result)
            result.distinct, result.seconds = len(visited), time.perf_counter() - start
            if violation is not None:
                result.seconds_to_violation = result.seconds
                if progress is not None:
                    progress(result)
                shrink_start = time.perf_counter()
                self._report(result, violation, shrink_start + shrink_seconds)
                result.shrink_seconds = time.perf_counter() - shrink_start
                return result
            if result.stop_reason:
                result.verdict = INCOMPLETE
                return result
            if progress is not None:
                progress(result)
        return result

    def _one_walk(
        self, k: int, seed: int, visited: set[int], deadline: float | None, result: SimulationResult
    ) -> WalkViolation | None:
        """Walk `k` with `seed`, counted in `result`; its violation, unshrunk, if any."""
        run = self.start()
        visited.add(hash(fingerprint(run.world)))
        try:
            final = self.walk(run, random.Random(seed), visited, deadline)
        except (InvariantViolation, _Livelock) as err:
            result.walks += 1
            result.steps += len(run.taken)
            invariant = err.invariant_id if isinstance(err, InvariantViolation) else "LIVE-DONE"
            return WalkViolation(k, seed, invariant, str(err), tuple(run.taken), ())
        result.steps += len(run.taken)
        if final is None:
            result.stop_reason = f"time limit reached during walk {k}"
            return None
        result.walks += 1
        result.final_walks += int(final)
        result.cut_walks += int(not final)
        return None

    def _report(self, result: SimulationResult, found: WalkViolation, deadline: float) -> None:
        """Shrink `found` and record it, with its counterexample in the exhaustive search's form."""
        shrunk = self.shrink(found.found, found.invariant, deadline)
        actions, message, loop_start = shrunk if shrunk is not None else (list(found.found), found.message, None)
        result.verdict = VIOLATED
        counterexample = RefinementResult(result.bound, VIOLATED, violation_id=found.invariant, message=message)
        counterexample.path = self.path_of(actions)
        if loop_start is None and found.invariant == "LIVE-DONE":
            loop_start = self.refinement.stall_loop_start(counterexample.path)
        counterexample.loop_start = loop_start
        counterexample.states, counterexample.edges = result.distinct, result.steps
        result.counterexample = counterexample
        result.violation = WalkViolation(
            found.walk, found.seed, found.invariant, message, found.found, tuple(actions), loop_start
        )

    def path_of(self, actions: Sequence[tuple]) -> list[tuple[tuple, list[str]]]:
        """(action, transitions it fired) along `actions` from the initial world, up to a violation."""
        run, path = self.start(), []
        for action in actions:
            try:
                self.take(run, action)
            except (InvariantViolation, _Livelock):
                path.append((action, self.refinement.fired(run.world)))
                break
            path.append((action, self.refinement.fired(run.world)))
        return path


# ------------------------------------------------------------------------------------------ kvstate check --simulate
def simulate_bound(
    bound: Bound,
    scope: SimulationScope,
    *,
    spec: Spec | None = None,
    time_limit: float | None = None,
    shrink_seconds: float = DEFAULT_SHRINK_SECONDS,
    counterexample_dir: Path | None = None,
    progress: Callable[[SimulationResult], None] | None = None,
    scheduler_class: type = ObservedScheduler,
) -> SimulationResult:
    """Simulate one bound; a counterexample is written (regression test and trace) to `counterexample_dir`."""
    spec = spec if spec is not None else default_spec()
    start = time.perf_counter()  # the refinement's reference outputs are derived work the time limit counts
    simulator = Simulator(Refinement(bound, spec, None, scheduler_class), scope)
    left = None if time_limit is None else max(0.01, time_limit - (time.perf_counter() - start))
    result = simulator.run(time_limit=left, shrink_seconds=shrink_seconds, progress=progress)
    found = result.counterexample
    if found is not None and counterexample_dir is not None:
        result.counterexample_file = write_refinement_test(counterexample_dir, bound, spec, found)
        traced = trace_path(counterexample_dir, result.counterexample_file.stem)
        result.counterexample_trace = write_refinement(traced, bound, spec, found, scheduler_class)
    return result


def simulation_lines(result: SimulationResult) -> list[str]:
    """The report of one bound's simulation: what it covered, its verdict and, if violated, the counterexample."""
    scope, bound = result.scope, result.bound
    lines = [
        f"bound {bound.name}: {describe_bound(bound)}",
        f"  simulation: {result.walks} walk(s) ({result.final_walks} reached a final world, "
        f"{result.cut_walks} stopped at depth {scope.depth}), {result.steps} actions, "
        f"{result.distinct} distinct worlds, {result.seconds:.2f} s "
        f"({result.rate:.0f} actions/s): {result.verdict}" + (f" ({result.stop_reason})" if result.stop_reason else ""),
    ]
    if result.verdict == HOLDS:
        lines.append(
            f"  holds within scope: {scope.describe()} (walk k seeded walk_seed({scope.seed}, k)), every action "
            "checked as the exhaustive search checks it; the abstraction is not matched against the abstract "
            "model's reachable set, and worlds no walk visited are not judged"
        )
    violation = result.violation
    if violation is not None:
        lines.append(f"  verdict: {result.verdict} ({violation.invariant})")
        lines += counterexample_lines(result, violation)
    else:
        lines.append(f"  verdict: {result.verdict}")
    return lines


def counterexample_lines(result: SimulationResult, violation: WalkViolation) -> list[str]:
    """The shrunk counterexample as numbered actions, as the exhaustive checker prints its own."""
    bound = result.bound
    if violation.walk < 0:
        return [f"counterexample (simulation, bound {bound.name}): {violation.message}"]
    lines = [
        (
            f"counterexample (simulation, bound {bound.name}, walk {violation.walk}, walk seed {violation.seed}, "
            f"found after {result.seconds_to_violation or 0.0:.2f} s): {violation.message}"
        ),
        (
            f"  the walk violated it after {len(violation.found)} actions; shrunk to {len(violation.shrunk)} in "
            f"{result.shrink_seconds:.2f} s (delta debugging on the walk's actions, same invariant)"
        ),
    ]
    path = result.counterexample.path if result.counterexample is not None else []
    for n, (action, fired) in enumerate(path, 1):
        if violation.loop_start is not None and n - 1 == violation.loop_start:
            lines.append("   -- the following steps repeat forever --")
        lines.append(f"{n}. {' '.join(map(str, action))}" + (f": {'; '.join(fired)}" if fired else ""))
    if result.counterexample_file is not None:
        lines.append(f"  wrote regression test {result.counterexample_file}")
    if result.counterexample_trace is not None:
        traced = result.counterexample_trace
        lines.append(f"  wrote counterexample trace {traced.path} ({traced.lines} lines)")
    return lines


def run_simulation(
    bounds: list[Bound],
    scope: SimulationScope,
    *,
    spec: Spec | None = None,
    time_limit: float | None = None,
    counterexample_dir: Path | None = None,
    say: Callable[[str], None] = print,
    progress: Callable[[SimulationResult], None] | None = None,
) -> tuple[int, list[SimulationResult]]:
    """Simulate every bound (`time_limit` seconds each), print the report; (exit code, results)."""
    spec = spec if spec is not None else default_spec()
    say(f"kvstate check --simulate: spec {spec.source}; bounds {', '.join(b.name for b in bounds)}; {scope.describe()}")
    results = []
    for bound in bounds:
        result = simulate_bound(
            bound, scope, spec=spec, time_limit=time_limit, counterexample_dir=counterexample_dir, progress=progress
        )
        results.append(result)
        for line in simulation_lines(result):
            say(line)
    verdict = combine(*(r.verdict for r in results))
    say(f"verdict: {verdict} ({len(results)} bound(s), {scope.describe()}, exit {EXIT_CODES[verdict]})")
    return EXIT_CODES[verdict], results

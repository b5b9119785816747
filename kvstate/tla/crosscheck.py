"""`kvstate check --engine tlc`: our checker and TLC on the abstract model of the same bounds, side by side.

For each bound both engines enumerate the abstract model, TLC on the module `kvstate export tla` writes (in a
temporary directory), ours with `kvstate.checker.explore`. TLC runs in processes of its own, `TLC_PROCESSES` models
at a time, while ours works through the bounds here, so two cores are both used. Compared, per bound:

* the safety verdict: every invariant of `kvstate.tla.invariants` (our checker's state and step predicates) and
  DEADLOCK, over every reachable state;
* when it holds: the distinct states and the depth (states on the longest shortest path, TLC's "depth of the
  complete state graph search"), with symmetry over interchangeable requests or, with `symmetry=False`, without;
* when it is violated: the invariant and the length of the shortest counterexample. TLC's counterexample is replayed
  on our model (`kvstate.tla.translate`) and written as a lifecycle trace that `kvstate report` draws.

A bound whose abstract model uses a feature the exported module does not express (`kvstate.tla.models.unsupported`:
chunk cuts by a token budget per pass) is not run by either engine, and the line saying so names the feature.

Liveness is not compared, because the engines compute different properties. Ours judges LIVE-DONE as "every
reachable bottom SCC of the graph without environment events is all-done" (from every reachable state some run
of scheduler and executor steps ends every request); TLC checks `LIVE_DONE`, the LTL property "every request
reaches done" under the module's per-action weak fairness (SPEC.md F1-F4). `liveness=True` also runs TLC's check
and prints both verdicts, each with its property.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kvstate.checker.bounds import Bound
from kvstate.checker.explore import HOLDS, INCOMPLETE, VIOLATED, ModelResult, explore
from kvstate.checker.model import AbstractModel
from kvstate.checker.runner import EXIT_CODES
from kvstate.errors import KVStateError
from kvstate.semantics import TLA, TlaMeaning
from kvstate.spec import Spec
from kvstate.tla import invariants
from kvstate.tla.models import ModelFiles, export, symmetry_groups, unsupported
from kvstate.tla.module import tla_id
from kvstate.tla.tlc import ERROR, TlcRun, TlcState, TlcTools, find_tools, run_tlc
from kvstate.tla.translate import TraceMismatch, tlc_steps, trace_lines

LIVE_DONE = "LIVE-DONE"
TLC_PROCESSES = 2  # TLC processes at once (one worker each: TLC's shortest counterexamples and depths need one)


@dataclass(frozen=True, slots=True)
class EngineVerdict:
    """One engine's safety result on one bound: `invariant` is the violated one (spec id), `length` the number of
    steps of its counterexample."""

    verdict: str
    states: int | None
    depth: int | None
    seconds: float
    invariant: str | None = None
    length: int | None = None


@dataclass
class Comparison:
    """Both engines on one bound; `mismatches` lists every difference (empty: they agree)."""

    bound: Bound
    symmetric: bool
    ours: EngineVerdict
    tlc: EngineVerdict
    mismatches: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    ours_liveness: str = ""
    tlc_liveness: str = ""
    tlc_trace: list[TlcState] = field(default_factory=list, repr=False)
    tlc_lasso: TlcRun | None = field(default=None, repr=False)  # TLC's LIVE_DONE run, when it found a lasso
    trace_files: list[tuple[str, Path]] = field(default_factory=list)  # (what TLC found, the trace written)

    @property
    def verdict(self) -> str:
        if self.mismatches:
            return VIOLATED
        return self.ours.verdict


def ours(bound: Bound, spec: Spec, *, symmetry: bool, time_limit: float | None) -> tuple[EngineVerdict, ModelResult]:
    """Our checker's safety verdict on the abstract model (LIVE-DONE is judged after every state is found, so a
    LIVE-DONE violation still means every invariant holds)."""
    result = explore(AbstractModel(bound, spec, symmetry=symmetry), time_limit=time_limit)
    violation = result.violation
    if violation is not None and violation.invariant != LIVE_DONE:
        return EngineVerdict(VIOLATED, None, None, result.seconds, violation.invariant, len(violation.path)), result
    complete = result.verdict != INCOMPLETE
    return (
        EngineVerdict(
            HOLDS if complete else INCOMPLETE,
            result.states if complete else None,
            result.depth if complete else None,
            result.seconds,
        ),
        result,
    )


def tlc_verdict(run: TlcRun, names: Mapping[str, str]) -> EngineVerdict:
    """TLC's safety verdict, the violated TLA+ name mapped back to its spec id."""
    if run.verdict == VIOLATED:
        invariant = names.get(run.violated or "", run.violated)
        return EngineVerdict(VIOLATED, None, None, run.seconds, invariant, max(len(run.trace) - 1, 0))
    complete = run.verdict == HOLDS
    return EngineVerdict(run.verdict, run.states if complete else None, run.depth if complete else None, run.seconds)


def compare(ours_verdict: EngineVerdict, tlc: EngineVerdict) -> list[str]:
    """Every difference between the two safety results (nothing is compared when either is incomplete)."""
    if INCOMPLETE in (ours_verdict.verdict, tlc.verdict):
        return []
    pairs: list[tuple[str, object, object]] = [("verdict", ours_verdict.verdict, tlc.verdict)]
    if ours_verdict.verdict == tlc.verdict == HOLDS:
        pairs += [("distinct states", ours_verdict.states, tlc.states), ("depth", ours_verdict.depth, tlc.depth)]
    elif ours_verdict.verdict == tlc.verdict == VIOLATED:
        pairs += [
            ("violated invariant", ours_verdict.invariant, tlc.invariant),
            ("counterexample length", ours_verdict.length, tlc.length),
        ]
    return [f"{what}: ours {a}, TLC {b}" for what, a, b in pairs if a != b]


@dataclass(frozen=True)
class Options:
    """How to cross-check; `meanings` may replace the TLA+ meanings of `kvstate.semantics` (a test plants a
    difference between a TLA+ meaning and its Python one)."""

    symmetry: bool = True
    liveness: bool = False
    time_limit: float | None = None
    counterexample_dir: Path | None = None
    meanings: Mapping[str, TlaMeaning] = field(default_factory=lambda: TLA)


def cross_check(
    bounds: list[Bound],
    spec: Spec,
    options: Options = Options(),
    *,
    say: Callable[[str], None] = print,
    tools: TlcTools | None = None,
) -> tuple[int, list[Comparison]]:
    """Run both engines on every bound, print the table; (exit code, comparisons)."""
    tools = tools if tools is not None else find_tools()
    state_ids, step_ids = invariants.checked_ids(spec)
    names = {tla_id(i): i for i in [*state_ids, *step_ids, invariants.DEADLOCK_ID, LIVE_DONE]}
    runnable = [b for b in bounds if b.abstract_model and unsupported(b) is None]
    for b in bounds:
        if not b.abstract_model:
            say(
                f"bound {b.name}: not run (abstract_model = false: too large to enumerate, or another bound's; neither "
                "engine runs it)"
            )
        elif (why := unsupported(b)) is not None:
            say(f"{why} (not run by either engine)")
    say(
        f"kvstate check --engine tlc: spec {spec.source}; TLC {tools.jar}; "
        f"{'with' if options.symmetry else 'without'} symmetry; {len(runnable)} bound(s)"
    )
    with tempfile.TemporaryDirectory(prefix="kvstate-tla-") as tmp, ThreadPoolExecutor(TLC_PROCESSES) as pool:
        _, models = export(spec, runnable, Path(tmp), symmetry=options.symmetry, meanings=options.meanings)
        run = _Run(Path(tmp), tools, options, names, lambda text: say(f"  TLC: {text}"))
        tlc_runs = [  # TLC works through them, TLC_PROCESSES at a time, while ours runs here
            (pool.submit(run.tlc, m, "cfg"), pool.submit(run.tlc, m, "liveness") if options.liveness else None)
            for m in models
        ]
        comparisons = []
        try:
            for n, (model, (safety, live)) in enumerate(zip(models, tlc_runs, strict=True), 1):
                say(f"[{n}/{len(models)}] bound {model.bound.name}: our checker and TLC running ...")
                comparison = run.compare(model, spec, safety, live)
                comparisons.append(comparison)
                for line in report_lines(comparison):
                    say(line)
        finally:
            pool.shutdown(cancel_futures=True)  # an interrupted check starts no further TLC run
    return _summary(comparisons, say), comparisons


@dataclass(frozen=True, slots=True)
class _Run:
    """What every bound of one cross-check shares: the exported files' directory, the tools, the options, the TLA+
    names of the checked invariants (mapped to their spec ids) and where TLC's progress lines (one a minute) go."""

    directory: Path
    tools: TlcTools
    options: Options
    names: Mapping[str, str]
    progress: Callable[[str], None]

    def tlc(self, model: ModelFiles, check: str) -> TlcRun:
        """TLC on `model`'s safety check ("cfg") or its liveness check ("liveness")."""
        config = f"{model.name}.cfg" if check == "cfg" else f"{model.name}_liveness.cfg"
        return run_tlc(
            self.tools, self.directory, model.name, config, time_limit=self.options.time_limit, progress=self.progress
        )

    def compare(self, model: ModelFiles, spec: Spec, safety: Future[TlcRun], live: Future[TlcRun] | None) -> Comparison:
        """Ours on `model`'s bound (here, while TLC runs), then both results side by side."""
        options = self.options
        mine, result = ours(model.bound, spec, symmetry=options.symmetry, time_limit=options.time_limit)
        comparison = _compare_runs(model, mine, result, safety.result(), live.result() if live else None, self.names)
        if options.counterexample_dir is not None:
            _write_counterexamples(comparison, spec, options.counterexample_dir)
        return comparison


def _compare_runs(
    model: ModelFiles,
    mine: EngineVerdict,
    result: ModelResult,
    safety: TlcRun,
    live: TlcRun | None,
    names: Mapping[str, str],
) -> Comparison:
    tlc = tlc_verdict(safety, names)
    comparison = Comparison(model.bound, model.symmetric, mine, tlc, compare(mine, tlc), tlc_trace=safety.trace)
    if safety.verdict == ERROR:
        comparison.mismatches.append("TLC failed: " + " | ".join(safety.errors)[:2000])
    comparison.ours_liveness = _ours_liveness(result)
    if live is not None:
        comparison.tlc_liveness = live.verdict + (f" ({live.violated})" if live.violated else "")
        comparison.tlc_lasso = live if live.verdict == VIOLATED else None
    return comparison


def _ours_liveness(result: ModelResult) -> str:
    if result.verdict == INCOMPLETE or (result.violation is not None and result.violation.invariant != LIVE_DONE):
        return "not judged"
    return VIOLATED if result.violation is not None else HOLDS


def _write_counterexamples(comparison: Comparison, spec: Spec, out: Path) -> None:
    """Replay TLC's counterexamples (safety, and LIVE_DONE's lasso when it found one) on our model and write each as
    a trace; a counterexample our model cannot take is a mismatch."""
    bound = comparison.bound
    model = AbstractModel(bound, spec)
    found: list[tuple[str, list[TlcState], int | None]] = []  # (what TLC found, its trace, where a lasso loops)
    if comparison.tlc.verdict == VIOLATED:
        found.append(("counterexample", comparison.tlc_trace, None))
    if comparison.tlc_lasso is not None:
        lasso = comparison.tlc_lasso
        closing = [lasso.trace[lasso.loop_start]] if lasso.loop_start is not None else []
        found.append(("liveness", lasso.trace + closing, lasso.loop_start))
    for kind, trace, loop_start in found:
        try:
            steps = tlc_steps(model, trace)
        except TraceMismatch as err:
            comparison.mismatches.append(f"TLC's {kind} is no run of our model: {err}")
            continue
        lines, cut = trace_lines(model, steps)
        path = out / f"kvstate-tlc-{kind}-{bound.name}.ndjson"
        try:
            out.mkdir(parents=True, exist_ok=True)
            with path.open("w", encoding="utf-8") as handle:
                for line in lines:
                    handle.write(json.dumps(line, separators=(",", ":")) + "\n")
        except OSError as err:
            raise KVStateError(f"cannot write {path}: {err.strerror}; pass a writable --counterexample-dir") from err
        comparison.trace_files.append((kind, path))
        if loop_start is not None:
            comparison.notes.append(f"{path.name}: the steps from iteration {loop_start + 1} on repeat forever")
        if cut:
            comparison.notes.append(f"{path.name}: {cut}")


def _cell(v: EngineVerdict) -> str:
    if v.verdict == HOLDS:
        return f"{v.states} states, depth {v.depth}, holds, {v.seconds:.1f} s"
    if v.verdict == VIOLATED:
        return f"violated ({v.invariant}, counterexample of {v.length} steps), {v.seconds:.1f} s"
    return f"{v.verdict}, {v.seconds:.1f} s"


def _reduction(c: Comparison) -> str:
    if c.symmetric:
        return "symmetry over equal requests"
    return "no symmetry" if symmetry_groups(c.bound) else "no symmetry set: its requests all differ"


def report_lines(c: Comparison) -> list[str]:
    lines = [
        f"bound {c.bound.name} ({_reduction(c)}):",
        f"  ours: {_cell(c.ours)}",
        f"  TLC:  {_cell(c.tlc)}",
    ]
    if c.ours_liveness:
        lines.append(f"  liveness, ours (every reachable bottom SCC of the fair graph all-done): {c.ours_liveness}")
    if c.tlc_liveness:
        lines.append(f"  liveness, TLC (LIVE_DONE under per-action weak fairness, no symmetry): {c.tlc_liveness}")
    for kind, path in c.trace_files:
        lines.append(f"  TLC's {kind} as a trace: {path} (draw it with `kvstate report`)")
    lines += [f"    {note}" for note in c.notes]
    lines += [f"  MISMATCH {m}" for m in c.mismatches]
    lines.append(f"  equal: {'no' if c.mismatches else 'yes'}")
    return lines


def _summary(comparisons: list[Comparison], say: Callable[[str], None]) -> int:
    say("")
    say(f"{'bound':<22} {'ours: states, depth, verdict':>34}   {'TLC: states, depth, verdict':>34}   equal")
    for c in comparisons:
        say(f"{c.bound.name:<22} {_short(c.ours):>34}   {_short(c.tlc):>34}   {'no' if c.mismatches else 'yes'}")
    if any(c.mismatches for c in comparisons):
        say(f"verdict: the engines disagree on {sum(1 for c in comparisons if c.mismatches)} bound(s) (exit 1)")
        return 1
    verdicts = {c.ours.verdict for c in comparisons}
    verdict = VIOLATED if VIOLATED in verdicts else INCOMPLETE if INCOMPLETE in verdicts else HOLDS
    say(f"verdict: {verdict}, both engines agree ({len(comparisons)} bound(s), exit {EXIT_CODES[verdict]})")
    return EXIT_CODES[verdict]


def _short(v: EngineVerdict) -> str:
    if v.verdict == HOLDS:
        return f"{v.states}, {v.depth}, holds"
    if v.verdict == VIOLATED:
        return f"violated {v.invariant} in {v.length} steps"
    return v.verdict

"""`check_bound` and `run_check`: the code path of `kvstate check` (abstract model, then scheduler refinement).

Verdicts are three-valued: `holds`, `violated`, `incomplete` (a search cut by --max-states or --time-limit never
reports holds). A violation prints its shortest counterexample and writes it as a pytest regression test.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, Unpack

from kvstate.checker.bounds import Bound
from kvstate.checker.counterexample_trace import CounterexampleTrace, trace_path, write_abstract, write_refinement
from kvstate.checker.effects import AbstractEffects
from kvstate.checker.explore import HOLDS, INCOMPLETE, SKIPPED, VIOLATED, ModelResult, explore
from kvstate.checker.invariants import InvariantPlan, plan_invariants
from kvstate.checker.model import AbstractModel
from kvstate.checker.observed import ObservedScheduler
from kvstate.checker.refinement import Refinement, RefinementResult
from kvstate.checker.replay import format_abstract_path
from kvstate.errors import KVStateError
from kvstate.semantics import Guard
from kvstate.spec import Spec, Transition, default_spec, packaged_spec_path
from kvstate.terminal import description_column, inert, say

if TYPE_CHECKING:  # rich is imported only where a console is in use
    from rich.console import Console
    from rich.progress import Progress

EXIT_CODES = {HOLDS: 0, VIOLATED: 1, INCOMPLETE: 3}  # 2 is the command line's usage error


@dataclass
class BoundReport:
    bound: Bound
    abstract: ModelResult
    refinement: RefinementResult | None
    verdict: str
    counterexample: list[str]
    counterexample_file: Path | None = None
    violated_invariant: str | None = None
    counterexample_trace: CounterexampleTrace | None = None  # the counterexample as a trace (kvstate report draws it)
    fair_lasso_lines: list[str] = field(default_factory=list)  # the abstract model's weakly fair lasso, numbered


def combine(*verdicts: str) -> str:
    if VIOLATED in verdicts:
        return VIOLATED
    if INCOMPLETE in verdicts:
        return INCOMPLETE
    return HOLDS


class Injected(TypedDict, total=False):
    """What a planted-bug test may put in place of the real semantics (`check_bound`, `run_check`)."""

    guards: Mapping[str, Guard] | None  # default: kvstate.semantics.GUARDS
    effects: type  # the abstract model's effect hooks; default AbstractEffects
    scheduler_class: type  # the scheduler the refinement drives; default ObservedScheduler


def check_bound(
    bound: Bound,
    *,
    spec: Spec | None = None,
    max_states: int | None = None,
    time_limit: float | None = None,
    refine: bool = True,
    progress: Callable[[str, int, int], None] | None = None,
    counterexample_dir: Path | None = None,
    **inject: Unpack[Injected],
) -> BoundReport:
    """Check one bound; `spec` and the semantics (`Injected`) may be injected (planted bugs)."""
    spec = spec if spec is not None else default_spec()
    plan_invariants(spec)
    start = time.perf_counter()
    model = AbstractModel(bound, spec, inject.get("guards"), inject.get("effects", AbstractEffects), symmetry=False)
    if bound.abstract_model:
        abstract = explore(
            model,
            max_states=max_states,
            time_limit=time_limit,
            keep_states=refine,
            progress=(lambda s, e: progress("abstract", s, e)) if progress else None,
        )
    else:  # too large to enumerate (bounds.py): the refinement alone checks this bound
        abstract = ModelResult(bound, SKIPPED)
    refinement = None
    lines: list[str] = []
    if abstract.verdict != VIOLATED and refine:
        refiner = Refinement(  # its reference outputs are derived work the time limit counts
            bound,
            spec,
            abstract.reachable if abstract.verdict == HOLDS else None,
            inject.get("scheduler_class", ObservedScheduler),
        )
        left = None if time_limit is None else max(0.01, time_limit - (time.perf_counter() - start))
        refinement = refiner.explore(
            max_states=max_states,
            time_limit=left,
            progress=(lambda s, e: progress("refinement", s, e)) if progress else None,
        )
    abstract.reachable = None  # free memory
    verdicts = [v for v in (abstract.verdict, refinement.verdict if refinement else None) if v not in (SKIPPED, None)]
    report = BoundReport(bound, abstract, refinement, combine(*verdicts) if verdicts else INCOMPLETE, lines)
    if abstract.fair_lasso is not None:
        report.fair_lasso_lines = format_abstract_path(model, abstract.fair_lasso)
    if abstract.violation is not None:
        report.violated_invariant = abstract.violation.invariant
        lines += [
            (
                f"counterexample (abstract model, bound {bound.name}): invariant {abstract.violation.invariant} "
                f"violated: {abstract.violation.message}"
            ),
            *format_abstract_path(model, abstract.violation),
        ]
        if counterexample_dir is not None:
            report.counterexample_file = write_abstract_test(counterexample_dir, bound, spec, abstract)
            traced = trace_path(counterexample_dir, report.counterexample_file.stem)
            report.counterexample_trace = write_abstract(traced, spec, model, abstract.violation)
    elif refinement is not None and refinement.verdict == VIOLATED:
        report.violated_invariant = refinement.violation_id
        lines.append(f"counterexample (scheduler refinement, bound {bound.name}): {refinement.message}")
        for n, (action, fired) in enumerate(refinement.path, 1):
            if refinement.loop_start is not None and n - 1 == refinement.loop_start:
                lines.append("   -- the following steps repeat forever --")
            lines.append(f"{n}. {' '.join(map(str, action))}" + (f": {'; '.join(fired)}" if fired else ""))
        if counterexample_dir is not None:
            report.counterexample_file = write_refinement_test(counterexample_dir, bound, spec, refinement)
            traced = trace_path(counterexample_dir, report.counterexample_file.stem)
            scheduler_class = inject.get("scheduler_class", ObservedScheduler)
            report.counterexample_trace = write_refinement(traced, bound, spec, refinement, scheduler_class)
    return report


# ------------------------------------------------------------------------------------- regression test files
def _slug(text: str) -> str:
    return re.sub(r"\W+", "_", text, flags=re.ASCII).strip("_").lower() or "bound"  # a plain identifier part


def _spec_path(spec: Spec) -> str | None:
    try:
        if Path(spec.source).resolve() == packaged_spec_path().resolve():
            return None
    except OSError:
        pass
    return str(Path(spec.source).resolve()) if Path(spec.source).is_file() else None


def _header(kind: str, bound: Bound, invariant: str, message: str, spec: Spec) -> str:
    """The module docstring and the constants that describe the violation.

    Every value that comes from the spec or the violation (names, messages, paths may hold quotes, newlines or code)
    is written only as a `repr()` literal, never inside the docstring or a comment, so importing the file runs no
    text of the spec. `kind` is one of this module's own words.
    """
    return (
        f'"""Regression test written by `kvstate check`: a counterexample of the {kind}.\n\n'
        "BOUND_NAME, VIOLATED and SPEC_SOURCE say which bound, which invariant (and how) and which spec.\n"
        "It replays the steps with the real guards and effects and fails while the violation is still there;\n"
        'it passes once a step is no longer enabled or the invariant holds along the whole path.\n"""\n\n'
        f"BOUND_NAME = {bound.name!r}\n"
        f"VIOLATED = {f'invariant {invariant}: {message}'!r}\n"
        f"SPEC_SOURCE = {spec.source!r}\n"
    )


def write_abstract_test(directory: Path, bound: Bound, spec: Spec, result: ModelResult) -> Path:
    violation = result.violation
    if violation is None:
        raise ValueError(f"bound {bound.name}: the abstract model found no violation; there is no counterexample")
    steps = "".join(f"    {tuple(action)!r},\n" for action, _ in violation.path)
    text = _header("abstract model", bound, violation.invariant, violation.message, spec) + (
        "from kvstate.checker.replay import replay_abstract\n\n"
        f"BOUND = {bound.to_dict()!r}\n"
        f"SPEC_PATH = {_spec_path(spec)!r}\n"
        f"INVARIANT = {violation.invariant!r}\n"
        f"STEPS = [\n{steps}]\n\n\n"
        f"def test_{_slug(bound.name)}_{_slug(violation.invariant)}():\n"
        "    replay_abstract(BOUND, STEPS, invariant=INVARIANT, spec_path=SPEC_PATH)\n"
    )
    return _write(directory / f"kvstate-counterexample-{_slug(bound.name)}.py", text)


def write_refinement_test(directory: Path, bound: Bound, spec: Spec, result: RefinementResult) -> Path:
    invariant = result.violation_id
    if invariant is None:
        raise ValueError(f"bound {bound.name}: the refinement found no violation; there is no counterexample")
    actions = "".join(f"    {tuple(action)!r},\n" for action, _ in result.path)
    text = _header("scheduler refinement", bound, invariant, result.message, spec) + (
        "from kvstate.checker.replay import replay_refinement\n\n"
        f"BOUND = {bound.to_dict()!r}\n"
        f"SPEC_PATH = {_spec_path(spec)!r}\n"
        f"INVARIANT = {invariant!r}\n"
        f"ACTIONS = [\n{actions}]\n\n\n"
        f"def test_{_slug(bound.name)}_{_slug(invariant)}():\n"
        "    replay_refinement(BOUND, ACTIONS, invariant=INVARIANT, spec_path=SPEC_PATH)\n"
    )
    return _write(directory / f"kvstate-counterexample-{_slug(bound.name)}.py", text)


def _write(path: Path, text: str) -> Path:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as err:
        raise KVStateError(f"cannot write {path}: {err.strerror}; pass a writable --counterexample-dir") from err
    return path


# ----------------------------------------------------------------------------------------------- reporting
def describe_bound(bound: Bound) -> str:
    reqs = ", ".join(f"{p}+{m}" for p, m in bound.requests)
    budgets = "".join(
        f", {label} {value}"
        for label, value in (("batch", bound.max_batch_size), ("tokens", bound.max_num_tokens))
        if value is not None
    )
    return (
        f"requests [{reqs}] (prompt+max_new), gpu {bound.gpu_blocks}, host {bound.host_blocks}, "
        f"block {bound.block_size}, chunk {bound.chunk_size}, stages {bound.pipeline_stages}{budgets}"
        + (f", {bound.micro_batches} micro-batches in flight" if bound.micro_batches > 1 else "")
        + (f", copies up to {bound.copy_delay} pass(es) late" if bound.copy_delay else "")
        + (f", {bound.env_copy_failures} failed cop(ies)" if bound.env_copy_failures else "")
        + (f", offload {bound.offload}" if bound.offload is not None else "")
        + (f", {bound.env_aborts} abort(s)" if bound.env_aborts and bound.cancel else "")
        + (f", stop tokens at {list(bound.stop_at)}" if bound.stop_tokens else "")
        + (f", preemption cap {bound.max_preemptions}" if bound.max_preemptions is not None else "")
        + (f", no-progress limit {bound.no_progress_limit}" if bound.no_progress_limit is not None else "")
        + ("" if bound.cancel else ", no cancel")
    )


def report_lines(report: BoundReport, spec: Spec, *, verbose: bool = False) -> list[str]:
    """The lines of one bound's report; `verbose` adds what is information only: the transitions this bound never
    enables (other bounds take them: the overall coverage says whether any bound does) and the progress-free SCCs."""
    a = report.abstract
    total = len(spec.transitions)
    lines = [f"bound {report.bound.name}: {describe_bound(report.bound)}"]
    coverage = (
        f"coverage {total - len(a.never_enabled)}/{total} transitions" if a.verdict == HOLDS else "coverage not judged"
    )
    if a.verdict == SKIPPED:
        lines.append(
            "  abstract model: not run (abstract_model = false: too large to enumerate, or another bound's; the "
            "refinement checks REFINES action by action)"
        )
    else:
        lines.append(
            f"  abstract model: {a.states} states ({a.symmetric_states} up to symmetry), {a.edges} edges, "
            f"{a.seconds:.2f} s ({a.rate:.0f} states/s), {coverage}: {a.verdict}"
            + (f" ({a.stop_reason})" if a.stop_reason else "")
        )
    if a.verdict == HOLDS:
        lines.append(
            "    liveness: DEADLOCK and no trap hold (every request can still finish from every reachable state); "
            + (
                f"weak fairness alone admits a fair lasso of {len(a.fair_lasso.path) - (a.fair_lasso.loop_start or 0)} "
                "steps (expected: this model has no policy; the refinement checks LIVE-DONE)"
                if a.fair_lasso is not None
                else "weak fairness alone already makes every request finish"
            )
        )
        if a.never_enabled and verbose:
            lines.append(
                "    never enabled in this bound (information: other bounds may take them): "
                + ", ".join(f"{t.source} -{t.event}-> {t.dest}" for t in a.never_enabled)
            )
        if verbose:
            lines.append(
                f"    progress-free cycles (information: cycles a policy may take without progress, left by a fair "
                f"non-environment action): {a.progress_free_sccs} non-trivial SCCs with an unfinished request"
            )
            if a.fair_lasso is not None:
                lines.append(f"    the fair lasso: {a.fair_lasso.message}")
                lines.extend(f"      {line}" for line in report.fair_lasso_lines)
    r = report.refinement
    if r is not None:
        checked = (
            "abstraction in the model's reachable set"
            if r.abstract_checked
            else f"abstraction not matched (model {'not run' if a.verdict == SKIPPED else 'incomplete'})"
        )
        lines.append(
            f"  scheduler refinement: {r.states} states, {r.edges} edges, {r.seconds:.2f} s "
            f"({r.rate:.0f} states/s), {checked}: {r.verdict}" + (f" ({r.stop_reason})" if r.stop_reason else "")
        )
    lines.append(
        f"  verdict: {report.verdict}" + (f" ({report.violated_invariant})" if report.violated_invariant else "")
    )
    return lines


def overall_coverage(reports: list[BoundReport], spec: Spec) -> tuple[list, list]:
    """(taken somewhere, never enabled in any complete bound) over every bound whose abstract model ran."""
    taken: set[Transition] = set()
    for r in reports:
        taken.update(r.abstract.taken)
    if all(r.abstract.verdict == SKIPPED for r in reports):
        return [], []  # no abstract model ran: coverage is not judged
    return [t for t in spec.transitions if t in taken], [t for t in spec.transitions if t not in taken]


def _progress_callback(bar: Progress, name: str) -> Callable[[str, int, int], None]:
    """A `progress(phase, states, edges)` callback that updates one task of a rich progress bar."""
    task = bar.add_task(f"{name}: starting")

    def callback(phase: str, states: int, edges: int) -> None:
        bar.update(task, description=f"{name}: {phase} {states} states, {edges} edges")

    return callback


def run_check(  # noqa: PLR0913 - keyword-only, one per `kvstate check` option
    bounds: list[Bound],
    *,
    spec: Spec | None = None,
    max_states: int | None = None,
    time_limit: float | None = None,
    counterexample_dir: Path | None = Path("."),
    console: Console | None = None,
    show_progress: bool = False,
    refine: bool = True,
    verbose: bool = False,
    **inject: Unpack[Injected],
) -> tuple[int, list[BoundReport]]:
    """Check every bound, print the report; returns (exit code, reports)."""
    spec = spec if spec is not None else default_spec()
    plan: InvariantPlan = plan_invariants(spec)
    say = _printer(console)
    say(f"kvstate check: spec {spec.source}; bounds {', '.join(b.name for b in bounds)}")
    for line in plan.lines():
        say(f"  {line}")
    reports = []
    for bound in bounds:
        progress_ctx: AbstractContextManager[Progress | None] = nullcontext(None)
        if show_progress and console is not None:
            from rich.progress import Progress, SpinnerColumn, TimeElapsedColumn

            progress_ctx = Progress(
                SpinnerColumn(), description_column(), TimeElapsedColumn(), console=console, transient=True
            )
        with progress_ctx as bar:
            callback = _progress_callback(bar, bound.name) if bar is not None else None
            report = check_bound(
                bound,
                spec=spec,
                max_states=max_states,
                time_limit=time_limit,
                refine=refine,
                progress=callback,
                counterexample_dir=counterexample_dir,
                **inject,
            )
        reports.append(report)
        for line in report_lines(report, spec, verbose=verbose) + report.counterexample:
            say(line)
        if report.counterexample_file is not None:
            say(f"  wrote regression test {report.counterexample_file}")
        if report.counterexample_trace is not None:
            traced = report.counterexample_trace
            say(f"  wrote counterexample trace {traced.path} ({traced.lines} lines)")
    taken, never = overall_coverage(reports, spec)
    verdict = combine(*(r.verdict for r in reports))
    summary = [
        f"coverage over all bounds: {len(taken)}/{len(spec.transitions)} transitions taken"
        if taken or never
        else "coverage over all bounds: not judged (no abstract model ran)"
    ]
    if never:
        summary.append("  never taken in any bound: " + ", ".join(f"{t.source} -{t.event}-> {t.dest}" for t in never))
    summary.append(f"verdict: {verdict} ({len(reports)} bound(s), exit {EXIT_CODES[verdict]})")
    for line in summary:
        say(line)
    return EXIT_CODES[verdict], reports


def _printer(console: Console | None) -> Callable[[str], None]:
    """Print one line as inert plain text (`kvstate.terminal`: spec and bound names may hold brackets or control
    characters)."""
    if console is None:
        return lambda text: print(inert(text))
    return lambda text: say(console, text)

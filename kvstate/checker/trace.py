"""Validate a lifecycle trace (spec/TRACE.md) against the specification, line by line (`kvstate validate`).

The validator replays each request's lifecycle from the trace and stops at the first line that diverges from
the spec. Rules, in the order they are checked on a line (edges, states, residencies, terminal states and
invariant ids all come from the `Spec`; nothing is re-typed here except the invariant ids the rules report,
which a test checks against the packaged spec):

* ``format``: the line is a UTF-8 JSON object with exactly the keys of `TRACE_FIELDS`, in that order, each of
  its documented type, read within `TRACE_LIMITS` (line length, file size, nesting, integer digits);
* ``iteration``: `iteration` never decreases down the file;
* ``capacity``: `gpu_capacity` is the same on every line (it is constant for a run);
* ``stutter`` / ``edge``: `(event, from, to)` is an edge of the spec (``stutter`` when `from == to` and the spec
  declares no such self-loop);
* ``from``: a request's first line starts from the spec's initial state, every later line from the state the
  validator holds for it (its previous `to`); a request in a terminal state takes no further line, except one that
  starts from the initial state again and holds as a new request's first line: its id was reused after
  `take_finished` (spec/TRACE.md), and from that line on it is a new request (a line from the initial state that
  breaks a rule as a first line is reported as a ``from`` divergence: a line the ended request took);
* ``residency`` (RES-STATE): a request holds blocks only in the tiers its `to` state's residency allows
  (`kvstate.spec.RESIDENCY_TIERS`: a `gpu` state none on the host, a `held` state in either tier, a `none` state none);
* ``no-host-no-offload`` (NO-HOST-NO-OFFLOAD): with `host_capacity == 0`, no request holds host blocks;
* ``effect`` (RESUME-COPY, FENCE): the line's blocks are what its transition's effect leaves (`EFFECT_RULES`, keyed
  by the effect names of `kvstate.semantics.EffectHooks`, found through the spec's edge): a hold (suspend) moves no
  block; an offload moves k >= 1 of the request's GPU blocks to the host tier and fences them (`gpu_fenced >= k`); a
  resume leaves the request with all its blocks on the GPU (`gpu_blocks` = its GPU + host blocks before, `host_blocks`
  0) and fences the host sources it copies. A request's GPU count as of its last line is exact while it is in a
  state that does not compute (nothing allocates for it between its lines) and a lower bound otherwise;
* ``conservation`` (CONS-HOST / CONS-GPU), over all requests, from the trace alone: a request's host blocks change
  only on its own lines, so the validator knows every request's count and checks the host law exactly,
  `host_free + host_fenced + (host blocks of all requests) == host_capacity`; a request's GPU blocks grow between
  its lines (decode steps allocate) and shrink only on its own lines, so its last count is a lower bound and the
  GPU law is checked as `gpu_free + gpu_fenced + (GPU blocks of all requests, as last seen) <= gpu_capacity`;
* ``generated`` (GEN-APPEND): a request's `generated` never decreases;
* ``done-reason``: `done_reason` is non-null exactly when `to` is terminal, and is the reason the event records;
* ``terminal`` (end of file, with `require_done`): every request ends in a terminal state.

A report is a frozen value: `TraceReport.ok` is True when no rule was broken; otherwise `divergence` names the
first broken rule with its line number. A trace file whose last line is cut short (no newline, and not a whole
line: its writer stopped mid-write, on a full disk say) is validated up to the line before, and `torn_line` names
the cut one; a cut line before the last one is a ``format`` divergence like any other. A ``format`` divergence
means the input is not a usable trace (the CLI exits 2 for it, as for a file it cannot open, which raises
`TraceError`); every other rule means a well-formed trace departs from the spec (exit 1). An empty trace is
vacuously valid here (`lines == 0`); the CLI refuses it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from kvstate.checker.trace_effects import EFFECT_RULES, BlocksBefore
from kvstate.spec import RESIDENCY_TIERS, Spec, Transition, default_spec
from kvstate.trace import TRACE_FIELDS, TRACE_LIMITS, TraceError, open_trace, parse_line, trace_lines
from kvstate.untrusted import Limits, shown

# the trace format (fields, limits, reading) is kvstate.trace's; it is re-exported here with the validator
__all__ = [
    "CAPACITY",
    "CONSERVATION",
    "DONE_REASON",
    "EDGE",
    "EFFECT",
    "EFFECT_RULES",
    "FORMAT",
    "FROM",
    "GENERATED",
    "INVARIANT_IDS",
    "ITERATION",
    "NO_HOST",
    "RESIDENCY",
    "RULES",
    "STUTTER",
    "TERMINAL",
    "TRACE_FIELDS",
    "TRACE_LIMITS",
    "Divergence",
    "TraceError",
    "TraceReport",
    "open_trace",
    "parse_line",
    "trace_lines",
    "validate_trace",
]

# rule names (stable: tests and tools match on them)
FORMAT, ITERATION, CAPACITY, STUTTER, EDGE, FROM = "format", "iteration", "capacity", "stutter", "edge", "from"
RESIDENCY, NO_HOST, EFFECT = "residency", "no-host-no-offload", "effect"
CONSERVATION, GENERATED, DONE_REASON, TERMINAL = "conservation", "generated", "done-reason", "terminal"
RULES = (
    FORMAT,
    ITERATION,
    CAPACITY,
    STUTTER,
    EDGE,
    FROM,
    RESIDENCY,
    NO_HOST,
    EFFECT,
    CONSERVATION,
    GENERATED,
    DONE_REASON,
    TERMINAL,
)

PROGRESS_LINES = 100_000  # lines between two progress reports

# spec invariant ids the rules report (reported only when the spec in use declares them)
INVARIANT_IDS = ("RES-STATE", "NO-HOST-NO-OFFLOAD", "RESUME-COPY", "FENCE", "CONS-GPU", "CONS-HOST", "GEN-APPEND")


@dataclass(frozen=True, slots=True)
class Divergence:
    """The first line at which the trace departs from the spec.

    `expected` is the state the validator holds for the request before this line (None when the line could not
    be parsed far enough to know the request); `observed` is the line's (event, from, to), with None for parts
    the line lacks. `invariant` is the spec invariant id the broken rule checks, when there is one.
    """

    line: int
    request_id: Hashable | None
    rule: str
    invariant: str | None
    expected: str | None
    observed: tuple[object, object, object] | None
    message: str

    def describe(self) -> str:
        """A multi-line, human-readable account of the divergence."""
        rule = f"{self.rule} ({self.invariant})" if self.invariant else self.rule
        lines = [f"line {self.line}: rule {rule} broken"]
        if self.request_id is not None:
            lines.append(f"  request:  {shown(self.request_id)}")
        if self.expected is not None:
            lines.append(f"  expected: state {shown(self.expected)}")
        if self.observed is not None:
            event, source, dest = map(shown, self.observed)
            lines.append(f"  observed: event {event}, from {source} to {dest}")
        lines.append(f"  {self.message}")
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class TraceReport:
    """The result of validating one trace. Mappings are read-only views."""

    source: str
    lines: int  # non-blank lines read, up to and including a divergent one
    requests: int
    transitions: Mapping[str, int]  # event -> lines with that event (lines before a divergence)
    final_states: Mapping[Hashable, str]  # request id -> the state the validator holds at the end
    divergence: Divergence | None
    torn_line: int | None = None  # the file's last line, cut mid-write and left unvalidated

    @property
    def ok(self) -> bool:
        return self.divergence is None


def validate_trace(
    source: str | Path | Iterable[str | bytes],
    spec: Spec | None = None,
    *,
    require_done: bool = True,
    limits: Limits = TRACE_LIMITS,
    progress: Callable[[int], None] | None = None,
) -> TraceReport:
    """Validate a trace file (a path) or its lines (an iterable of str or bytes) against `spec` (default: packaged).

    Stops at the first divergence; a line over `limits` is a ``format`` divergence at that line. Raises
    `TraceError` when a path cannot be opened. `progress` is told the lines read so far every `PROGRESS_LINES`
    lines. Reading is linear in the lines: each costs O(1) whatever the number of requests.
    """
    spec = spec if spec is not None else default_spec()
    if isinstance(source, (str, Path)):
        with open_trace(source) as handle:
            validator = _Validator(spec, str(source), limits, progress, file=True)
            return validator.run(trace_lines(handle, limits, path=source), require_done)
    return _Validator(spec, "<lines>", limits, progress).run(enumerate(source, 1), require_done)


class _Stop(Exception):
    def __init__(self, divergence: Divergence) -> None:
        self.divergence = divergence


class _Validator:
    """Holds per-request state while reading one trace; see the module docstring for the rules."""

    def __init__(
        self,
        spec: Spec,
        source: str,
        limits: Limits,
        progress: Callable[[int], None] | None = None,
        *,
        file: bool = False,
    ) -> None:
        self.progress = progress
        self.spec = spec
        self.source = source
        self.limits = limits
        self.file = file  # lines are a file's (each but a cut last one ends with a newline)
        self.reused = 0  # requests that ended and whose id then started a new request
        self.torn: int | None = None
        self.edges = {(t.event, t.source, t.dest): t for t in spec.transitions}
        self.terminal = frozenset(spec.terminal_states)
        self.computing = spec.computing_states
        self.reasons = frozenset(e.done_reason for e in spec.events if e.done_reason)
        declared = {inv.id for inv in spec.invariants}
        self.invariant = {i: (i if i in declared else None) for i in INVARIANT_IDS}
        self.state: dict[Hashable, str] = {}
        self.last_line: dict[Hashable, int] = {}
        self.generated: dict[Hashable, int] = {}
        # per tier: request id -> its blocks as of its last line (requests holding none are left out), and the sum
        self.blocks: dict[str, dict[Hashable, int]] = {"gpu": {}, "host": {}}
        self.total = {"gpu": 0, "host": 0}
        self.counts: Counter[str] = Counter()
        self.iteration = 0
        self.gpu_capacity: int | None = None
        self.lines = 0

    def run(self, lines: Iterable[tuple[int, str | bytes]], require_done: bool) -> TraceReport:
        divergence = None
        try:
            try:
                for number, raw in lines:
                    if not raw.strip():
                        continue
                    if self._torn(number, raw):
                        break  # the file's last line (only it lacks a newline)
                    self.lines += 1
                    self.check_line(number, raw)
                    if self.progress is not None and self.lines % PROGRESS_LINES == 0:
                        self.progress(self.lines)
            except TraceError as err:  # a line over the limits or not in the trace format
                where = f"field {err.field!r} " if err.field else ""
                raise self.fail(err.line or self.lines, FORMAT, where + err.detail, line=err.record) from None
            if require_done:
                self.check_end()
        except _Stop as stop:
            divergence = stop.divergence
        return TraceReport(
            source=self.source,
            lines=self.lines,
            requests=len(self.state) + self.reused,
            transitions=MappingProxyType(dict(sorted(self.counts.items()))),
            final_states=MappingProxyType(dict(self.state)),
            divergence=divergence,
            torn_line=self.torn,
        )

    def _torn(self, number: int, raw: str | bytes) -> bool:
        """Whether `raw` is a file's last line cut mid-write: no newline, and not a whole trace line."""
        ended = raw.endswith(b"\n") if isinstance(raw, bytes) else raw.endswith("\n")
        if not self.file or ended:
            return False
        try:
            parse_line(raw, number, path=self.source, limits=self.limits)
        except TraceError:
            self.torn = number
            return True
        return False

    # ------------------------------------------------------------------------------------------- one line
    def fail(
        self,
        number: int,
        rule: str,
        message: str,
        *,
        line: dict | None = None,
        rid: Hashable | None = None,
        invariant: str | None = None,
        expected: str | None = None,
    ) -> _Stop:
        observed = None
        if line is not None:
            observed = (line.get("event"), line.get("from"), line.get("to"))
            rid = line.get("request_id", rid)
            if expected is None and isinstance(rid, (int, str)):
                expected = self.state.get(rid, self.spec.initial)
        return _Stop(Divergence(number, rid, rule, invariant, expected, observed, message))

    def check_line(self, number: int, raw: str | bytes) -> None:
        """Check one line against every rule (module docstring, in order), then take its transition."""
        line = parse_line(raw, number, path=None if self.source == "<lines>" else self.source, limits=self.limits)
        rid = line["request_id"]
        ended = self.state.get(rid)
        if ended not in self.terminal or line["from"] != self.spec.initial:
            self._check_and_take(number, line)
            return
        # a line from the initial state for a request that ended: the first line of a new request reusing its id
        # (after `take_finished`), when the line holds as one; a line that does not is one the request took after
        # its end (``from``)
        ended_at, generated = self.last_line.pop(rid), self.generated.pop(rid)
        del self.state[rid]
        try:
            self._check_and_take(number, line)
        except _Stop as stop:
            self.state[rid], self.last_line[rid], self.generated[rid] = ended, ended_at, generated
            broken = stop.divergence
            raise self.fail(
                number,
                FROM,
                f"request {shown(rid)} already reached the terminal state {ended!r} at line {ended_at}; read as the "
                f"first line of a new request reusing its id it breaks rule {broken.rule}: {broken.message}",
                line=line,
                expected=ended,
            ) from None
        self.reused += 1

    def _check_and_take(self, number: int, line: dict) -> None:
        self._check_order(number, line)
        transition = self._check_edge(number, line)
        self._check_residency(number, line)
        self._check_effect(number, line, transition)
        totals = self._check_conservation(number, line)
        self._check_output(number, line, transition)
        self._take(number, line, totals)

    def _check_order(self, number: int, line: dict) -> None:
        """``iteration`` and ``capacity``."""
        if line["iteration"] < self.iteration:
            raise self.fail(
                number,
                ITERATION,
                f"iteration {line['iteration']} is below {self.iteration} of an "
                "earlier line; lines must be written in the order the transitions happened",
                line=line,
            )
        if self.gpu_capacity is not None and line["gpu_capacity"] != self.gpu_capacity:
            raise self.fail(
                number,
                CAPACITY,
                f"gpu_capacity {line['gpu_capacity']} differs from "
                f"{self.gpu_capacity} on earlier lines; a trace covers one run of one engine",
                line=line,
            )

    def _check_edge(self, number: int, line: dict) -> Transition:
        """``stutter`` / ``edge`` and ``from``: the spec transition the line takes."""
        rid, event, source, dest = line["request_id"], line["event"], line["from"], line["to"]
        spec = self.spec
        held = self.state.get(rid, spec.initial)
        transition = self.edges.get((event, source, dest))
        if transition is None:
            raise self.fail(
                number, STUTTER if source == dest else EDGE, self._edge_message(event, source, dest), line=line
            )
        if source != held:
            if rid not in self.state:
                why = (
                    f"its first line must start from the spec's initial state {spec.initial!r}; "
                    "check that the trace is complete from its start"
                )
            elif held in self.terminal:
                why = (
                    f"it already reached the terminal state {held!r} at line {self.last_line[rid]}; a request id is "
                    f"used again only for a new request, whose first line starts from {spec.initial!r} "
                    "(spec/TRACE.md)"
                )
            else:
                why = (
                    f"its previous line ({self.last_line[rid]}) left it in {held!r}; a transition is missing or "
                    "lines were reordered"
                )
            raise self.fail(number, FROM, f"the line starts from {source!r} but {why}", line=line, expected=held)
        return transition

    def _check_residency(self, number: int, line: dict) -> None:
        """``residency`` and ``no-host-no-offload``."""
        rid, dest = line["request_id"], line["to"]
        residency = self.spec.residency(dest)
        allowed = RESIDENCY_TIERS[residency]
        for tier in ("gpu", "host"):
            held_blocks = line[f"{tier}_blocks"]
            if tier not in allowed and held_blocks != 0:
                where = f"only in the {' and '.join(allowed)} tier{'s' * (len(allowed) > 1)}" if allowed else "none"
                raise self.fail(
                    number,
                    RESIDENCY,
                    f"field '{tier}_blocks' is {held_blocks} but state {dest!r} has residency {residency!r}, whose "
                    f"requests hold blocks {where}; the transition's effect must move or free every {tier} block",
                    line=line,
                    invariant=self.invariant["RES-STATE"],
                )
        if line["host_capacity"] != 0:
            return
        holders = self.blocks["host"]  # requests holding host blocks as of their last line: read, never copied
        if line["host_blocks"] or len(holders) - (rid in holders):
            who = rid if line["host_blocks"] else min((r for r in holders if r != rid), key=repr)
            count = line["host_blocks"] or holders[who]
            raise self.fail(
                number,
                NO_HOST,
                f"field 'host_capacity' is 0 (no host tier) but request {shown(who)} holds {count} host block(s); "
                "without a host tier held blocks stay on the GPU (nothing is offloaded), and a tier that goes away "
                "must first drop the host copies (lose_host_copy)",
                line=line,
                invariant=self.invariant["NO-HOST-NO-OFFLOAD"],
            )

    def _check_effect(self, number: int, line: dict, transition: Transition) -> None:
        """``effect``: the request's blocks are what the effect of the line's edge leaves (`EFFECT_RULES`)."""
        rule = EFFECT_RULES.get(transition.effect) if transition.effect else None
        if rule is None:
            return
        rid = line["request_id"]
        before = BlocksBefore(
            self.blocks["gpu"].get(rid, 0),
            self.blocks["host"].get(rid, 0),
            transition.source not in self.computing,
        )
        problem = rule(before, line)
        if problem is not None:
            field, invariant, why = problem
            raise self.fail(
                number,
                EFFECT,
                f"field {field!r} {why} (event {transition.event!r} runs effect {transition.effect!r})",
                line=line,
                invariant=self.invariant[invariant] if invariant else None,
            )

    def _check_conservation(self, number: int, line: dict) -> dict[str, int]:
        """``conservation``: the blocks all requests hold per tier once the line is taken."""
        rid, totals = line["request_id"], {}
        for tier, inv in (("host", "CONS-HOST"), ("gpu", "CONS-GPU")):
            free, fenced, mine, cap = (line[f"{tier}_{k}"] for k in ("free", "fenced", "blocks", "capacity"))
            held = totals[tier] = self.total[tier] - self.blocks[tier].get(rid, 0) + mine
            counted = free + fenced + held
            if counted > cap or (tier == "host" and counted != cap):
                exact = tier == "host"
                raise self.fail(
                    number,
                    CONSERVATION,
                    f"{tier} tier: free {free} + fenced {fenced} + blocks held by "
                    f"all requests {held}{'' if exact else ' (at least)'} (this request's {mine}) = "
                    f"{counted} {'!=' if exact else '>'} capacity {cap}; "
                    + (
                        "a block is counted twice (leaked fence or double free?)"
                        if counted > cap
                        else "blocks went missing (a leak, or a request's block count is wrong)"
                    ),
                    line=line,
                    invariant=self.invariant[inv],
                )
        return totals

    def _check_output(self, number: int, line: dict, transition: Transition) -> None:
        """``generated`` and ``done-reason``."""
        rid, event, dest = line["request_id"], line["event"], line["to"]
        before = self.generated.get(rid, 0)
        if line["generated"] < before:
            raise self.fail(
                number,
                GENERATED,
                f"generated fell from {before} to {line['generated']}; generated "
                "tokens are append-only through suspend, resume, pause and replay",
                line=line,
                invariant=self.invariant["GEN-APPEND"],
            )
        reason = line["done_reason"]
        if (reason is not None) != (dest in self.terminal):
            where = "a terminal" if dest in self.terminal else "a non-terminal"
            raise self.fail(
                number,
                DONE_REASON,
                f"done_reason is {shown(reason)} on a line into {where} state "
                f"{dest!r}; it is non-null exactly when the request ends",
                line=line,
            )
        allowed = {transition.done_reason} if transition.done_reason else self.reasons
        if reason is not None and reason not in allowed:
            raise self.fail(
                number,
                DONE_REASON,
                f"done_reason {shown(reason)} cannot end a request by {event!r}; "
                f"expected one of {', '.join(sorted(allowed))}",
                line=line,
            )

    def _take(self, number: int, line: dict, totals: dict[str, int]) -> None:
        """Record the line's transition: the request's state, blocks and output as the line leaves them."""
        rid = line["request_id"]
        self.iteration = line["iteration"]
        self.gpu_capacity = line["gpu_capacity"]
        self.state[rid] = line["to"]
        self.last_line[rid] = number
        self.generated[rid] = line["generated"]
        for tier, held in totals.items():
            self.total[tier] = held
            if line[f"{tier}_blocks"]:
                self.blocks[tier][rid] = line[f"{tier}_blocks"]
            else:
                self.blocks[tier].pop(rid, None)
        self.counts[line["event"]] += 1

    def _edge_message(self, event: str, source: str, dest: str) -> str:
        spec = self.spec
        if event not in spec.event_by_name:
            return f"event {shown(event)} is not in the spec; events are {', '.join(spec.event_by_name)}"
        for name in (source, dest):
            if name not in spec.state_by_name:
                return f"state {shown(name)} is not in the spec; states are {', '.join(spec.state_by_name)}"
        allowed = [f"{t.source} -> {t.dest}" for t in spec.event_by_name[event].transitions]
        kind = "declares no self-loop" if source == dest else "has no edge"
        return f"the spec {kind} {source} -> {dest} on {event!r}; its edges for {event!r} are {'; '.join(allowed)}"

    # ----------------------------------------------------------------------------------------- end of file
    def check_end(self) -> None:
        open_requests = [rid for rid, state in self.state.items() if state not in self.terminal]
        if not open_requests:
            return
        rid = min(open_requests, key=self.last_line.__getitem__)
        state = self.state[rid]
        raise _Stop(
            Divergence(
                self.last_line[rid],
                rid,
                TERMINAL,
                None,
                state,
                None,
                f"the trace ends with request {shown(rid)} in {state!r} (its last line; {len(open_requests)} "
                f"request(s) not in a terminal state {', '.join(sorted(self.terminal))}); the run was cut short or "
                "lines are missing — pass --no-require-done to validate a partial trace",
            )
        )

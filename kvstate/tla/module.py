"""The lifecycle as a TLA+ module, written mechanically from the spec (`kvstate export tla`).

`lifecycle_module(spec)` returns the text of `KVStateLifecycle.tla`: the TLA+ form of the abstract model our
checker explores (`kvstate.checker.model`), so that TLC and `kvstate check` enumerate the same states. This module
only assembles; every meaning comes from beside its Python counterpart. In order, the module holds

* the spec's states (as strings) with their residency and roles;
* the views guards read (`RequestView`, `PoolView`) and the arithmetic they use (`kvstate.tla.abstract`);
* every helper, guard and effect as an operator of the same name whose body is the TLA+ meaning recorded beside its
  Python meaning in `kvstate.semantics.TLA`;
* `Transitions`, the spec's edges in spec order, and one action per spec event: `<Event>Edge(q, c)` picks the edge
  the event takes (the first of its transitions whose source is the request's state and whose guard holds, as
  `kvstate.lifecycle.TransitionTable.resolve` does) and `<Event>(r)` takes it on request `r`;
* the abstract model's own actions: `Arrive(r)`, `Compute(r)`, `ComputeStop(r)` (a step whose token is a stop
  token, in bounds with stop tokens) and `Complete(r)` (request r's copy in flight completes) (`kvstate.tla.abstract`);
* `Init`, `Next`, the fairness SPEC.md section 6 states (per-action weak fairness of every action but the
  environment's events), `Spec`, the invariants both engines check (`kvstate.tla.invariants`, named by their spec
  ids with `-` written `_`) and the liveness property `LIVE_DONE`.

Every name that comes from the spec goes through `kvstate.tla.names` (identifiers checked, strings plain words).
"""

from __future__ import annotations

from collections.abc import Mapping

from kvstate import semantics
from kvstate.checker.effects import offload_limited_events
from kvstate.roles import ACTIVE, OFFLOADED, PENDING_RESET, RECOMPUTING
from kvstate.semantics import EFFECTS, GUARDS, TLA, EffectHooks, TlaMeaning
from kvstate.spec import RESIDENCIES, Spec, Transition
from kvstate.tla import abstract, invariants
from kvstate.tla.names import TlaExportError, camel, comment, identifier, string

MODULE_NAME = "KVStateLifecycle"
NOT_ARRIVED = ""  # kvstate.checker.records.ABSENT
RULE = "-" * 100

# The events the abstract model's compute step fires when its guards hold (kvstate.checker.model.AbstractModel).
CATCH_UP, FINISH = "catch_up", "finish"
RESET_EFFECT = "release_kv_and_reset"  # the effect whose steps the RESET-* invariants judge


def tla_id(invariant_id: str) -> str:
    """The TLA+ name of a spec invariant id (`CONS-GPU` -> `CONS_GPU`)."""
    return identifier(invariant_id.replace("-", "_"), f"invariant {invariant_id!r}")


def lifecycle_module(spec: Spec, meanings: Mapping[str, TlaMeaning] = TLA) -> str:
    """The text of the lifecycle module; `meanings` may replace the TLA+ meanings of `kvstate.semantics` (a test
    plants a difference)."""
    return _Writer(spec, meanings).text()


class _Writer:
    """Collects the module's definitions; refuses a name defined twice (a spec event whose action name clashes with
    one of the module's own operators)."""

    def __init__(self, spec: Spec, meanings: Mapping[str, TlaMeaning]) -> None:
        self.spec, self.meanings = spec, meanings
        self.lines: list[str] = []
        self.defined: set[str] = set()
        self.transitions = list(spec.transitions)
        self.index = {id(t): k for k, t in enumerate(self.transitions, 1)}
        self.event_names = {e.name: camel(e.name, f"{spec.source}: event {e.name!r}") for e in spec.events}
        self.limited = offload_limited_events(spec, meanings)  # taken with every block count (Action.blocks)

    # ---- output
    def define(self, name: str, body: str, *, params: str = "", note: str = "", recursive: bool = False) -> None:
        if name in self.defined:
            raise TlaExportError(
                f"{self.spec.source}: the TLA+ module would define {name} twice; rename the spec entry it comes from"
            )
        self.defined.add(name)
        if note:
            self.lines.append(comment(note))
        head = f"{name}({params})" if params else name
        if recursive:
            self.lines.append(f"RECURSIVE {name}({', '.join('_' for _ in params.split(','))})")
        self.lines.append(
            f"{head} ==\n    {body}" if "\n" in body or len(head) + len(body) > 100 else f"{head} == {body}"
        )

    def emit(self, definitions, **names: str) -> None:
        """Write `definitions` (of `kvstate.tla.abstract`), their bodies formatted with `names`."""
        for d in definitions:
            body = d.body.format(**names) if names else d.body
            self.define(d.name, body, params=d.params, note=d.note, recursive=d.recursive)

    def section(self, title: str) -> None:
        self.lines += ["", "\\* " + RULE[: 96 - len(title)] + " " + title]

    def text(self) -> str:
        spec = self.spec
        self.lines = [
            f"{'-' * 30} MODULE {MODULE_NAME} {'-' * 30}",
            comment(f"{spec.name}, spec version {spec.version}: the abstract model of `kvstate check`."),
            comment("Generated by `kvstate export tla` from the spec's lifecycle.toml; do not edit."),
            comment(
                "Guards and effects: their TLA+ meanings, recorded beside their Python meanings (kvstate.semantics)."
            ),
            "EXTENDS Integers, FiniteSets",
            "",
            "CONSTANTS",
            "    Requests,        \\* the bound's requests (model values)",
            "    PromptLen,       \\* PromptLen[r]: the prompt length of request r",
            "    MaxNewTokens,    \\* MaxNewTokens[r]: its max_new_tokens",
            "    GpuBlocks,       \\* GPU tier capacity in blocks",
            "    HostBlocks,      \\* host tier capacity in blocks (0: no host tier)",
            "    BlockSize,       \\* tokens per block",
            "    ChunkSize,       \\* prefill chunk size in tokens",
            "    PipelineStages,  \\* pipeline depth",
            "    EnvironmentEnds, \\* TRUE: the environment may end requests (cancel, abort; the bound's `cancel`)",
            "    StopTokens       \\* TRUE: any produced token may be a stop token (the bound has stop tokens)",
            "",
            "VARIABLES",
            (
                "    requests,  \\* requests[r]: the abstract request record of r "
                "(kvstate.checker.records.AbstractRequest)"
            ),
            "    counts     \\* the pool's free and fenced blocks per tier (kvstate.checker.records.PoolCounts)",
            "",
        ]
        self.defined |= {
            "Requests",
            "PromptLen",
            "MaxNewTokens",
            "GpuBlocks",
            "HostBlocks",
            "BlockSize",
            "ChunkSize",
            "PipelineStages",
            "EnvironmentEnds",
            "StopTokens",
            "requests",
            "counts",
        }
        self.define("vars", "<<requests, counts>>")
        self.states()
        self.views()
        self.semantics()
        self.edges()
        self.events()
        self.model_actions()
        self.behaviour()
        self.checks()
        self.lines += ["", "=" * 80, ""]
        return "\n".join(self.lines)

    # ---- sections
    def states(self) -> None:
        spec = self.spec
        self.section("states (spec [[states]])")
        name = {s.name: string(s.name, f"{spec.source}: state {s.name!r}") for s in spec.states}

        def members(names) -> str:
            return "{" + ", ".join(name[n] for n in names) + "}"

        self.define("States", members(s.name for s in spec.states))
        self.define("NotArrived", '""', note="the state of a request that has not arrived yet")
        self.define("Initial", name[spec.initial])
        self.define("Terminal", members(spec.terminal_states))
        self.define("Computing", members(spec.computing_states))
        self.define("Active", name[spec.role(ACTIVE)], note="role active")
        self.define("Recomputing", name[spec.role(RECOMPUTING)], note="role recomputing")
        self.define("PendingReset", name[spec.role(PENDING_RESET)], note="role pending_reset")
        self.define("Offloaded", name[spec.role(OFFLOADED)], note="role offloaded")
        *kept, last = RESIDENCIES  # the last residency holds nothing: what a request not arrived has
        arms = " ELSE ".join(
            f"IF s \\in {members(s.name for s in spec.states if s.residency == tier)} THEN {string(tier, 'residency')}"
            for tier in kept
        )
        self.define(
            "Residency",
            f"{arms} ELSE {string(last, 'residency')}",
            params="s",
            note="where the KV of a request in state s may be (kvstate.spec.RESIDENCIES; a request not arrived: "
            f"{last})",
        )

    def views(self) -> None:
        self.section("arithmetic and the views guards read (kvstate.tla.abstract)")
        self.emit(abstract.PRELUDE)

    def semantics(self) -> None:
        spec = self.spec
        self.section("helpers, guards and effects: their TLA+ meanings from kvstate.semantics")
        used = spec.guard_names | spec.effect_names
        missing = sorted(n for n in used if (n in GUARDS or n in EFFECTS) and n not in self.meanings)
        if missing:
            raise TlaExportError(
                f"{spec.source}: guard or effect {', '.join(missing)} has no TLA+ meaning; record one beside its "
                "Python meaning in kvstate.semantics with @tla(...)"
            )
        for name, meaning in self.meanings.items():
            kind = "guard" if name in GUARDS else "effect" if name in EFFECTS else "helper"
            doc = _summary(getattr(semantics, name, None) or getattr(EffectHooks, name, None))
            self.define(
                identifier(name, f"{kind} {name!r}"),
                meaning.body,
                params=", ".join(meaning.params),
                note=f"{kind} {name}" + (f": {doc}" if doc else ""),
            )

    def edges(self) -> None:
        self.section("the spec's transitions, in spec order")
        records = ",\n     ".join(self.record(t) for t in self.transitions)
        self.define("Transitions", f"<<{records}>>", note="Transitions[k]: the k-th edge of the spec")
        effects = sorted({t.effect for t in self.transitions if t.effect})
        arms = "\n      [] ".join(f"t.effect = {string(e, 'effect')} -> {e}(q, c, t)" for e in effects)
        self.define(
            "Effect",
            f"LET t == Transitions[k] IN\n    CASE {arms}\n      [] OTHER -> [request |-> q, pool |-> c]",
            params="k, q, c",
            note="the effect of edge k on request record q (already in the edge's destination) and pool counts c",
        )
        self.define(
            "Take",
            "Effect(k, [q EXCEPT !.state = Transitions[k].dest], c)",
            params="k, q, c",
            note="taking edge k: the state changes to its destination, then its effect runs (kvstate.lifecycle)",
        )
        self.define(
            "Result",
            "IF k = 0 THEN [ok |-> FALSE, request |-> q, pool |-> c, taken |-> {}]\n"
            "    ELSE LET e == Take(k, q, c) IN [ok |-> TRUE, request |-> e.request, pool |-> e.pool, taken |-> {k}]",
            params="k, q, c",
            note="the result of a step that takes edge k (0: none, the step is not enabled)",
        )
        self.emit(abstract.RESULTS)

    def record(self, t: Transition) -> str:
        where = f"{self.spec.source}: transition {t.event} from {t.source}"
        fields = (
            ("event", t.event),
            ("source", t.source),
            ("dest", t.dest),
            ("effect", t.effect or ""),
            ("done_reason", t.done_reason or ""),
        )
        return "[" + ", ".join(f"{k} |-> {string(v, where)}" for k, v in fields) + "]"

    def events(self) -> None:
        spec = self.spec
        self.section("events: one action per spec event, its edges tried in spec order")
        for event in spec.events:
            name = self.event_names[event.name]
            arms = []
            for t in event.transitions:
                guard = f" /\\ {t.guard}(RequestView(q), PoolView(c))" if t.guard else ""
                arms.append(f"IF q.state = {string(t.source, 'state')}{guard} THEN {self.index[id(t)]}")
            summary = "; ".join(
                f"{t.source} -> {t.dest}"
                + (f" [{t.guard}]" if t.guard else "")
                + (f" / {t.effect}" if t.effect else "")
                for t in event.transitions
            )
            self.define(
                f"{name}Edge",
                "\n    ELSE ".join(arms) + "\n    ELSE 0",
                params="q, c",
                note=f"event {event.name} (origin {event.origin}): {summary}",
            )
            if event.name in self.limited:
                self.define(
                    name,
                    "\\E k \\in 1..GpuBlocks :\n"
                    "        LET c == [counts EXCEPT !.offload_limit = k] IN\n"
                    f"        /\\ {name}Edge(requests[r], c) # 0\n"
                    f"        /\\ Commit(r, Result({name}Edge(requests[r], c), requests[r], c))",
                    params="r",
                    note="an offload of held blocks moves what an allocation asks for: any count k (the limit)",
                )
                continue
            self.define(
                name,
                f"/\\ {name}Edge(requests[r], counts) # 0\n"
                f"    /\\ Commit(r, Result({name}Edge(requests[r], counts), requests[r], counts))",
                params="r",
            )

    def model_actions(self) -> None:
        names = self.event_names
        for needed in (CATCH_UP, FINISH):
            if needed not in names:
                raise TlaExportError(
                    f"{self.spec.source}: the abstract model's compute step fires event {needed!r}, which the spec "
                    "does not define"
                )
        self.section("the abstract model's own actions (kvstate.tla.abstract)")
        self.emit(abstract.OWN_ACTIONS, catch_up=names[CATCH_UP], finish=names[FINISH])

    def behaviour(self) -> None:
        spec = self.spec
        self.section("the behaviours: initial state, next-state relation, fairness (SPEC.md section 6)")
        self.emit([abstract.INIT])
        environment = spec.environment_events
        ending = {e.name for e in spec.events if e.name in environment and e.done_reason}
        fair = ["Arrive(r)", "Compute(r)", "Complete(r)"] + [
            f"{self.event_names[e.name]}(r)" for e in spec.events if e.name not in environment
        ]
        env = [f"{self.event_names[e.name]}(r)" for e in spec.events if e.name in environment and e.name not in ending]
        ends = [f"{self.event_names[e.name]}(r)" for e in spec.events if e.name in ending]
        if ends:
            env.append("(EnvironmentEnds /\\ (" + " \\/ ".join(ends) + "))")
        self.define(
            "FairAction",
            " \\/ ".join([*fair, "ComputeStop(r)"]),
            params="r",
            note="steps the scheduler and the executor take (a stop token is data: no fairness of its own)",
        )
        self.define(
            "EnvironmentAction",
            " \\/ ".join(env) or "FALSE",
            params="r",
            note="environment events (origin environment): no fairness, never a way out of a loop",
        )
        self.define("FairNext", "\\E r \\in Requests : FairAction(r)")
        self.define("EnvironmentStep", "\\E r \\in Requests : EnvironmentAction(r)")
        self.define("Next", "FairNext \\/ EnvironmentStep")
        wf = " /\\ ".join(f"WF_vars({a})" for a in fair)
        self.define(
            "Fairness",
            f"\\A r \\in Requests : {wf}",
            note="F1-F3 per action and request: a step enabled forever is taken (scheduler steps, compute, copy "
            "completion, consensus); F4: arrivals happen once, environment events have no fairness",
        )
        self.define("Spec", "Init /\\ [][Next]_vars /\\ Fairness")

    def checks(self) -> None:
        spec = self.spec
        state_ids, step_ids = invariants.checked_ids(spec)
        self.section("the invariants both engines check (kvstate.tla.invariants)")
        self.define("AllDone", "\\A r \\in Requests : requests[r].state \\in Terminal")
        fair = [e for e in spec.events if e.name not in spec.environment_events]
        moves = "\n           \\/ ".join(
            f"(\\E k \\in 1..GpuBlocks : Moves(r, {self.result_of(name, 'k')}))"
            if name in self.limited
            else f"Moves(r, {self.result_of(name)})"
            for name in ["arrive", "compute", "compute_stop", "complete", *(e.name for e in fair)]
        )
        self.define(
            "Moves",
            "res.ok /\\ (Settle(res.request) # requests[r] \\/ [res.pool EXCEPT !.offload_limit = 0] # counts)",
            params="r, res",
            note="result res is a step of request r that changes the state",
        )
        self.define(
            "FairStepEnabled",
            f"\\E r \\in Requests :\n           \\/ {moves}",
            note="ENABLED (FairNext /\\ vars' # vars), evaluated on the steps' results (TLC's ENABLED is slower)",
        )
        self.define(
            "TakenBy",
            "IF requests'[r] # requests[r] /\\ Commit(r, res) THEN res.taken ELSE {}",
            params="r, res",
            note="the edges step result res of request r took, if the step taken is that one",
        )
        compute = f"TakenBy(r, {self.result_of('compute')}) \\cup TakenBy(r, {self.result_of('compute_stop')})"

        def taken(event: str) -> str:
            if event in self.limited:  # every block count
                return f"UNION {{TakenBy(r, {self.result_of(event, 'k')}) : k \\in 1..GpuBlocks}}"
            return f"TakenBy(r, {self.result_of(event)})"

        arms = "\n      [] ".join(
            [f"e = {string('compute', 'event')} -> {compute}"]
            + [f"e = {string(e.name, 'event')} -> {taken(e.name)}" for e in spec.events]
        )
        self.define(
            "StepTaken",
            f"CASE {arms}\n      [] OTHER -> {{}}",
            params="r, e",
            note='the edges the step taken took, if it is a step of request r by event e ("compute": a compute '
            "step, its token a stop token or not); as kvstate.checker.records.Edge.taken",
        )
        resetting = sorted({t.event for t in self.transitions if t.effect == RESET_EFFECT})
        if {CATCH_UP, FINISH} & set(resetting):
            resetting.append("compute")
        self.define(
            "Resets",
            f"\\E e \\in {{{', '.join(string(n, 'event') for n in resetting)}}} : "
            f"\\E k \\in StepTaken(r, e) : Transitions[k].effect = {string(RESET_EFFECT, 'effect')}",
            params="r",
            note="the step resets request r for replay (kvstate.checker.invariants._resets; only the events named "
            "take an edge with that effect)",
        )
        for inv_id in state_ids:
            self.define(tla_id(inv_id), invariants.STATE[inv_id], note=self.statement(inv_id))
        for inv_id in step_ids:
            name = tla_id(inv_id)
            self.define(f"{name}_step", invariants.STEP[inv_id], note=self.statement(inv_id))
            self.define(name, f"[][{name}_step]_vars")
        self.define(tla_id(invariants.DEADLOCK_ID), invariants.DEADLOCK, note=self.statement(invariants.DEADLOCK_ID))
        self.section("liveness (LIVE-DONE)")
        self.define(
            "LIVE_DONE",
            "(<>[][~EnvironmentStep]_vars) => <>AllDone",
            note="every request reaches done in every fair behaviour in which environment events stop (F4)",
        )

    def result_of(self, event: str, limit: str = "") -> str:
        """The TLA+ expression of the result of `event` on request r ("arrive", "compute", "compute_stop" and
        "complete": the model's own steps); `limit` names the block count an offload-limited event is taken with."""
        own = {
            "arrive": "ArriveResult(requests[r], counts)",
            "compute": "ComputeResult(requests[r], counts, FALSE)",
            "compute_stop": "ComputeResult(requests[r], counts, TRUE)",
            "complete": "CompleteResult(requests[r], counts)",
        }
        if event in own:
            return own[event]
        counts = f"[counts EXCEPT !.offload_limit = {limit}]" if limit else "counts"
        return f"Result({self.event_names[event]}Edge(requests[r], {counts}), requests[r], {counts})"

    def statement(self, inv_id: str) -> str:
        found = [inv.statement for inv in self.spec.invariants if inv.id == inv_id]
        return f"{inv_id}: {found[0]}" if found else inv_id


def _summary(fn) -> str:
    """The first paragraph of `fn`'s docstring ("" without one)."""
    doc = (getattr(fn, "__doc__", None) or "").strip()
    return " ".join(doc.split("\n\n")[0].split())

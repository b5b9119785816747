"""What the executor and the environment may do to a world of the scheduler refinement between two iterations.

The choices (`Environment.actions`): the next request arrives (in the bound's order); one iteration runs
(`SimExecutor.step`: land what must land, consensus, schedule, issue copies, compute, complete the copies that are
due), possibly with the k-th copy it issues failing at once; a copy in flight completes early or fails (copies
complete up to `copy_delay` passes late: `SimExecutor`); the oldest micro-batch in flight lands early
(`micro_batches` > 1); a request is cancelled or aborted; a suspended request with blocks in the host tier loses them
(one held wholly on the GPU has no host copy to lose). Each choice of the environment is taken at most its budget's
times per run, so arrivals and faults stop (F4).

With `micro_batches` > 1 a step lands the oldest output when it must (`Scheduler.must_land`) before it schedules, so
cancellations and lost host copies also hit requests whose step is in flight, and a request preempted while its
decode step is in flight receives its token suspended or awaiting consensus (the deferred finish).

An error the scheduler raises while an action runs is a violation with its path: a stall is LIVE-DONE; an allocation
a tier cannot carry out (`TierFull`) is OWN-EXCL, the abstract model's name for owners claiming more blocks than
exist, naming the edge whose guard let its effect ask; any other error is SPEC-EDGE (a transition not taken whole).
"""

from __future__ import annotations

from kvstate.checker.bounds import Bound
from kvstate.checker.world import BoundRequests, World, bound_index
from kvstate.errors import InvariantViolation, KVStateError, TierFull
from kvstate.scheduler import SchedulerStalled

# Actions that spend an environment budget (a world's fingerprint counts what is left), so none lies on a cycle.
BUDGETED = frozenset({"submit", "cancel", "abort", "lose_host_copy", "fail"})


class NotEnabled(Exception):
    """The action cannot be taken in this world (a copy failure asked of a pass that issues fewer copies)."""


class Environment:
    """The executor's and the environment's choices in the worlds of one bound, and how each is carried out.

    Invariants kept: every action `actions` offers is one `act` carries out or refuses with `NotEnabled`; a budgeted
    action (`BUDGETED`) spends one of its world's budget, and none is offered once that budget is spent; a scheduler
    error while acting is raised as the violation it stands for (`InvariantViolation`).
    """

    def __init__(self, bound: Bound, requests: BoundRequests) -> None:
        self.bound = bound
        self.requests = requests

    def actions(self, world: World) -> list[tuple]:
        """Every choice of the environment in `world`: an arrival (in the bound's order), a scheduler step (with
        the k-th copy it issues failing, while copy failures are left), an in-flight copy completing early or
        failing, the oldest micro-batch in flight landing early, a cancel, an abort, a lost host copy (of a suspended
        request holding host blocks)."""
        s, sim = world.scheduler, world.sim
        out: list[tuple] = []
        if world.submitted < len(self.bound.requests):
            out.append(("submit", world.submitted))
        out.append(("step",))
        if world.failures_left:
            out += [("step", "fail", k) for k in range(len(self.bound.requests))]
        copying = sorted((c.plan.request_id for c in sim.copies), key=bound_index)
        out += [("complete", rid) for rid in copying]
        if world.failures_left:
            out += [("fail", rid) for rid in copying]
        if sim.micro_batches > 1 and sim.pipeline:
            out.append(("land",))
        active = sorted(s.requests, key=bound_index) if self.bound.cancel else []  # cancel = false: none ends
        if world.cancels_left:
            out += [("cancel", rid) for rid in active]
        if world.aborts_left:
            out += [("abort", rid) for rid in active]
        if world.losses_left:
            out += [("lose_host_copy", r.request_id) for r in s.suspended if r.num_host_blocks]
        return out

    @staticmethod
    def may_refuse(action: tuple) -> bool:
        """True when `act` may refuse `action` with `NotEnabled` after it changed the world (a step whose k-th copy
        fails, when the pass issues fewer copies): such an action is taken on a copy of the world."""
        return action[:2] == ("step", "fail")

    def act(self, world: World, action: tuple) -> None:
        """Carry out `action` on `world` (in place); a scheduler error is the violation it stands for."""
        s, sim, kind = world.scheduler, world.sim, action[0]
        calls = {  # kind -> (what it does, the budget it spends)
            "complete": (sim.complete_copy, None),
            "fail": (sim.fail_copy, "failures_left"),
            "cancel": (s.cancel, "cancels_left"),
            "abort": (s.abort, "aborts_left"),
            "lose_host_copy": (s.lose_host_copy, "losses_left"),
        }
        if kind not in calls and kind not in ("submit", "step", "land"):
            raise ValueError(f"unknown action {action!r}")
        try:
            if kind == "submit":
                i = action[1]
                requests = self.requests
                s.submit(requests.prompts[i], self.bound.requests[i][1], stop_token_ids=requests.stops[i], request_id=i)
                world.submitted += 1
            elif kind == "step":
                self._step(world, action)
            elif kind == "land":
                sim.land()
            elif kind in calls:
                call, budget = calls[kind]
                call(action[1])
                if budget is not None:
                    setattr(world, budget, getattr(world, budget) - 1)
        except (InvariantViolation, NotEnabled):
            raise
        except SchedulerStalled as err:
            raise InvariantViolation("LIVE-DONE", str(err)) from err
        except TierFull as err:
            raise InvariantViolation("OWN-EXCL", beyond_capacity(err)) from err
        except KVStateError as err:
            raise InvariantViolation("SPEC-EDGE", f"{type(err).__name__}: {err}") from err
        except Exception as err:  # a crash inside the scheduler: the transition under way was not taken whole
            raise InvariantViolation(
                "SPEC-EDGE", f"the scheduler crashed with {type(err).__name__}: {err} (a transition not taken whole)"
            ) from err

    @staticmethod
    def _step(world: World, action: tuple) -> None:
        """("step",), or ("step", "fail", k): a step whose k-th copy fails when issued (not enabled when the pass
        issues fewer copies)."""
        if len(action) == 1:
            world.sim.step()
            return
        _, _, k = action
        world.sim.step(fail={k})
        step = world.sim.last_step
        if step is None or not step.failures:
            raise NotEnabled(f"the pass issued no copy number {k}")
        world.failures_left -= 1


def beyond_capacity(err: TierFull) -> str:
    """What an allocation beyond a tier's free blocks says of the spec: which edge's guard let its effect ask."""
    asked = f"asked the {err.tier} tier for {err.asked} block(s) with {err.free} free"
    edge = err.edge
    if edge is None:
        return f"the scheduler {asked}, outside any transition's effect (an allocation beyond the tier's capacity)"
    guard = "no guard" if edge.guard is None else f"guard {edge.guard!r}"
    return (
        f"request {err.request_id!r} took edge {edge.source} -{edge.event}-> {edge.dest}, its {guard} holding, but "
        f"its effect {edge.effect!r} {asked}: the guard lets the edge fire without the room its effect allocates "
        f"(the pool refused: {err})"
    )

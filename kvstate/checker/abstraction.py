"""The abstraction of the scheduler refinement: the abstract spec state a world of the real scheduler stands for.

A request whose step is still in flight (several pipeline stages) shows as it was before that step, because
`AbstractModel` computes a step atomically: the blocks allocated for the step count as free, also in the copy of a
request suspended with it. A request preempted while its decode step is in flight may still receive that
token (suspended or awaiting consensus): `Abstraction.variants` lists both abstract states it may stand for.
"""

from __future__ import annotations

from collections.abc import Hashable

from kvstate.checker.bounds import Bound
from kvstate.checker.model import AbstractModel
from kvstate.checker.records import ABSENT, NONE, AbstractRequest, AbstractState
from kvstate.checker.world import World
from kvstate.pool import TO_HOST


class Abstraction:
    """Maps the worlds of one bound to abstract states of its model.

    Invariants kept: `in_bound_order` puts request k in slot k (an absent request as not arrived); `of` is the same
    state with its requests sorted, as the model's canonical states are; neither changes the world.
    """

    def __init__(self, bound: Bound, model: AbstractModel) -> None:
        self.bound = bound
        self.model = model

    def of(self, world: World) -> AbstractState:
        """The abstract spec state of a world (the mapping the refinement is checked through), canonical."""
        state = self.in_bound_order(world)
        return state._replace(requests=tuple(sorted(state.requests)))

    def in_bound_order(self, world: World) -> AbstractState:
        """The abstraction of a world with its requests in bound order (slot k: request k), not canonical."""
        s = world.scheduler
        pool = s.pool
        gpu_free, host_free = pool.gpu_free_blocks, pool.host_free_blocks
        copies = self._copies(pool)
        gpu_fenced = len(pool.gpu.fenced)
        preempted = (self.model.pending_reset, self.model.offloaded)
        reqs = []
        for i in range(len(self.bound.requests)):
            group = self.bound.group_of(i)
            r = s.requests.get(i) or s.finished.get(i)
            fenced_gpu, fenced_host, incoming = copies.get(i, (0, 0, 0))
            if r is None:
                reqs.append(AbstractRequest(group, ABSENT, 0, 0, 0, 0, NONE, self.bound.requests[i][0], 0))
            elif r.state in self.model.terminal:
                reqs.append(
                    AbstractRequest(
                        group, r.state, 0, 0, r.num_gpu_blocks, r.num_host_blocks, NONE, 0, 0, fenced_gpu, fenced_host
                    )
                )
            else:
                gpu, host = r.num_gpu_blocks, r.num_host_blocks
                step = s.in_flight.get(i, 0) if r.num_gpu_blocks or r.num_host_blocks else 0  # its step's blocks
                if host:  # suspended since: its host copy holds the step's blocks (its GPU blocks are free)
                    host, host_free = host - step, host_free + step
                    if incoming:  # and that copy, still in flight, fences their GPU sources
                        fenced_gpu, incoming, gpu_fenced, gpu_free = (
                            fenced_gpu - step,
                            incoming - step,
                            gpu_fenced - step,
                            gpu_free + step,
                        )
                else:
                    gpu, gpu_free = gpu - step, gpu_free + step
                landing = int(i in s.in_flight and r.state in preempted)  # its decode step may still land
                reqs.append(
                    AbstractRequest(
                        group,
                        r.state,
                        r.num_computed_tokens,
                        len(r.generated),
                        gpu,
                        host,
                        r.termination_reason or NONE,
                        len(r.prefill_tokens),
                        landing,
                        fenced_gpu,
                        fenced_host,
                        incoming,
                    )
                )
        return AbstractState(tuple(reqs), gpu_free, host_free, gpu_fenced, len(pool.host.fenced))

    @staticmethod
    def _copies(pool) -> dict[Hashable, tuple[int, int, int]]:
        """Per request with a copy in flight: the GPU and host blocks its copy fences, and the destinations it still
        holds (the abstract model's `fenced_gpu`, `fenced_host`, `incoming`)."""
        out: dict[Hashable, tuple[int, int, int]] = {}
        for plan in pool.in_flight.values():
            owner = plan.request_id
            dest = pool.host if plan.direction == TO_HOST else pool.gpu
            held = set(dest.held(owner))
            fenced_gpu, fenced_host, incoming = out.get(owner, (0, 0, 0))
            out[owner] = (
                fenced_gpu + len(pool.gpu.fenced_by(plan.plan_id)),
                fenced_host + len(pool.host.fenced_by(plan.plan_id)),
                incoming + sum(1 for _, dst in plan.pairs if dst in held),
            )
        return out

    def variants(self, state: AbstractState) -> list[AbstractState]:
        """The abstract states a world may stand for: a request awaiting consensus or suspended after a decode step
        whose step is not in the pipeline may stand for the model's request that may still receive it
        (`in_flight`: the model sets it on every such preemption with several stages, and lets it land or not)."""
        preempted = (self.model.pending_reset, self.model.offloaded)
        several = self.bound.pipeline_stages > 1
        options = [
            [r, r._replace(in_flight=1)]
            if several and r.state in preempted and not r.in_flight and r.computed >= r.prefill
            else [r]
            for r in state.requests
        ]
        out: list[tuple[AbstractRequest, ...]] = [()]
        for choice in options:
            out = [(*prefix, r) for prefix in out for r in choice]
        return [state._replace(requests=v) for v in out]  # in the order of `state`'s requests

    def describe(self, state: AbstractState) -> str:
        requests = "; ".join(self.model.describe_request(r) for r in state.requests)
        return f"{requests}; {self.model.describe_pool(state)}"

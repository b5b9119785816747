"""Old library code that tests monkeypatch back in, to show that a machine or a check finds the bug it had."""

from __future__ import annotations

import kvstate.pool as pool_module


def old_release(self, owner):
    """TieredBlockPool.release of 94c14e1: fences every destination of the owner's copies, held or not, so a second
    release during a copy (cancel after lose_host_copy) raises KeyError half-way."""
    for plan in [p for p in self.in_flight.values() if p.request_id == owner]:
        dest = self.host if plan.direction == pool_module.TO_HOST else self.gpu
        blocks = [dst for _, dst in plan.pairs]
        dest.blocks_of[owner] = tuple(b for b in dest.held(owner) if b not in set(blocks))
        for block in blocks:
            del dest.owner_of[block]  # KeyError for a destination released before
            dest.fenced[block] = plan.plan_id
    self._held.pop(owner, None)  # as today's release: a released owner leaves the offload order
    return len(self.gpu.release(owner)) + len(self.host.release(owner))

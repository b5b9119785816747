"""The scheduler and the protocol executors drive it by, one concept per module:

* `scheduler`: `Scheduler`, which plans each pass (decode steps, chunks, admissions) from the parts below;
* `core`: `SchedulerCore`, the scheduler's state and its firing of lifecycle events;
* `preemption`, `admission`, `landing`, `copies`: the parts of the scheduler (victims and preemption; admissions
  and readmissions; applying a computed step; the executor's copy reports);
* `step`: `Step`, the one protocol every executor drives a scheduler by (schedule, issue copies, compute,
  complete);
* `scheduling_pass`: `SchedulingPass`, one pass under way; `effects`: `SchedulerEffects`, what each edge does;
* `tally`, `statistics`: the per-state figures kept on each transition, and the iteration statistics built from
  them; `invariants`: the spec's invariants of the scheduler's state;
* `decode_run`: `DecodeRun`, the fast path of steady decoding (its reference path: the scheduler's walk);
* `queues`: the ordered request containers.
"""

from kvstate.errors import SchedulerStalled, UnknownRequestId
from kvstate.scheduler.decode_run import DecodeRun
from kvstate.scheduler.effects import SchedulerEffects
from kvstate.scheduler.scheduler import Scheduler
from kvstate.scheduler.scheduling_pass import SchedulingPass
from kvstate.scheduler.step import Step
from kvstate.scheduler.tally import StateTally, figures

__all__ = [
    "DecodeRun",
    "Scheduler",
    "SchedulerEffects",
    "SchedulerStalled",
    "SchedulingPass",
    "StateTally",
    "Step",
    "UnknownRequestId",
    "figures",
]

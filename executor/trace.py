"""The engine's trace writer is kvstate's own (torch-free) one; see `kvstate.trace` and spec/TRACE.md."""

from kvstate.trace import TRACE_FIELDS, FiredTransition, TraceWriter, read_trace, trace_line, trace_record

__all__ = ["TRACE_FIELDS", "FiredTransition", "TraceWriter", "read_trace", "trace_line", "trace_record"]

"""Fixtures of the fault tests (see executor.pytest_fixtures): every engine checks the scheduler's invariants around
every step, so a fault that broke block conservation, residency or the output lists fails the step that caused it."""

from executor.pytest_fixtures import equivalent, make_engine, single_thread_torch, tiny_model

__all__ = ["equivalent", "make_engine", "single_thread_torch", "tiny_model"]

"""Fixtures of the soak tests (see executor.pytest_fixtures)."""

from executor.pytest_fixtures import equivalent, make_engine, single_thread_torch, tiny_model

__all__ = ["equivalent", "make_engine", "single_thread_torch", "tiny_model"]

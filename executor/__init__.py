"""The reference executor on torch (filled in by the executor issue)."""

__all__: list[str] = []

"""`kvstate.testing.SchedulerAdapter`s around third-party schedulers, so the conformance machine fuzzes them
against the spec. Each adapter lives in its own module and imports its engine only when that module is imported
(`from kvstate.adapters.vllm import VLLMAdapter` needs vLLM: `scripts/install-peers`); this package imports nothing.
"""

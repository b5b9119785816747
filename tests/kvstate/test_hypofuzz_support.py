"""The alias that lets HypoFuzz record shrunk failures reads Hypothesis' own field, and only campaigns get it."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis.internal.conjecture.data import ConjectureResult

from kvstate import hypofuzz_support


def test_an_ordinary_run_is_not_a_campaign() -> None:
    assert not hypofuzz_support.in_hypofuzz_run()
    assert "span_comments" in ConjectureResult.__dataclass_fields__  # the field the alias reads


def test_install_aliases_slice_comments_to_span_comments() -> None:
    had_it = "slice_comments" in vars(ConjectureResult)
    try:
        hypofuzz_support.install()
        hypofuzz_support.install()  # a second call changes nothing
        result = SimpleNamespace(span_comments={3: "the part that matters"})
        assert ConjectureResult.slice_comments.fget(result) is result.span_comments  # type: ignore[attr-defined]
    finally:
        if not had_it:
            del ConjectureResult.slice_comments  # type: ignore[attr-defined]

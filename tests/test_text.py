"""nanogpt/text.py: counts with their noun, sizes in bytes."""
from __future__ import annotations

from nanogpt import text


def test_plural_says_one_thing_and_several_things():
    assert [text.plural(n, "sample") for n in (0, 1, 2, 12000)] == [
        "0 samples", "1 sample", "2 samples", "12,000 samples"]
    assert text.plural(1, "micro-step") == "1 micro-step" and text.plural(3, "timed step") == "3 timed steps"


def test_size_text_says_bytes_in_the_largest_unit_that_fits():
    assert [text.size_text(n) for n in (300, 12 * 1024, 1536 * 2**20, 3 * 2**30 + 2**29)] == [
        "300 B", "12.0 KiB", "1.5 GiB", "3.5 GiB"]

"""How figures read in the messages and logs: counts with their noun, sizes in bytes."""
from __future__ import annotations


def plural(n: int, word: str) -> str:
    """A count and its noun, for printed messages: '1 sample', '2 samples', '0 samples', '12,000 examples'.
    `word` is the singular; the plural adds an s."""
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"

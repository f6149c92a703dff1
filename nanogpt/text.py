"""How figures read in the messages and logs: counts with their noun, sizes in bytes."""
from __future__ import annotations


def plural(n: int, word: str) -> str:
    """A count and its noun, for printed messages: '1 sample', '2 samples', '0 samples', '12,000 examples'.
    `word` is the singular; the plural adds an s."""
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


def size_text(n: int) -> str:
    """Bytes as read: '1.5 GiB', '12.0 KiB', '300 B'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"

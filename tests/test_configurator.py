"""Tests for configurator.py: config files and --key=value overrides checked against a typed dataclass."""
from __future__ import annotations  # the scripts use it too: annotations arrive as strings

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import configurator
from nanogpt.errors import UserError
from configurator import ConfigError, configure
from nanogpt.config import config_summary

# A module-level name that config files also assign: a file must never reach it.
batch_size = "test module global"


@dataclass
class TrainConfig:
    out_dir: str = "out"
    batch_size: int = 12
    learning_rate: float = 6e-4
    compile: bool = True
    seed: int = 1337
    lr_decay_iters: int | None = None
    max_iters: int | None = 5000
    init_from: Optional[str] = "scratch"
    device: str = "auto"
    betas: tuple[float, float] = (0.9, 0.95)
    eval_iters: list[int] = field(default_factory=lambda: [1, 2])


FIELDS = {f.name for f in dataclasses.fields(TrainConfig)}


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def error_of(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        configure(TrainConfig(), argv)
    return str(info.value)


def test_no_args_returns_the_defaults_as_a_new_instance() -> None:
    defaults = TrainConfig()
    result = configure(defaults, [])
    assert result == TrainConfig()
    assert result is not defaults


def test_input_config_is_not_mutated(tmp_path: Path) -> None:
    path = write(tmp_path, "a.py", "batch_size = 32\n")
    defaults = TrainConfig()
    result = configure(defaults, [path, "--learning_rate=0.1"])
    assert (result.batch_size, result.learning_rate) == (32, 0.1)
    assert defaults == TrainConfig()


def test_config_file_is_applied(tmp_path: Path) -> None:
    text = 'out_dir = "out-shakespeare"\nbatch_size = 64\nlearning_rate = 1e-3\n'
    result = configure(TrainConfig(), [write(tmp_path, "shakespeare.py", text)])
    expected = dataclasses.replace(TrainConfig(), out_dir="out-shakespeare", batch_size=64, learning_rate=1e-3)
    assert result == expected


def test_later_items_override_earlier(tmp_path: Path) -> None:
    first = write(tmp_path, "first.py", "batch_size = 32\nseed = 1\n")
    second = write(tmp_path, "second.py", "batch_size = 48\n")
    assert configure(TrainConfig(), [first, "--batch_size=64"]).batch_size == 64
    assert configure(TrainConfig(), ["--batch_size=64", first]).batch_size == 32
    result = configure(TrainConfig(), [first, second])
    assert (result.batch_size, result.seed) == (48, 1)


def test_config_file_runs_in_its_own_namespace(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "helpers.py",
        "import math\n"
        "from math import sqrt\n"
        "_base = 8\n"
        "def double(x):\n"
        "    return 2 * x\n"
        "class Thing:\n"
        "    pass\n"
        "batch_size = _base * 4\n"
        "learning_rate = sqrt(1e-6)\n"
        "seed = double(21)\n"
        "max_iters = math.floor(2.5)\n",
    )
    result = configure(TrainConfig(), [path])
    assert (result.batch_size, result.seed, result.max_iters) == (32, 42, 2)
    assert math.isclose(result.learning_rate, 1e-3)
    assert batch_size == "test module global"
    assert not hasattr(configurator, "batch_size")
    assert not hasattr(configurator, "_base")


def test_config_files_do_not_share_names(tmp_path: Path) -> None:
    first = write(tmp_path, "first.py", "_base = 8\nbatch_size = _base\n")
    second = write(tmp_path, "second.py", "seed = _base\n")
    message = f"config file {second!r} failed: NameError: name '_base' is not defined (line 1)"
    assert error_of([first, second]) == message


def test_config_file_cannot_see_configurator_globals(tmp_path: Path) -> None:
    path = write(tmp_path, "a.py", "seed = 1\nout_dir = str(UserError)\n")
    assert error_of([path]) == f"config file {path!r} failed: NameError: name 'UserError' is not defined (line 2)"


@pytest.mark.parametrize(
    "arg, message",
    [  # unknown keys (with the closest known one), then values of the wrong type
        ("--lerning_rate=0.1", "unknown config key 'lerning_rate' (did you mean 'learning_rate'?)"),
        ("--batchsize=8", "unknown config key 'batchsize' (did you mean 'batch_size'?)"),
        ("--zzz=1", "unknown config key 'zzz'"),
        ("--learning_rate=abc", "learning_rate: expected float, got str 'abc'"),
        ("--learning_rate=True", "learning_rate: expected float, got bool True"),
        ("--batch_size=1.5", "batch_size: expected int, got float 1.5"),
        ("--batch_size=True", "batch_size: expected int, got bool True"),
        ("--batch_size=abc", "batch_size: expected int, got str 'abc'"),
        ("--batch_size=None", "batch_size: expected int, got NoneType None"),
        ("--compile=1", "compile: expected bool, got int 1"),
        ("--compile=true", "compile: expected bool, got str 'true'"),
        ("--lr_decay_iters=1.5", "lr_decay_iters: expected int | None, got float 1.5"),
        ("--max_iters=x", "max_iters: expected int | None, got str 'x'"),
        ("--betas=(0.9,)", "betas: expected tuple[float, float], got tuple (0.9,)"),
        ("--betas=[0.9, 0.95]", "betas: expected tuple[float, float], got list [0.9, 0.95]"),
        ("--betas=(0.9, 'a')", "betas: expected tuple[float, float], got tuple (0.9, 'a')"),
        ("--eval_iters=[1, 'a']", "eval_iters: expected list[int], got list [1, 'a']"),
    ],
)
def test_a_bad_override_is_a_one_line_error(arg: str, message: str) -> None:
    assert error_of([arg]) == message


@pytest.mark.parametrize(
    "line, message",
    [
        ("bach_size = 8\n", "unknown config key 'bach_size' (did you mean 'batch_size'?) (a config file's own helper names are ignored unless close to a key: name it _bach_size)"),
        ('batch_size = "32"\n', "batch_size: expected int, got str '32'"),
    ],
)
def test_a_bad_line_in_a_file_names_the_file(tmp_path: Path, line: str, message: str) -> None:
    path = write(tmp_path, "a.py", line)
    assert error_of([path]) == f"{path}: {message}"


def test_a_training_setting_given_to_another_command_is_named_train_pys(capsys) -> None:
    """Bug: `python sample.py config/train_shakespeare_char.py` called block_size a typo of batch_size and advised
    renaming it. A TrainConfig key given to another command is train.py's setting, in one line; a typo stays one."""
    from helpers import run_in_process

    why = "not this command's: --help lists its keys (one that reads a checkpoint takes the model's shape from it)"
    for args, line in [
        (["config/train_shakespeare_char.py"], "config/train_shakespeare_char.py: eval_interval, eval_iters, log_interval, "
                                               f"always_save_checkpoint and 16 more are train.py's settings, {why}"),
        (["--n_layer=4", "--tempreature=1"], f"n_layer is train.py's setting, {why}; unknown config key 'tempreature' "
                                             "(did you mean 'temperature'?)"),
    ]:
        r = run_in_process(["sample.py", *args], capsys)
        assert (r.returncode, r.stderr) == (2, f"error: {line}\n")


def test_int_is_converted_to_float() -> None:
    result = configure(TrainConfig(), ["--learning_rate=1", "--betas=(1, 0)"])
    assert result.learning_rate == 1.0 and type(result.learning_rate) is float
    assert result.betas == (1.0, 0.0) and all(type(b) is float for b in result.betas)


def test_none_default_overridden_by_int() -> None:
    result = configure(TrainConfig(), ["--lr_decay_iters=5000"])
    assert result.lr_decay_iters == 5000 and type(result.lr_decay_iters) is int


def test_optional_fields_can_be_set_to_none(tmp_path: Path) -> None:
    path = write(tmp_path, "a.py", "lr_decay_iters = 100\n")
    result = configure(TrainConfig(), [path, "--lr_decay_iters=None", "--max_iters=None", "--init_from=None"])
    assert (result.lr_decay_iters, result.max_iters, result.init_from) == (None, None, None)


@pytest.mark.parametrize("raw, expected", [("False", False), ("True", True)])
def test_bool_override(raw: str, expected: bool) -> None:
    start = TrainConfig(compile=not expected)
    assert configure(start, [f"--compile={raw}"]).compile is expected


@pytest.mark.parametrize(
    "arg, expected",
    [
        ("--device=cpu", "cpu"),
        ("--out_dir=out-x", "out-x"),
        ("--out_dir=2024", "2024"),  # an int literal, but the field takes text
        ("--out_dir=None", "None"),  # out_dir is not Optional, so this is the text
        ("--init_from=3", "3"),
        ("--out_dir='quoted dir'", "quoted dir"),
        ("--out_dir=", ""),
    ],
)
def test_string_values_need_no_quotes(arg: str, expected: str) -> None:
    key = arg[2:].partition("=")[0]
    assert getattr(configure(TrainConfig(), [arg]), key) == expected


def test_missing_config_file(tmp_path: Path) -> None:
    assert error_of(["config/x.py"]) == "config file not found: 'config/x.py'"
    path = str(tmp_path / "nope.py")
    assert error_of([path]) == f"config file not found: {path!r}"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("batch_size = 1\nraise ValueError('boom')\n", "ValueError: boom (line 2)"),
        ("batch_size = = 3\n", "SyntaxError: invalid syntax (line 1)"),
        ("seed = 1\n\nseed = 1 / 0\n", "ZeroDivisionError: division by zero (line 3)"),
        ("raise RuntimeError('two\\nlines')\n", "RuntimeError: two lines (line 1)"),
    ],
)
def test_config_file_that_raises(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, "bad.py", text)
    assert error_of([path]) == f"config file {path!r} failed: {expected}"


def test_all_problems_are_listed_in_one_message(tmp_path: Path) -> None:
    path = write(tmp_path, "a.py", "bach_size = 8\nseed = 'x'\nout_dir = 'fine'\n")
    missing = str(tmp_path / "missing.py")
    defaults = TrainConfig()
    with pytest.raises(ConfigError) as info:
        configure(defaults, [path, missing, "--lerning_rate=1", "--batch_size=abc", "--device=cpu"])
    assert str(info.value) == "; ".join(
        [
            f"{path}: unknown config key 'bach_size' (did you mean 'batch_size'?) (a config file's own helper names are ignored unless close to a key: name it _bach_size)",
            f"{path}: seed: expected int, got str 'x'",
            f"config file not found: {missing!r}",
            "unknown config key 'lerning_rate' (did you mean 'learning_rate'?)",
            "batch_size: expected int, got str 'abc'",
        ]
    )
    assert "\n" not in str(info.value)
    assert defaults == TrainConfig()


def test_a_value_outside_its_range_is_listed_with_the_unknown_keys_and_wrong_types() -> None:
    """One round of fixes: a key given well but out of its declared range comes in the same message as the keys
    that could not be read; a key not given is not judged, and nothing is applied."""
    from nanogpt.config import TrainConfig as RealConfig

    with pytest.raises(ConfigError) as info:
        configure(RealConfig(), ["--lerning_rate=1e-3", "--max_iters=abc", "--dropout=1.5", "--batch_size=4"])
    assert str(info.value) == ("unknown config key 'lerning_rate' (did you mean 'learning_rate'?); "
                               "max_iters: expected int, got str 'abc'; dropout=1.5 must be in [0, 1)")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch_size", "32"], "'--batch_size 32': use --batch_size=32"),
        (["--seed"], "'--seed' has no value: use --seed=VALUE"),
        (["--seed", "--compile"], "'--seed' has no value: use --seed=VALUE"),
        (["--compile", "False"], "'--compile False': use --compile=False"),
        (
            ["--bach_size", "8"],
            "'--bach_size 8': use --bach_size=8; unknown config key 'bach_size' (did you mean 'batch_size'?)",
        ),
        (["--=5"], "bad argument '--=5': use --key=value"),
        (["--"], "bad argument '--': use --key=value"),
    ],
)
def test_override_without_equals_sign(argv: list[str], message: str) -> None:
    assert error_of(argv) == message


def test_space_separated_config_file_is_still_read(tmp_path: Path) -> None:
    # `--seed a.py`: the .py item is a config file, not the flag's value, so its problems are reported too.
    path = write(tmp_path, "a.py", "seed = 'x'\n")
    assert error_of(["--seed", path]) == (
        f"'--seed' has no value: use --seed=VALUE; {path}: seed: expected int, got str 'x'"
    )
    assert configure(TrainConfig(), ["--compile", write(tmp_path, "b.py", "seed = 3\n")]).seed == 3


def test_a_bare_boolean_flag_means_true() -> None:
    """`--compile`, `bench.py --ablation`: argparse's store_true habit (nanoGPT's users type them so)."""
    import train
    from bench import BenchConfig

    assert configure(TrainConfig(compile=False), ["--compile"]).compile is True
    assert configure(TrainConfig(compile=False), ["--compile", "--seed=1"]) == TrainConfig(compile=True, seed=1)
    assert configure(BenchConfig(), ["--profile"]).profile is True  # bench.py --ablation: see test_ablation.py
    cfg = configure(train.TrainConfig(), ["--fused_adamw", "--eval_only", "--compile=False"])  # bool | None too
    assert (cfg.fused_adamw, cfg.eval_only, cfg.compile) == (True, True, False)


def test_config_error_is_a_user_error() -> None:
    assert issubclass(ConfigError, UserError)
    with pytest.raises(UserError, match=r"^unknown config key 'nope'$"):
        configure(TrainConfig(), ["--nope=1"])


def test_configure_rejects_a_non_dataclass() -> None:
    with pytest.raises(TypeError, match="needs a dataclass instance, got dict"):
        configure({"batch_size": 1}, [])  # type: ignore[type-var]


def test_config_summary_lists_what_differs_from_the_defaults_and_reads_back() -> None:
    assert config_summary(TrainConfig()) == "config: the defaults (TrainConfig)"
    config = dataclasses.replace(TrainConfig(), out_dir="out-x", lr_decay_iters=10, compile=False)
    assert config_summary(config) == "config (differs from the defaults): out_dir='out-x', compile=False, lr_decay_iters=10"
    config = dataclasses.replace(config, init_from="a" * 60, betas=(0.8, 0.9), eval_iters=[3], seed=1)
    summary = config_summary(config, width=60)
    lines = summary.splitlines()
    assert lines[0] == "config (differs from the defaults): out_dir='out-x',"
    assert all(len(line) <= 60 for line in lines if "aaa" not in line)  # a value longer than a line has its own
    assert [line for line in lines if "aaa" in line] == [f"  init_from='{'a' * 60}',"]
    # each key=value is a --key=value override: applying them to the defaults rebuilds the config
    items = re.split(r",\s+(?=\w+=)", summary.removeprefix("config (differs from the defaults):").strip())
    assert [item.split("=")[0] for item in items] == [
        "out_dir", "compile", "seed", "lr_decay_iters", "init_from", "betas", "eval_iters"]  # field order
    assert configure(TrainConfig(), [f"--{item}" for item in items]) == config


# Each field with a strategy for its valid values. Floats exclude nan (never equal to itself) and inf
# (repr 'inf' is not a Python literal).
VALID_VALUES = st.one_of(
    st.tuples(st.just("batch_size"), st.integers(-2**63, 2**63 - 1)),  # an int is 64 bits (torch's, numpy's)
    st.tuples(st.just("learning_rate"), st.floats(allow_nan=False, allow_infinity=False)),
    st.tuples(st.just("compile"), st.booleans()),
    st.tuples(st.just("out_dir"), st.text()),
    st.tuples(st.just("lr_decay_iters"), st.none() | st.integers(-2**63, 2**63 - 1)),
    st.tuples(st.just("init_from"), st.none() | st.text()),
    st.tuples(st.just("betas"), st.tuples(st.floats(-1e3, 1e3), st.floats(-1e3, 1e3))),
)


@settings(max_examples=200, deadline=None)
@given(VALID_VALUES)
def test_override_round_trips_any_valid_value(key_value: tuple[str, object]) -> None:
    key, value = key_value
    got = getattr(configure(TrainConfig(), [f"--{key}={value!r}"]), key)
    assert got == value and type(got) is type(value)
    assert repr(got) == repr(value)  # tells -0.0 from 0.0


# Text without quotes (so it is never a string literal) reaches a str field as typed.
UNQUOTED_TEXT = st.text(st.characters(blacklist_characters="'\"", blacklist_categories=("Cs",)))


@settings(max_examples=200, deadline=None)
@given(UNQUOTED_TEXT)
def test_unquoted_text_reaches_a_str_field_unchanged(text: str) -> None:
    assert configure(TrainConfig(), [f"--device={text}"]).device == text


UNKNOWN_KEYS = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True).filter(lambda k: k not in FIELDS)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(UNKNOWN_KEYS, st.integers())
def test_unknown_key_always_raises_naming_the_key(key: str, value: int) -> None:
    message = error_of([f"--{key}={value}"])
    assert message.startswith(f"unknown config key {key!r}")


def test_a_config_files_helper_names_are_accepted_and_a_typo_of_a_key_is_not(tmp_path):
    """nanoGPT exec's its config files, so users compute keys from helper names: those are ignored; a name close to
    a key is still a typo, refused with the key it resembles."""
    path = tmp_path / "c.py"
    path.write_text("tokens_per_step = 64 * 1024\nbatch_size = tokens_per_step // 1024\n")
    assert configure(TrainConfig(), [str(path)]).batch_size == 64
    path.write_text("learning_rat = 1e-3\n")
    with pytest.raises(UserError, match=r"unknown config key 'learning_rat' \(did you mean 'learning_rate'\?\)"):
        configure(TrainConfig(), [str(path)])


@dataclass
class _Documented:
    """Keys whose comments --help reads. Not a test."""

    # a section comment: no key's
    short: int = 1  # a comment, with a # in it
    # a comment line of its own: no key's either
    plain: int = 3

    def method(self) -> None:
        short: int = 2  # a local variable's comment, not the key's
        del short


def test_help_reads_the_comment_on_each_fields_line() -> None:
    """A key's help is the comment on its line in the class's source: comment lines of their own belong to no key,
    nor does a method's."""
    assert configurator._field_comments(_Documented) == {"short": "a comment, with a # in it"}


def test_an_int_past_64_bits_is_refused_and_named_without_its_digits(tmp_path: Path) -> None:
    """Bug: `max_iters = 10**10000` in a config file passed, then ended the run in a ValueError (an int of more than
    4300 digits has no repr)."""
    path = write(tmp_path, "big.py", "max_iters = 10**10000\nseed = 2**63\n")
    assert error_of([path]) == (f"{path}: max_iters: <an int of 33220 bits> is past a 64-bit int (what torch and "
                                f"numpy hold); {path}: seed: 9223372036854775808 is past a 64-bit int (what torch and "
                                f"numpy hold)")
    assert configure(TrainConfig(), ["--seed=9223372036854775807"]).seed == 2**63 - 1


def test_a_config_file_that_is_not_utf8_or_binds_a_key_to_a_function_is_refused(tmp_path):
    """A review's reproductions: a config file with a byte that is no UTF-8 was a UnicodeDecodeError traceback; and
    `learning_rate = lambda: 1.0`, `class batch_size`, `import os as out_dir` were dropped as the file's own tools,
    so the run trained on the defaults without a word. A name that is exactly a key is checked as the key."""
    latin = tmp_path / "latin.py"
    latin.write_bytes(b"batch_size = 4\nseed = \xff\n")
    with pytest.raises(UserError, match=re.escape(f"config file {str(latin)!r} is not UTF-8 text (byte b'\\xff' at "
                                                  f"offset 22): save it as UTF-8")):
        configurator.configure(TrainConfig(), [str(latin)])
    tools = tmp_path / "tools.py"
    tools.write_text("learning_rate = lambda: 1.0\nclass batch_size: pass\nimport os as out_dir\n"
                     "def _helper(): pass\nimport math\nseed = int(math.sqrt(16))\n")
    with pytest.raises(UserError) as e:
        configurator.configure(TrainConfig(), [str(tools)])
    assert [p.split(": ")[1] for p in str(e.value).split("; ")] == ["learning_rate", "batch_size", "out_dir"], str(e.value)
    plain = tmp_path / "plain.py"  # the file's own tools of other names are still its own
    plain.write_text("import math\ndef helper():\n    return int(math.sqrt(16))\nseed = helper()\n")
    assert configurator.configure(TrainConfig(), [str(plain)]).seed == 4

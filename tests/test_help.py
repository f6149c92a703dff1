"""`--help` on every script: its usage and, for the scripts with a typed config, every key with its type, default
and the comment beside it in the dataclass's source. Each script runs in this process as `python SCRIPT --help`
would run it (runpy, as __main__), so the whole file takes seconds, not a fresh interpreter per script."""
from __future__ import annotations

import dataclasses
import functools
import glob
import inspect
import os
import re
import runpy
import sys

import pytest

import bench
import export
import hellaswag
import sample
import train
from benchmarks import ablation, memory
from configurator import help_text
from helpers import ROOT

SCRIPTS = ["train.py", "sample.py", "bench.py", "hellaswag.py", "export.py", "plot.py", "convert_sharded.py",
           *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "benchmarks", "[!_]*.py"))),
           *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "data", "*", "prepare.py")))]
# The typed configs whose keys each script's --help lists (a study's own, then bench.py's).
CONFIGS = {
    "train.py": [train.TrainConfig],
    "sample.py": [sample.SampleConfig],
    "bench.py": [bench.BenchConfig],
    "hellaswag.py": [hellaswag.HellaSwagConfig],
    "export.py": [export.ExportConfig],
    "benchmarks/numerics.py": [bench.BenchConfig],
    "benchmarks/ablation.py": [ablation.AblationConfig, bench.BenchConfig],
    "benchmarks/memory.py": [memory.MemoryConfig, bench.BenchConfig],
}


def run_help(script: str, capsys, flag: str = "--help") -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `python SCRIPT --help`, run in this process."""
    argv, cwd = sys.argv, os.getcwd()
    sys.argv = [script, flag]
    os.chdir(ROOT)
    capsys.readouterr()
    try:
        runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = argv
        os.chdir(cwd)
    out = capsys.readouterr()
    return code, out.out, out.err


def listed_keys(out: str) -> dict[str, list[str]]:
    """{key: [default, type, comment]} from the `    --key=default  type  comment` lines of --help (a comment wrapped
    onto the lines below joined back)."""
    keys: dict[str, list[str]] = {}
    last = None
    for line in out.splitlines():
        m = re.fullmatch(r"    --(\w+)=(.*?)  +(.+?)(?:  +(.*))?", line)
        if m:
            last = m[1]
            keys[last] = [m[2], m[3], m[4] or ""]
        elif line.startswith(" " * 10) and last:
            keys[last][2] = f"{keys[last][2]} {line.strip()}".strip()
        else:
            last = None
    return keys


@functools.lru_cache
def class_source(cls: type) -> str:
    return inspect.getsource(cls)


def source_comment(cls: type, name: str) -> str:
    """The comment on the line of the field `name` in the source of `cls` ('' when it has none or no such line)."""
    found = re.search(rf"^    {name}: [^\n]*?(?:  # ([^\n]*))?$", class_source(cls), re.M)
    return (found and found[1]) or ""


def test_every_script_is_covered():
    assert {"benchmarks/attention.py", "benchmarks/gpu.py", "data/shakespeare_char/prepare.py",
            "data/fineweb_edu/prepare.py"} <= set(SCRIPTS)
    assert len(SCRIPTS) >= 7 + 8 + 4  # 8 in benchmarks/, 4 prepare scripts today


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_prints_the_usage_and_exits_0(script, capsys):
    code, out, err = run_help(script, capsys)
    assert code == 0, err
    assert "error" not in err and "Traceback" not in err
    if script in CONFIGS or script == "convert_sharded.py":  # the usage is the docstring's
        docstring = open(os.path.join(ROOT, script), encoding="utf-8").read().split('"""')[1]
        assert out.startswith(docstring.strip().splitlines()[0]), out[:300]
    else:
        assert out.startswith("usage: "), out[:300]  # argparse's


@pytest.mark.parametrize("script", sorted(CONFIGS))
def test_help_lists_every_key_with_its_default_type_and_comment(script, capsys):
    code, out, _ = run_help(script, capsys, flag="-h")
    assert code == 0
    keys = listed_keys(out)
    expected = [f for cls in CONFIGS[script] for f in dataclasses.fields(cls)]
    assert sorted(keys) == sorted(f.name for f in expected)
    for cls in CONFIGS[script]:
        defaults = cls()
        for f in dataclasses.fields(cls):
            default, _, comment = keys[f.name]
            assert default == repr(getattr(defaults, f.name)), f.name
            own = next((source_comment(c, f.name) for c in cls.__mro__ if dataclasses.is_dataclass(c)
                        and source_comment(c, f.name)), "")
            assert comment.startswith(own), (f.name, own, comment)


def test_train_help_text_of_some_keys(capsys):
    """The exact comments, as the source writes them on the field's line, then the values its type declares (a range,
    the choices, a declaration's note); StepConfig's keys (the base class) before TrainConfig's."""
    _, out, _ = run_help("train.py", capsys)
    keys = listed_keys(out)
    assert keys["eval_only"] == ["False", "bool", "evaluate once and exit"]
    assert keys["fused_loss"] == ["None", "bool | None", "head and loss in chunks, no (tokens x vocab) logits; None: "
                                  "fused on a CPU only"]
    assert keys["min_lr"] == ["6e-05", "float", "~ learning_rate / 10 [at least 0]"]  # the range its type declares
    assert keys["optimizer"] == ["'adamw'", "str", "muon: Muon for the blocks' matrices, AdamW the rest "
                                                   "[one of adamw, muon]"]
    assert keys["out_dir"][2] == ("the run's folder: checkpoints, metrics.jsonl, report.md [not empty; give a folder: "
                                  "'.' for the current one]")
    assert out.index("StepConfig (config.py)") < out.index("--seed=") < out.index("TrainConfig (config.py)")


def test_sample_help_shows_a_declarations_note(capsys):
    _, out, _ = run_help("sample.py", capsys)
    assert listed_keys(out)["temperature"][2] == "1.0: the model's distribution [at least 0; 0 means greedy]"


def test_a_subclass_default_is_listed_under_the_subclass_with_the_base_comment():
    out = help_text(None, bench.BenchConfig())
    bench_section = out[out.index("BenchConfig (bench.py)"):]
    keys = listed_keys(bench_section)
    assert keys["gradient_accumulation_steps"] == ["1", "int", "micro-steps per optimizer step, over all DDP ranks "
                                                               "together [at least 1]"]
    assert "gradient_accumulation_steps" not in listed_keys(out[: out.index("BenchConfig (bench.py)")])


def test_help_anywhere_wins_over_bad_arguments(capsys):
    from helpers import run_in_process

    result = run_in_process(["train.py", "--no_such_key=1", "config/missing.py", "--help"], capsys)
    assert result.returncode == 0 and result.stderr == ""
    assert "--eval_only=False" in result.stdout

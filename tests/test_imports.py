"""The house's shape, read from the sources (every import, also those inside functions): the root holds the commands,
model.py and configurator.py; the library is the package nanogpt/, which imports no command; no file imports one that
imports it back, directly or through others; the inference scripts never load the training script."""
from __future__ import annotations

import ast
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = {"train", "sample", "bench", "export", "hellaswag", "plot", "convert_sharded"}
ROOT_MODULES = {"model", "configurator"}  # the mission's names: the model, and the settings' reader


def project_modules() -> dict[str, str]:
    """Module name -> file, for the root, the package, benchmarks/ and data/ (tests excluded)."""
    files = glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "nanogpt", "*.py"))
    files += glob.glob(os.path.join(ROOT, "benchmarks", "*.py")) + glob.glob(os.path.join(ROOT, "data", "*.py"))
    files += glob.glob(os.path.join(ROOT, "data", "*", "*.py"))
    return {os.path.relpath(f, ROOT)[:-3].replace(os.sep, "."): f for f in files if not f.endswith("__init__.py")}


def imports_of(path: str, top_level_only: bool = False) -> set[str]:
    """Every module name an import in `path` names (`from a import b` names a and a.b); top_level_only: those of
    the module's own body, run when it is imported, not those inside functions or classes."""
    tree = ast.parse(open(path).read(), path)
    nodes = tree.body if top_level_only else ast.walk(tree)
    targets = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets.add(node.module)
            targets.update(f"{node.module}.{alias.name}" for alias in node.names)  # from nanogpt import dataio
    return targets


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: {t for t in imports_of(path) if t in modules and t != name} for name, path in modules.items()}


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_the_graph_sees_the_imports_it_must():
    graph = import_graph()
    assert {"nanogpt.checkpoints", "nanogpt.device", "model"} <= graph["train"]
    assert "nanogpt.measure" in graph["bench"] and "bench" in graph["benchmarks.ablation"]
    assert "nanogpt.tokenizers" in graph["data.shakespeare_char.prepare"]
    assert "nanogpt.errors" in graph["nanogpt.checkpoint_file"]  # from nanogpt.errors import UserError


def test_the_root_holds_the_commands_model_and_configurator():
    root = {os.path.basename(f)[:-3] for f in glob.glob(os.path.join(ROOT, "*.py"))}
    assert root == COMMANDS | ROOT_MODULES, f"not a command, model.py or configurator.py: {root - COMMANDS - ROOT_MODULES}"


def test_the_package_imports_no_command():
    graph = import_graph()
    upward = {name: sorted(graph[name] & COMMANDS) for name in graph if name.startswith("nanogpt.")}
    assert not {k: v for k, v in upward.items() if v}, upward
    # from the root, the package takes the model alone: the settings' reader is the commands'
    assert {m for name in graph if name.startswith("nanogpt.") for m in graph[name] if "." not in m} <= {"model"}


def test_model_imports_torch_and_the_standard_library_only_at_module_level():
    allowed = set(sys.stdlib_module_names) | {"torch"}
    names = imports_of(os.path.join(ROOT, "model.py"), top_level_only=True)
    assert {n.split(".")[0] for n in names} <= allowed, names


def test_model_imports_nothing_of_the_project_anywhere():
    """Not even inside a function: copied alone, model.py computes what it says (what the caller wants different,
    the caller hands in). transformers, inside from_pretrained, is the one import beside torch's and the stdlib's."""
    allowed = set(sys.stdlib_module_names) | {"torch", "transformers"}
    names = imports_of(os.path.join(ROOT, "model.py"))
    assert {n.split(".")[0] for n in names} <= allowed, names
    assert not names & set(project_modules()) and "nanogpt" not in {n.split(".")[0] for n in names}, names


def test_no_file_imports_one_that_imports_it_back():
    graph = import_graph()
    circles = []
    for name in graph:
        if name in reachable(graph, name):
            back = sorted(m for m in graph[name] if name in reachable(graph, m) or m == name)
            circles.append(f"{name} imports {', '.join(back)}, which import(s) {name} back")
    assert not circles, circles


def test_sampling_exporting_and_scoring_never_load_the_training_script():
    graph = import_graph()
    for script in ("sample", "export", "hellaswag", "convert_sharded", "nanogpt.checkpoints"):
        assert "train" not in reachable(graph, script), script
    assert not {"bench", "train", "sample"} & reachable(graph, "nanogpt.checkpoint_file")  # what every script reads through

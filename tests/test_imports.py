"""The project's import graph, read from the sources (every import, also those inside functions): no file imports one
that imports it back, directly or through others, and the inference scripts never load the training script."""
from __future__ import annotations

import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def project_modules() -> dict[str, str]:
    """Module name -> file, for the scripts, benchmarks/ and the data preparation scripts (tests excluded)."""
    files = glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))
    files += glob.glob(os.path.join(ROOT, "data", "*", "*.py"))
    return {os.path.relpath(f, ROOT)[:-3].replace(os.sep, "."): f for f in files if not f.endswith("__init__.py")}


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.add(node.module)
                targets.update(f"{node.module}.{alias.name}" for alias in node.names)  # from benchmarks import x
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_the_graph_sees_the_imports_it_must():
    graph = import_graph()
    assert {"checkpoint", "common", "model"} <= graph["train"]
    assert "measure" in graph["bench"] and "bench" in graph["benchmarks.ablation"]
    assert "dataio" in graph["data.shakespeare_char.prepare"]


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
    for script in ("sample", "export", "hellaswag", "checkpoint", "parallel"):
        assert "train" not in reachable(graph, script), script
    assert not {"bench", "train", "sample"} & reachable(graph, "checkpoint")  # the module every script reads through

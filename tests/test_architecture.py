"""The house rules of docs/architecture.md, checked on the source: packages import one way (no cycle), the core
never imports a tool, a benchmark or the evaluation, only parallel/ reads the mesh sizes, the loop takes the run
whole, train.py stays a short story without packed calls, and no function of the core grows past 60 lines."""

import ast
import inspect
import re
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "disttrain"
CORE = ("recipe", "runtime", "data", "model", "objectives", "training", "metrics", "report", "parallel")


def imports_of(package: str) -> set[str]:
    found = set()
    for path in (PACKAGE / package).rglob("*.py"):
        found |= set(re.findall(r"(?:from|import) disttrain\.([a-z_]+)", path.read_text()))
    return found - {package}


def test_packages_import_one_way_and_the_core_never_imports_tools():
    packages = [p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()]
    graph = {p: imports_of(p) & set(packages) for p in packages}

    def cycle_from(start, node, seen):
        for nxt in graph[node]:
            if nxt == start:
                return [node, nxt]
            if nxt not in seen:
                seen.add(nxt)
                found = cycle_from(start, nxt, seen)
                if found:
                    return [node, *found]
        return None

    cycles = [c for p in packages if (c := cycle_from(p, p, set()))]
    assert not cycles, cycles
    for package in CORE:
        assert not graph[package] & {"tools", "bench", "evaluation"}, (package, graph[package])


def test_only_the_parallel_package_reads_the_mesh_sizes():
    pattern = re.compile(r"\bplan\.(sp|cp|tp|fsdp_data)\b")
    offenders = [f"{path.relative_to(REPO)}:{n}" for path in [*PACKAGE.rglob("*.py"), REPO / "train.py"]
                 if "parallel" not in path.parts
                 for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not offenders, offenders


def test_the_loop_takes_the_run_whole_and_train_py_packs_no_call():
    from disttrain.training import loop

    assert len(inspect.signature(loop.train).parameters) <= 4
    source = (REPO / "train.py").read_text()
    assert len(source.splitlines()) <= 150
    calls = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)]
    packed = [ast.unparse(c)[:80] for c in calls if len(c.args) + len(c.keywords) > 8]
    assert not packed, packed


def test_no_function_of_the_core_is_over_60_lines():
    long = [f"{path.relative_to(REPO)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for package in CORE for path in (PACKAGE / package).rglob("*.py")
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60]
    assert not long, long


def test_the_map_names_every_package():
    text = (REPO / "docs/architecture.md").read_text()
    assert all(f"  {p}/" in text for p in CORE), [p for p in CORE if f"  {p}/" not in text]
    assert Path(PACKAGE / "parallel" / "__init__.py").read_text().count(".py") >= 3


def test_lint_is_clean():
    """`make lint` (ruff, configured in pyproject.toml) on everything Python in the repository."""
    import subprocess
    import sys

    found = subprocess.run([sys.executable, "-m", "ruff", "check", "disttrain", "train.py", "tests", "scripts"],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
    assert found.returncode == 0, found.stdout[-3000:] + found.stderr[-1000:]

"""The package's layers, read from the source (every import, at module level or inside a function):
command line -> launch/ -> job -> decorator and Run -> stores -> basics, with no circles, and the start-up cost of
commands that do not train (no torch, no MLflow)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "gwenlake_hpc"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports() -> dict[str, set[str]]:
    """{module: gwenlake_hpc modules it imports}, relative imports resolved, ``from X import name`` counted as
    X.name when that is a module."""
    modules = {module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):  # names only used in annotations (`if TYPE_CHECKING:`) import nothing
            if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
                node.body = []
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    deps.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def test_no_module_outside_the_command_line_imports_a_launcher():
    graph = imports()
    allowed = ("gwenlake_hpc.launch", "gwenlake_hpc.cli", "gwenlake_hpc.__main__")
    offenders = {m: sorted(d for d in deps if d.startswith("gwenlake_hpc.launch"))
                 for m, deps in graph.items() if not m.startswith(allowed)}
    assert {m: d for m, d in offenders.items() if d} == {}


def test_stores_never_import_the_run_or_the_job():
    graph = imports()
    stores = ("gwenlake_hpc.checkpoints", "gwenlake_hpc.tracking", "gwenlake_hpc.versioning", "gwenlake_hpc.data")
    upper = {"gwenlake_hpc.run", "gwenlake_hpc.run_metrics", "gwenlake_hpc.run_checkpoints", "gwenlake_hpc.job",
             "gwenlake_hpc.finish", "gwenlake_hpc.plan", "gwenlake_hpc.config", "gwenlake_hpc.api",
             "gwenlake_hpc.release"}
    offenders = {m: sorted(deps & upper) for m, deps in graph.items() if m.startswith(stores) and deps & upper}
    assert offenders == {}


def test_the_basics_import_only_basics():
    graph = imports()
    basics = {"gwenlake_hpc.errors", "gwenlake_hpc.rules", "gwenlake_hpc.names", "gwenlake_hpc.fsutil"}
    assert {m: sorted(graph[m] - basics) for m in basics if graph[m] - basics} == {}


def test_the_plan_imports_neither_the_job_nor_the_run():
    """config -> plan -> launcher -> job -> Run: the launchers plan without the job's execution or torch's Run."""
    deps = imports()["gwenlake_hpc.plan"]
    assert not deps & {"gwenlake_hpc.job", "gwenlake_hpc.run", "gwenlake_hpc.local"}, sorted(deps)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            # a package's __init__ re-exporting its own modules is not a circle between concerns
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles_between_modules():
    graph = imports()
    # A package's __init__ re-exports its modules; modules importing "the package" mean one of those modules.
    packages = {m for m in graph if (PKG.parent / m.replace(".", "/") / "__init__.py").exists()}
    flat = {m: deps - packages for m, deps in graph.items() if m not in packages}
    assert cycles(flat) == []


@pytest.mark.parametrize("command", [["status"], ["models", "list", "t.model"], ["checkpoints", "list"], ["data", "show", "t.rows"],
                                     ["tracking", "--help"], ["logs", "--help"], ["report", "--help"]])
def test_commands_that_do_not_train_load_neither_torch_nor_mlflow(project, command):
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "gwenlake_hpc", *command], cwd=project.root,
                          capture_output=True, text=True, timeout=120, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    loaded = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "gwenlake_hpc" in loaded, proc.stderr[-2000:]
    assert not loaded & {"torch", "mlflow"}, sorted(loaded & {"torch", "mlflow"})


def test_no_module_imports_another_ones_private_names():
    """A name with a leading underscore is its module's own: another module that needs it gets a public one."""
    offenders = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("gwenlake_hpc")):
                offenders += [f"{module_name(path)}: {node.module}.{a.name}" for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__")]
    assert offenders == []


def test_every_module_has_its_paragraph_in_the_architecture_notes():
    doc = (PKG.parent / "docs" / "architecture.md").read_text()
    readme = (PKG.parent / "README.md").read_text()
    layout = readme[readme.index("## Layout"):]
    modules = sorted(p.stem for p in PKG.rglob("*.py") if p.stem not in ("__init__", "__main__"))
    assert [m for m in modules if f"`{m}`" not in doc] == []
    assert [m for m in modules if f"`{m}`" not in layout] == []

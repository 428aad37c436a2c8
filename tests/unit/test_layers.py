"""The package's layers, read from the source: every import counts, at module level, inside a function or under
``if TYPE_CHECKING:``. The layers are folders, top to bottom:

    the public facade (gwenlake_hpc, __main__, decorator, transforms, data) -> cli/ -> release/ -> launch/ -> job/
    -> authoring/ -> runtime/ -> stores/ -> base/

A module imports its own layer or the layers below it, never one above; no circles between modules; and the
start-up cost of commands that do not train (no torch, no MLflow)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "gwenlake_hpc"

#: Top to bottom. A module belongs to the first layer whose prefix it starts with.
LAYERS = [
    ("facade", ("gwenlake_hpc.__main__", "gwenlake_hpc.decorator", "gwenlake_hpc.transforms", "gwenlake_hpc.data")),
    ("cli", ("gwenlake_hpc.cli",)),
    ("release", ("gwenlake_hpc.release",)),
    ("launch", ("gwenlake_hpc.launch",)),
    ("job", ("gwenlake_hpc.job",)),
    ("integrations", ("gwenlake_hpc.integrations",)),
    ("authoring", ("gwenlake_hpc.authoring",)),
    ("runtime", ("gwenlake_hpc.runtime",)),
    ("stores", ("gwenlake_hpc.stores",)),
    ("base", ("gwenlake_hpc.base",)),
]
#: The root package holds ``__version__`` and its public names, imported on first use: importing any module
#: of the package imports it first anyway, so it is in no layer.
ROOT = "gwenlake_hpc"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str | None:
    for layer, prefixes in LAYERS:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return layer
    return None


def import_statements(name: str, path) -> list[tuple[str, str | None]]:
    """``(target module, imported name or None)`` for every import statement of module ``name`` (module level, in
    functions, under ``if TYPE_CHECKING:``), relative imports resolved against its package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found += [(target, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names]
    return found


def imports() -> dict[str, set[str]]:
    """{module: gwenlake_hpc modules it imports}, every import statement counted (module level, in functions,
    under ``if TYPE_CHECKING:``), relative imports resolved, ``from X import name`` counted as X.name when that
    is a module."""
    modules = {module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = {f"{target}.{what}" if what and f"{target}.{what}" in modules else target
                for target, what in import_statements(name, path)}
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def test_every_module_is_in_a_layer():
    assert [m for m in imports() if m != ROOT and layer_of(m) is None] == []


def test_no_module_imports_a_layer_above_its_own():
    """One rule in place of many: stores never import the Run, the job, the decorator, the release gate or a
    launcher; the job never imports a launcher; the basics import nothing else of the package; and so on."""
    rank = {layer: i for i, (layer, _) in enumerate(LAYERS)}
    offenders = {}
    for module, deps in imports().items():
        if module == ROOT:
            continue
        up = sorted(d for d in deps if d != ROOT and rank[layer_of(d)] < rank[layer_of(module)])
        if up:
            offenders[module] = up
    assert offenders == {}


@pytest.mark.parametrize("layer, forbidden", [
    ("gwenlake_hpc.base", ("gwenlake_hpc.",)),  # the basics import nothing of the package but themselves
    ("gwenlake_hpc.stores", ("gwenlake_hpc.runtime", "gwenlake_hpc.job", "gwenlake_hpc.authoring",
                             "gwenlake_hpc.release", "gwenlake_hpc.launch", "gwenlake_hpc.cli")),
    ("gwenlake_hpc.runtime", ("gwenlake_hpc.authoring", "gwenlake_hpc.job", "gwenlake_hpc.launch",
                              "gwenlake_hpc.cli")),
    ("gwenlake_hpc.job", ("gwenlake_hpc.launch", "gwenlake_hpc.cli", "gwenlake_hpc.release")),
    ("gwenlake_hpc.launch", ("gwenlake_hpc.cli", "gwenlake_hpc.release")),
])
def test_prefix_rules(layer, forbidden):
    """The rules the architecture notes state, each as prefixes (the ordering above implies them; these say
    them in the notes' words)."""
    offenders = {m: sorted(d for d in deps if d.startswith(forbidden) and not d.startswith(layer + ".")
                           and d != ROOT)
                 for m, deps in imports().items() if m == layer or m.startswith(layer + ".")}
    assert {m: d for m, d in offenders.items() if d} == {}


TRACKING = "gwenlake_hpc.stores.tracking"


def test_the_tracking_delivery_never_imports_the_user_mlflow_side_nor_the_tracker():
    """tracking/delivery/ gets the job's points into MLflow; the training function's own MLflow calls
    (tracking/user_mlflow/) and the Run's Tracker write to it, never the other way round."""
    graph = imports()
    offenders = {m: sorted(d for d in deps if d.startswith(f"{TRACKING}.user_mlflow")
                           or d in (f"{TRACKING}.tracker", f"{TRACKING}.null_tracker"))
                 for m, deps in graph.items() if m.startswith(f"{TRACKING}.delivery")}
    assert any(m.startswith(f"{TRACKING}.delivery.") for m in graph)
    assert {m: d for m, d in offenders.items() if d} == {}


def test_the_plan_imports_neither_the_job_execution_nor_the_run():
    """config -> plan -> launcher -> job -> Run: the launchers plan without the job's execution or torch's Run."""
    deps = imports()["gwenlake_hpc.job.plan"]
    assert not deps & {"gwenlake_hpc.job.execute", "gwenlake_hpc.job.local", "gwenlake_hpc.job.finish",
                       "gwenlake_hpc.runtime.run"}, sorted(deps)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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
    """Every import counted. A package's ``__init__`` re-exports its own modules, so a module that imports "the
    package" (``from ..checkpoints import X``) is read as importing the module of that package that defines X
    where one does (else the package itself, with its edges)."""
    graph = imports()
    assert cycles(resolve_package_imports(graph)) == []


def test_no_import_circles_between_layers():
    graph = imports()
    layer_graph: dict[str, set[str]] = {}
    for module, deps in graph.items():
        if module == ROOT:
            continue
        layer_graph.setdefault(layer_of(module), set()).update(
            layer_of(d) for d in deps if d != ROOT and layer_of(d) != layer_of(module))
    assert cycles(layer_graph) == []


def defining_module(package: str, name: str, modules: dict[str, Path]) -> str | None:
    """The module of ``package`` whose ``from .module import name`` the package's ``__init__`` re-exports."""
    init = modules[package]
    for node in ast.walk(ast.parse(init.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            if any((a.asname or a.name) == name for a in node.names):
                candidate = f"{package}.{node.module}"
                return candidate if candidate in modules else None
    return None


def resolve_package_imports(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph with ``from <package> import name`` edges pointed at the module that defines ``name``."""
    modules = {module_name(p): p for p in PKG.rglob("*.py")}
    packages = {m for m, p in modules.items() if p.name == "__init__.py"}
    out: dict[str, set[str]] = {}
    for name, path in modules.items():
        if name == ROOT:
            continue
        deps: set[str] = set()
        for target, what in import_statements(name, path):
            if what is None:
                deps.add(target)
            elif f"{target}.{what}" in modules:
                deps.add(f"{target}.{what}")
            elif target in packages and name not in packages:
                deps.add(defining_module(target, what, modules) or target)
            else:
                deps.add(target)
        out[name] = {d for d in deps if d in modules and d != name and d != ROOT}
    return out


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
    layout = (PKG.parent / "docs" / "layout.md").read_text()
    modules = sorted(p.stem for p in PKG.rglob("*.py") if p.stem not in ("__init__", "__main__"))
    assert [m for m in modules if f"`{m}`" not in doc] == []
    assert [m for m in modules if f"`{m}`" not in layout] == []


def test_logger_names_are_the_names_users_filter_on_not_module_paths():
    """Logger names stayed when the modules moved into layer folders (``gwenlake_hpc.data.write``, not
    ``gwenlake_hpc.stores.data.write``): every logger is named by a string, none by ``__name__``."""
    new_folders = ("base", "stores", "runtime", "authoring")  # the layers that were flat modules before
    names = {}
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "getLogger" and node.args:
                arg = node.args[0]
                assert not (isinstance(arg, ast.Name) and arg.id == "__name__"), f"{path.relative_to(PKG)}:{node.lineno}"
                if isinstance(arg, ast.Constant):  # (others: loggers of other libraries, records replayed by name)
                    names[arg.value] = path.relative_to(PKG)
    assert {"gwenlake_hpc.data.write", "gwenlake_hpc.data.tables", "gwenlake_hpc.data.dataset"} <= set(names)
    moved = {n: str(p) for n, p in names.items() if n.split(".")[1:2] and n.split(".")[1] in new_folders}
    assert moved == {}, moved


def test_importing_the_package_loads_no_framework():
    """The integrations are opt-in: `import gwenlake_hpc` must not pull transformers or lightning."""
    import subprocess
    import sys

    code = (
        "import sys, gwenlake_hpc, gwenlake_hpc.integrations;"
        "print(sorted(m for m in ('transformers', 'lightning', 'pytorch_lightning') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]"

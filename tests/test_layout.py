"""The import graph of `benchctl` and `architectures`: no cycles, layers that point one way, a light command line.

Every import statement counts, wherever it is (module top, inside a function, under TYPE_CHECKING): a function-level
import is still a dependency, only a later one. Layers, from the top: the framework (benchctl.cli, benchctl.study,
benchctl.commands, benchctl.browse, benchctl.plans), the stages (benchctl.stages), the report's building blocks the
stages' sections use (benchctl.report), the core services (benchctl.core), and the models (architectures).

The command line is built from every command module, so `benchctl --help` costs what they import at their top:
help and the list of plans must not load torch, pandas or the models (each checked in a fresh interpreter).

The framework (study, cli, browse and the report library) names no stage: it imports the stages' registry, never a
stage's own modules, and browse's SQL names no stage's table.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("benchctl", "architectures")

# The import graph walks every module of the tree and `--help` loads every stage's command: the extension
# examples' files and command are checked with the rest.
pytestmark = pytest.mark.registry


# (importer, what it must not import): a module is matched with its submodules
FORBIDDEN = [
    ("architectures", ("benchctl",)),
    (
        "benchctl.core",
        (
            "benchctl.stages",
            "benchctl.report",
            "benchctl.study",
            "benchctl.cli",
            "benchctl.commands",
            "benchctl.browse",
            "benchctl.plans",
        ),
    ),
    ("benchctl.report", ("benchctl.stages", "benchctl.study", "benchctl.cli", "benchctl.commands", "benchctl.browse")),
    ("benchctl.stages", ("benchctl.study", "benchctl.cli", "benchctl.commands", "benchctl.browse")),
]


def modules(root: Path = REPO) -> dict[str, Path]:
    """Every module of the packages by dotted name (a package by its own name: its __init__.py)."""
    found: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imported(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of `known` that `source` (the text of `module`) imports, anywhere in it.

    `from a.b import c` imports module a.b.c when there is one, else names from a.b; relative imports are resolved
    against the module's package."""
    package = module if is_package else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in known else target)
    return {m for m in out if m in known and m != module}


def import_graph(root: Path = REPO) -> dict[str, set[str]]:
    mods = modules(root)
    known = set(mods)
    return {m: imported(p.read_text(encoding="utf-8"), m, p.name == "__init__.py", known) for m, p in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a -> ... -> a) through each group of modules that import one another, shortest first found."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for group in groups:
        start = min(group)
        paths = {start: [start]}
        frontier = [start]
        while frontier and start not in {w for v in frontier for w in graph[v]}:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & group):
                    if w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
            frontier = nxt
        last = next(v for v in frontier if start in graph[v])
        out.append(paths[last] + [start])
    return out


def violations(graph: dict[str, set[str]]) -> list[str]:
    def under(name: str, prefix: str) -> bool:
        return name == prefix or name.startswith(prefix + ".")

    return [
        f"{m} imports {t}"
        for m, targets in sorted(graph.items())
        for t in sorted(targets)
        for layer, banned in FORBIDDEN
        if under(m, layer) and any(under(t, b) for b in banned)
    ]


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_layers_point_one_way():
    found = violations(import_graph())
    assert not found, "imports against the layers:\n" + "\n".join(found)


def test_the_graph_sees_every_kind_of_import():
    """Function-level, TYPE_CHECKING and relative imports are edges; a name imported from a module is an edge to it."""
    known = {
        "benchctl.stages",
        "benchctl.stages.train",
        "benchctl.stages.train.engine",
        "benchctl.stages.train.sweep",
        "benchctl.core.db",
        "benchctl.core",
        "benchctl.study",
    }
    src = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from benchctl.study import X\n"
        "def f():\n    from . import engine\n    from ..train.sweep import train_all\n"
        "    import benchctl.core.db\n"
    )
    assert imported(src, "benchctl.stages.train.cost", False, known) == {
        "benchctl.study",
        "benchctl.stages.train.engine",
        "benchctl.stages.train.sweep",
        "benchctl.core.db",
    }
    assert imported("from .train import engine\n", "benchctl.stages", True, known) == {"benchctl.stages.train.engine"}


@pytest.mark.parametrize(
    "graph, cycle",
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, ["a", "b", "c", "a"]),
        ({"a": {"b", "c"}, "b": set(), "c": {"d"}, "d": set()}, None),
    ],
)
def test_cycles_are_found_and_named(graph, cycle):
    assert cycles(graph) == ([cycle] if cycle else [])


def test_a_layer_violation_is_named():
    graph = {
        "benchctl.core.data": {"benchctl.stages.train.engine", "benchctl.core.config"},
        "benchctl.stages.sample.stage": {"benchctl.stages", "benchctl.study"},
        "architectures.base": {"benchctl.core.config"},
    }
    assert violations(graph) == [
        "architectures.base imports benchctl.core.config",
        "benchctl.core.data imports benchctl.stages.train.engine",
        "benchctl.stages.sample.stage imports benchctl.study",
    ]


# The framework picks the stages up from their registry: it may import the registry (benchctl.stages) and the
# command lines' shared pieces (benchctl.stages.cli), never one stage's modules, so adding a stage is one new folder.
FRAMEWORK = ("benchctl.study", "benchctl.cli", "benchctl.browse", "benchctl.report")
STAGE_MODULES_ALLOWED = ("benchctl.stages", "benchctl.stages.cli")


def stage_imports(graph: dict[str, set[str]]) -> list[str]:
    def under(name: str, prefix: str) -> bool:
        return name == prefix or name.startswith(prefix + ".")

    return [
        f"{m} imports {t}"
        for m, targets in sorted(graph.items())
        if any(under(m, f) for f in FRAMEWORK)
        for t in sorted(targets)
        if under(t, "benchctl.stages") and t not in STAGE_MODULES_ALLOWED
    ]


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_the_framework_imports_no_stage():
    found = stage_imports(import_graph())
    assert not found, "the framework imports a stage's module:\n" + "\n".join(found)


def test_a_framework_import_of_a_stage_is_named():
    graph = {
        "benchctl.browse": {"benchctl.stages", "benchctl.stages.judge.tables"},
        "benchctl.report.frames": {"benchctl.stages.cli", "benchctl.core.stats"},
        "benchctl.stages.report.summary": {"benchctl.stages.judge.frames"},
    }
    assert stage_imports(graph) == ["benchctl.browse imports benchctl.stages.judge.tables"]


def test_browse_names_no_stage_table_in_its_sql_or_code():
    """Canned queries belong to the stages that own their tables: browse.py's SQL and identifiers name none of them
    (what makes a file a results database is its marker, checked by benchctl.core.db)."""
    from benchctl import stages

    tree = ast.parse((REPO / "benchctl" / "browse.py").read_text(encoding="utf-8"))
    tables = {t.name for t in stages.tables()}
    sql = [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and "select " in n.value.lower()
    ]
    names = (
        {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        | {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        | {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    )
    words = {w for text in sql for w in text.replace(",", " ").replace("(", " ").replace(")", " ").split()}
    assert not (words | names) & tables, sorted((words | names) & tables)


HEAVY = ("torch", "pandas", "architectures", "lm_eval", "datasets", "matplotlib", "google.genai")


def _heavy_after(argv_lists: list[list[str]]) -> dict[str, list[str]]:
    """In a fresh interpreter, run `benchctl ARGS` for each list in turn; the heavy modules loaded after each."""
    script = textwrap.dedent(f"""
        import json, sys
        from benchctl.cli import main
        seen = {{}}
        for argv in {argv_lists!r}:
            try:
                main(argv)
            except SystemExit as e:
                assert not e.code, (argv, e.code)
            seen[" ".join(argv)] = [m for m in {HEAVY!r} if m in sys.modules]
        print("HEAVY=" + json.dumps(seen))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.rsplit("HEAVY=", 1)[1])


def _command_paths() -> list[list[str]]:
    """Every command and subcommand of the root (`plans show` as well as `plans`)."""
    import typer.main

    from benchctl.cli import app

    def walk(group, prefix):
        for name, cmd in sorted(group.commands.items()):
            yield [*prefix, name]
            if hasattr(cmd, "commands"):
                yield from walk(cmd, [*prefix, name])

    return list(walk(typer.main.get_command(app), []))


def test_help_of_every_command_loads_no_torch_or_pandas():
    """`benchctl lm-eval --help` is lm-eval's own help (every argument goes to lm-eval), which loads lm-eval."""
    paths = [p for p in _command_paths() if p != ["lm-eval"]]
    assert {"train", "study", "sample", "plans", "report"} <= {p[0] for p in paths}
    seen = _heavy_after([["--help"]] + [[*p, "--help"] for p in paths])
    assert seen == {k: [] for k in seen}, {k: v for k, v in seen.items() if v}


def test_listing_the_plans_loads_no_torch_or_pandas():
    assert _heavy_after([["plans"]]) == {"plans": []}


@pytest.mark.slow  # a benchctl process importing torch
def test_the_check_sees_a_heavy_import():
    """`benchctl params` builds models: the same check finds torch there, so the empty lists above mean something."""
    argv = ["params", "--preset", "tiny", "--arch", "control", "--json"]
    assert "torch" in _heavy_after([argv])[" ".join(argv)]

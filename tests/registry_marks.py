"""Which tests read a registry: the `registry` mark, applied by tests/conftest.py at collection.

CI runs the suite a second time with the extension guides' examples (two architectures, a stage, a task) written
into the tree, and that pass runs only the tests the examples can change. A test's outcome depends on which files the
registries found when the test itself lists a registry: it is parametrised over `architectures.names()`, it loops
over `stages.registered()`, it compares a command's output with `tasks.names()`. Such tests are found here by
reading each test module's syntax tree, so a new test that lists a registry is selected with no mark to remember:

- a *registry reference* is a use of one of `LISTERS` (`architectures.names`, `stages.tables`, ...), however the
  module was imported (`import architectures`, `from benchctl import stages`, `from tasks import names`, an alias);
- a module-level name (constant, helper function, fixture) is *registry-bound* when its definition holds a registry
  reference or uses another registry-bound name (`NAMES = architectures.names()`, then `ALL = [... for a in NAMES]`),
  a name imported from another test module (`from tests.test_architectures import NAMES`) included;
- a test is marked when its function (decorators and body) or one of the fixtures it requests is registry-bound.

What this reading cannot see is product code that lists a registry on the test's behalf (`benchctl --help` lists the
stages' commands, the report renders every stage's sections, the import-layout check walks every file). Such tests
carry `@pytest.mark.registry` by hand, with a comment saying which registry they reach.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# The functions that list a registry's contents, by the module that defines them (tests/test_registry_marks.py checks
# that every public function of these modules that reads its registry is named here).
LISTERS: dict[str, frozenset[str]] = {
    "architectures": frozenset({"names", "_REGISTRY"}),
    "tasks": frozenset({"names", "_REGISTRY"}),
    "benchctl.stages": frozenset(
        {"registered", "names", "skippable", "figure_names", "tables", "canned_queries", "weights_read_after"}
    ),
    "benchctl.stages.report.engine": frozenset({"figure_names"}),
}


def _dotted(node: ast.AST) -> list[str] | None:
    """`a.b.c` as ['a', 'b', 'c'], or None for anything that is not a plain name or attribute chain."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _is_lister(path: str) -> bool:
    module, _, attr = path.rpartition(".")
    return attr in LISTERS.get(module, frozenset())


class _Module:
    """One test module's imports and module-level definitions, and which of them are registry-bound."""

    def __init__(self, path: Path):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        # local name -> the dotted paths it may stand for (imports inside functions count too: a name bound to two
        # things in two places may be either, and either reading a registry is enough)
        self.aliases: dict[str, set[str]] = {}
        # local name -> (test module, name in it), for names imported from a sibling test module
        self.siblings: dict[str, tuple[str, str]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.aliases.setdefault(a.asname, set()).add(a.name)
                    else:  # `import benchctl.stages` binds `benchctl`; the attribute chain spells the rest
                        top = a.name.split(".")[0]
                        self.aliases.setdefault(top, set()).add(top)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    local = a.asname or a.name
                    self.aliases.setdefault(local, set()).add(f"{node.module}.{a.name}")
                    sibling = node.module.removeprefix("tests.")
                    if "." not in sibling and (TESTS / f"{sibling}.py").is_file():
                        self.siblings[local] = (sibling, a.name)
        self.defs: dict[str, list[ast.AST]] = {}
        for stmt in tree.body:
            for name in _bound_names(stmt):
                self.defs.setdefault(name, []).append(stmt)
        self._bound: set[str] | None = None

    def references_registry(self, node: ast.AST) -> bool:
        for sub in ast.walk(node):
            parts = _dotted(sub) if isinstance(sub, (ast.Attribute, ast.Name)) else None
            if not parts:
                continue
            for base in self.aliases.get(parts[0], ()):
                full = ".".join([base, *parts[1:]])
                # any prefix of the chain may be the lister (`architectures._REGISTRY.pop` reads `_REGISTRY`)
                chain = full.split(".")
                if any(_is_lister(".".join(chain[:i])) for i in range(2, len(chain) + 1)):
                    return True
        return False

    def bound(self) -> set[str]:
        """The module-level names whose definitions reach a registry, directly or through each other."""
        if self._bound is not None:
            return self._bound
        self._bound = set()  # a cycle between sibling modules ends here
        bound = {
            name
            for name, stmts in self.defs.items()
            if any(self.references_registry(s) for s in stmts) or self._sibling_bound(name)
        }
        bound |= {name for name in self.siblings if self._sibling_bound(name)}
        changed = True
        while changed:
            changed = False
            for name, stmts in self.defs.items():
                if name not in bound and any(_uses(s, bound) for s in stmts):
                    bound.add(name)
                    changed = True
        self._bound = bound
        return bound

    def _sibling_bound(self, name: str) -> bool:
        if name not in self.siblings:
            return False
        module, attr = self.siblings[name]
        return attr in _module(TESTS / f"{module}.py").bound()


def _bound_names(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [stmt.name]
    targets: list[ast.expr] = []
    if isinstance(stmt, ast.Assign):
        targets = stmt.targets
    elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        targets = [stmt.target]
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


def _uses(node: ast.AST, names: set[str]) -> bool:
    return any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(node))


@functools.cache
def _module(path: Path) -> _Module:
    return _Module(path)


def reads_registry(path: Path, function: str, fixtures: list[str]) -> bool:
    """Whether the test `function` of the module at `path`, or one of the `fixtures` it requests (defined in that
    module or in tests/conftest.py), lists a registry."""
    mod = _module(Path(path).resolve())
    conftest = _module(TESTS / "conftest.py")
    names = {function, *fixtures}
    return bool(names & mod.bound()) or bool(set(fixtures) & conftest.bound())


def reads_registry_beyond_parameters(path: Path, function: str, fixtures: list[str], argnames: list[str]) -> bool:
    """Whether the test `function` lists a registry other than through its own `@pytest.mark.parametrize`
    arguments `argnames`: in its body, or through a fixture it requests (a fixture parametrised over a registry
    counts: its own code may list more). A test that lists a registry only in its parameters runs the same code for
    a parameter whatever else is registered, so CI's pass with the examples needs only the new parameters' cases."""
    mod = _module(Path(path).resolve())
    conftest = _module(TESTS / "conftest.py")
    bound = mod.bound()
    defs = [d for d in mod.defs.get(function, []) if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if len(defs) != 1:
        return True  # not a plain module-level test function: assume the worst
    body = ast.Module(body=defs[0].body, type_ignores=[])
    args = ast.Module(
        body=[ast.Expr(a) for a in [*defs[0].args.defaults, *defs[0].args.kw_defaults] if a], type_ignores=[]
    )
    if any(mod.references_registry(n) or _uses(n, bound - {function}) for n in (body, args)):
        return True
    requested = set(fixtures) - set(argnames)
    return bool(requested & bound) or bool(requested & conftest.bound())

"""The `registry` mark (tests/registry_marks.py): which tests CI's pass with the extension examples reruns.

A test left unmarked that reads a registry would not run with the examples present, so the reading of the syntax
tree is checked on every way a test reaches a registry, and the list of registry-listing functions is checked
against the registries' own modules.
"""

from __future__ import annotations

import ast
import importlib
import textwrap
from pathlib import Path

import pytest
from registry_marks import LISTERS, TESTS, reads_registry, reads_registry_beyond_parameters

# The functions of the registry modules that read the registry but do not list it: they look one entry up by name,
# or (connect) are how every test opens a database; a test whose outcome depends on the set of tables lists them
# with stages.tables() itself.
LOOKUPS = {
    "architectures": {"register", "get", "UnknownArchitectureError"},
    "tasks": {"register", "_unregister", "get", "UnknownTaskError"},
    "benchctl.stages": {"connect"},
    "benchctl.stages.report.engine": {"_save"},
}


@pytest.mark.parametrize("module", sorted(LISTERS))
def test_every_function_that_reads_a_registry_is_known(module):
    """A new function of a registry module that lists the registry must join LISTERS (or LOOKUPS, when it reads
    one entry): otherwise the tests calling it would go unmarked."""
    mod = importlib.import_module(module)
    tree = ast.parse(Path(mod.__file__).read_text(encoding="utf-8"))
    readers = set()
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for sub in ast.walk(node):
            called = sub.func if isinstance(sub, ast.Call) else None
            name = (
                called.id
                if isinstance(called, ast.Name)
                else called.attr
                if isinstance(called, ast.Attribute) and isinstance(called.value, ast.Name)
                else None
            )
            if (isinstance(sub, ast.Name) and sub.id == "_REGISTRY") or (
                name in LISTERS[module] and (isinstance(called, ast.Name) or called.value.id == "stages")
            ):
                readers.add(node.name)
    assert readers - LISTERS[module] - LOOKUPS[module] == set()
    assert all(hasattr(mod, name) for name in LISTERS[module] | LOOKUPS[module])


def _module(tmp_path: Path, source: str) -> Path:
    path = tmp_path / "test_sample.py"
    path.write_text(textwrap.dedent(source))
    return path


SAMPLE = """
    import pytest
    import architectures
    import architectures as zoo
    from benchctl import stages
    from benchctl.stages.report import engine as report_engine
    from tasks import names as task_names
    from test_architectures import NAMES
    from fixtures_db import STUDY_ARCHS, build_fixture_db

    ITERABLE = [a for a in zoo.names() if zoo.get(a).iterable()]
    PAIRS = [(a, b) for a in ITERABLE for b in (1, 2)]
    FIXED = ["control", "frailt"]


    def helper():
        return {s.name for s in stages.registered()}


    @pytest.fixture
    def skips():
        return stages.skippable()


    @pytest.mark.parametrize("arch", architectures.names())
    def test_parametrised(arch): ...


    @pytest.mark.parametrize("arch, n", PAIRS)
    def test_derived(arch, n): ...


    def test_helper():
        assert helper()


    def test_fixture(skips): ...


    def test_inside():
        from benchctl import stages as st

        for t in st.tables():
            pass


    def test_figures():
        assert report_engine.figure_names()


    def test_tasks():
        assert task_names()


    def test_sibling():
        assert NAMES


    def test_registry_dict():
        architectures._REGISTRY.pop("x", None)


    def test_deep_chain():
        import benchctl.stages

        benchctl.stages.names()


    @pytest.mark.parametrize("arch", FIXED)
    def test_fixed(arch):
        architectures.build(arch, None)


    def test_fixture_db(tmp_path):
        build_fixture_db(tmp_path / "r.db", archs=STUDY_ARCHS)
        stages.connect(tmp_path / "r.db")


    @pytest.mark.parametrize("arch", architectures.names())
    def test_parametrised_and_listing(arch):
        assert arch in architectures.names()


    @pytest.mark.parametrize("arch", architectures.names())
    def test_parametrised_with_a_listing_fixture(arch, skips): ...
    """


@pytest.mark.parametrize(
    "test, fixtures",
    [
        ("test_parametrised", []),
        ("test_derived", []),
        ("test_helper", []),
        ("test_fixture", ["skips"]),
        ("test_inside", []),
        ("test_figures", []),
        ("test_tasks", []),
        ("test_sibling", []),
        ("test_registry_dict", []),
        ("test_deep_chain", []),
    ],
)
def test_a_test_that_lists_a_registry_is_marked(tmp_path, test, fixtures):
    assert reads_registry(_module(tmp_path, SAMPLE), test, fixtures)


@pytest.mark.parametrize("test", ["test_fixed", "test_fixture_db"])
def test_a_test_of_fixed_names_is_not(tmp_path, test):
    assert not reads_registry(_module(tmp_path, SAMPLE), test, ["tmp_path"])


def test_the_suite_marks_its_registry_tests():
    """Spot checks on the real suite: the per-architecture and per-task tests, a loop over the stages inside a
    test, and tests of fixed architectures left out."""
    for module, test in [
        ("test_architectures", "test_causality"),
        ("test_generate_fast", "test_greedy_decode_path_equals_reference"),
        ("test_tasks", "test_score"),
        ("test_study", "test_study_end_to_end_on_tiny_data"),
        ("test_tables", "test_every_table_and_column_is_described"),
    ]:
        assert reads_registry(TESTS / f"{module}.py", test, []), (module, test)
    for module, test in [
        ("test_generate_fast", "test_compiled_decode_path_equals_reference"),
        ("test_integrity", "test_a_checkpoint_of_another_run_is_refused_with_exit_4"),
    ]:
        assert not reads_registry(TESTS / f"{module}.py", test, []), (module, test)


@pytest.mark.parametrize(
    "test, fixtures, argnames, beyond",
    [
        ("test_parametrised", ["arch"], ["arch"], False),  # a name's case runs the same code whatever else exists
        ("test_derived", ["arch", "n"], ["arch", "n"], False),
        ("test_parametrised_and_listing", ["arch"], ["arch"], True),  # its body lists the registry too
        ("test_parametrised_with_a_listing_fixture", ["arch", "skips"], ["arch"], True),
        ("test_helper", [], [], True),
    ],
)
def test_which_cases_ci_reruns_with_the_examples(tmp_path, test, fixtures, argnames, beyond):
    """CI's second pass leaves out a registry name's case that ran in the first pass only when the test lists the
    registry in its parametrize arguments alone."""
    assert reads_registry_beyond_parameters(_module(tmp_path, SAMPLE), test, fixtures, argnames) is beyond


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_the_second_pass_runs_the_new_names_cases_and_the_listing_tests(tmp_path):
    """The conftest hook with $BENCHCTL_TESTS_NAMES_BEFORE: in a pytest run over the sample module with one
    architecture named as existing before, that architecture's parametrised case is left out, every other
    architecture's case and every test that lists a registry itself stays."""
    import json
    import os
    import subprocess
    import sys

    import architectures

    before = architectures.names()[0]
    module = _module(tmp_path, SAMPLE.replace("from test_architectures import NAMES", "NAMES = []"))
    (tmp_path / "conftest.py").write_text(
        "import importlib.util, sys\n"
        f"sys.path.insert(0, {str(TESTS)!r})\n"
        f"spec = importlib.util.spec_from_file_location('suite_conftest', {str(TESTS / 'conftest.py')!r})\n"
        "suite = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(suite)\n"
        "pytest_collection_modifyitems = suite.pytest_collection_modifyitems\n"
    )
    env = {**os.environ, "BENCHCTL_TESTS_NAMES_BEFORE": json.dumps([before])}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-m",
            "registry",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "-o",
            "addopts=",
            "--rootdir",
            str(tmp_path),
            str(module),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    ids = {line.split("::", 1)[1] for line in out.stdout.splitlines() if "::" in line}
    assert f"test_parametrised[{before}]" not in ids, out.stdout + out.stderr
    assert f"test_parametrised_and_listing[{before}]" in ids
    assert f"test_parametrised_with_a_listing_fixture[{before}]" in ids
    others = architectures.names()[1:]
    assert all(f"test_parametrised[{a}]" in ids for a in others)
    assert "test_helper" in ids

"""The extension guides' examples (docs/extending.md, and the task in docs/tasks.md) are complete files that CI writes
into the tree before running the suite a second time: check here, in the fast loop, that they are well-formed and
new."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "extending.md"

# With the examples written into the tree, their markers must still read as new files.
pytestmark = pytest.mark.registry


def _extractor():
    spec = importlib.util.spec_from_file_location("extract_examples", ROOT / ".ci" / "extract_examples.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_guide_holds_its_architectures_and_a_whole_stage():
    files = _extractor().examples(DOC.read_text(encoding="utf-8"))
    assert "architectures/gated_loop.py" in files
    assert "architectures/settling_loop.py" in files  # the adaptive-computation example
    stage_dirs = {Path(p).parent for p in files if p.startswith("benchctl/stages/")}
    assert len(stage_dirs) == 1
    roles = {Path(p).name for p in files if p.startswith("benchctl/stages/")}
    assert roles == {"__init__.py", "options.py", "tables.py", "engine.py", "cli.py", "report.py", "stage.py"}
    for path, text in files.items():
        ast.parse(text, filename=path)
        real = ROOT / path
        # absent, or present only because CI extracted this very example
        assert not real.exists() or real.read_text(encoding="utf-8") == text, f"{path} exists and differs"


def test_the_tasks_page_holds_a_whole_task():
    files = _extractor().examples((ROOT / "docs" / "tasks.md").read_text(encoding="utf-8"))
    assert list(files) == ["tasks/sort_digits.py"]
    for path, text in files.items():
        ast.parse(text, filename=path)
        real = ROOT / path
        assert not real.exists() or real.read_text(encoding="utf-8") == text, f"{path} exists and differs"


@pytest.mark.parametrize(
    "doc, needle",
    [
        ("<!-- example-file: a.py -->\ntext", "must stand right above a fenced code block"),
        ("<!-- example-file: a.py -->\n```python\nx = 1\n", "is not closed"),
        ("<!-- example-file: a.py -->\n```\n```\n<!-- example-file: a.py -->\n```\n```\n", "marked twice"),
    ],
)
def test_malformed_markers_are_refused(doc, needle):
    with pytest.raises(SystemExit, match=needle):
        _extractor().examples(doc)

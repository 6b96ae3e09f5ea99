"""The version is written in one place, `benchctl.__version__`: the package metadata, `benchctl --version` and the
environment every run stores all read it from there."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import torch

import benchctl
from benchctl.cli import main
from benchctl.core import telemetry

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the backport benchctl depends on before 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_takes_the_version_from_the_package():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "benchctl.__version__"}


def test_installed_metadata_cli_and_stored_environment_agree(capsys):
    assert importlib.metadata.version("benchctl") == benchctl.__version__, (
        "the installed metadata is stale: reinstall with pip install -e ."
    )
    try:
        main(["--version"])
    except SystemExit as e:
        assert not e.code
    assert capsys.readouterr().out.strip() == f"benchctl {benchctl.__version__}"
    assert telemetry.environment(torch.device("cpu"))["benchctl_version"] == benchctl.__version__

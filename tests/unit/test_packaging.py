"""The installed kvsidecar distribution is the one providing the imported packages."""

from __future__ import annotations

import importlib
import importlib.metadata
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("pipeline", "stages", "transport")


@pytest.mark.parametrize("name", PACKAGES)
def test_package_comes_from_the_kvsidecar_distribution(name: str) -> None:
    """The kvsidecar distribution declares the top-level package the interpreter imports."""
    assert "kvsidecar" in importlib.metadata.packages_distributions().get(name, [])
    top_level = importlib.metadata.distribution("kvsidecar").read_text("top_level.txt")
    assert top_level is None or name in top_level.split()


@pytest.mark.parametrize("name", PACKAGES)
def test_imported_package_lives_in_this_repository(name: str) -> None:
    """The generic package name resolves to this repository's folder, not a same-named one."""
    module = importlib.import_module(name)
    assert module.__file__ is not None
    assert Path(module.__file__).resolve().parent == REPO / name


@pytest.mark.parametrize("name", PACKAGES)
def test_package_is_typed(name: str) -> None:
    """Each package ships a py.typed marker."""
    module = importlib.import_module(name)
    assert module.__file__ is not None
    assert (Path(module.__file__).parent / "py.typed").is_file()


def test_every_package_folder_is_declared() -> None:
    """Each folder of the three packages holding an ``__init__.py`` is in pyproject's
    explicit package list, so a built wheel carries every layer."""
    declared = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"
    ])
    on_disk = {
        ".".join(init.parent.relative_to(REPO).parts)
        for name in PACKAGES
        for init in (REPO / name).rglob("__init__.py")
    }
    assert on_disk == declared


def test_ci_runs_the_readme_test_command() -> None:
    """CI runs exactly the set-up and test command the README gives a user."""
    readme = (REPO / "README.md").read_text()
    commands = [line for line in readme.splitlines()
                if line.startswith("apt-get update") and "pytest" in line]
    assert len(commands) == 1
    assert commands[0] in (REPO / ".ci" / "run").read_text().splitlines()

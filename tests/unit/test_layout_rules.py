"""Rooms that say what they hold: no module of the three packages past 400 lines, and a
README short enough to read."""

from __future__ import annotations

from pathlib import Path

import msgspec

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("pipeline", "stages", "transport")
MAX_MODULE_LINES = 400


def test_no_module_is_over_400_lines() -> None:
    long = {
        str(path.relative_to(REPO)): lines
        for package in PACKAGES
        for path in (REPO / package).rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_the_readme_is_at_most_150_lines_and_links_only_pages_that_exist() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    for page in (part.split(")")[0] for part in readme.split("](docs/")[1:]):
        assert (REPO / "docs" / page).is_file(), page


def test_every_page_of_the_manual_is_in_its_nav() -> None:
    nav = msgspec.yaml.decode((REPO / "mkdocs.yml").read_bytes())["nav"]
    listed = {page for entry in nav for page in entry.values()}
    on_disk = {path.name for path in (REPO / "docs").glob("*.md")}
    assert listed == on_disk

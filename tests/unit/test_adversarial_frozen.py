"""The adversarial tests of the hostile-input, trust-boundary and request-lifetime work
stay as they were written.

`tests/adversarial.lock` pins each of those tests: a whole file by the SHA-256 of its
bytes, a single test by the SHA-256 of its syntax tree (`ast.dump`, decorators
included), so imports and neighbours in a mixed file may change while the test itself
may not. A rewrite of the code under them must keep them passing unmodified; a
changed fingerprint here means a pinned test was edited, and the lock is not the thing
to change.
"""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "tests" / "adversarial.lock"


def fingerprint(path: Path, name: str | None) -> str:
    """The SHA-256 of a file's bytes, or of the syntax tree of one of its functions."""
    if name is None:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    tree = ast.parse(path.read_text())
    found = [
        node
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name
    ]
    assert len(found) == 1, f"{path.name}: {len(found)} functions named {name}"
    return hashlib.sha256(ast.dump(found[0]).encode()).hexdigest()


def pinned() -> list[tuple[str, str]]:
    """(expected digest, `path` or `path::function`) for each line of the lock."""
    lines = LOCK.read_text().splitlines()
    return [
        (line.split()[0], line.split()[1]) for line in lines if line and not line.startswith("#")
    ]


def _split(target: str) -> tuple[Path, str | None]:
    path, _, name = target.partition("::")
    return ROOT / path, name or None


def test_the_lock_pins_whole_files_and_single_tests() -> None:
    """The lock names at least the three issues' whole files and their mixed-file tests."""
    targets = [target for _, target in pinned()]
    assert "tests/integration/test_hostile_peers.py" in targets
    assert "tests/integration/test_trust_boundary.py" in targets
    assert "tests/integration/test_request_lifetimes.py" in targets
    assert any("::" in target for target in targets)


@pytest.mark.parametrize(("digest", "target"), pinned(), ids=[t for _, t in pinned()])
def test_a_pinned_adversarial_test_is_unmodified(digest: str, target: str) -> None:
    """Each pinned file or test has the fingerprint it had when the lock was written."""
    path, name = _split(target)
    assert fingerprint(path, name) == digest, f"{target} was modified"


def test_an_edit_to_a_pinned_test_changes_its_fingerprint(tmp_path: Path) -> None:
    """The fingerprint sees a changed body but not a changed import above it."""
    source = "import os\n\ndef test_x() -> None:\n    assert 1 == 1\n"
    path = tmp_path / "t.py"
    path.write_text(source)
    before = fingerprint(path, "test_x")
    path.write_text(source.replace("import os", "import sys"))
    assert fingerprint(path, "test_x") == before
    path.write_text(source.replace("1 == 1", "1 == 2"))
    assert fingerprint(path, "test_x") != before

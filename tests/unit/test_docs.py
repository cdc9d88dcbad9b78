"""The manual builds with mkdocs, warnings counted as errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_docs_build_strict(tmp_path: Path) -> None:
    """`mkdocs build --strict` succeeds and the site carries the security model page."""
    # The venv's mkdocs, beside its interpreter: not whichever one is first on PATH.
    mkdocs = Path(sys.executable).parent / "mkdocs"
    result = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's end-of-life banner
    )
    assert result.returncode == 0, result.stderr
    page = (tmp_path / "security" / "index.html").read_text(encoding="utf-8")
    assert "membership oracle" in page

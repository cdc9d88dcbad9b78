"""A sidecar started through the launcher reads its config file as ``kvsidecar serve``
does: an old file's keys migrate, and a contradiction in it is refused naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.core.config import ConfigError
from pipeline.testing import run_sidecar_process


def test_an_old_config_file_starts_a_sidecar_with_its_meaning(tmp_path: Path) -> None:
    old = tmp_path / "old.yaml"
    old.write_text("stages:\n  receive: {overflow: block, max_saves_per_engine: 3}\n"
                   "  completion: {inbox_size: 256, workers: 1}\n"
                   "metrics: {host: 127.0.0.1, port: 0}\n")
    with run_sidecar_process(config=old, metrics=True) as sidecar:
        samples = {sample.name for sample in sidecar.metrics()}
    assert "kvsidecar_open_jobs" in samples


def test_a_contradiction_in_the_file_is_refused_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages: {receive: {overflow: block}, transfer: {overflow: skip}}\n")
    with pytest.raises(ConfigError) as refused:
        with run_sidecar_process(config=bad):
            pass
    assert str(bad) in str(refused.value)
    assert "stages.transfer.overflow" in str(refused.value)

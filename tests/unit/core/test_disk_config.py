"""The disk tier's keys: three for an operator, the rest derived, refused with Mooncake."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.core.config import ConfigError, Machine, read_config

GiB = 1 << 30
MiB = 1 << 20
MACHINE = Machine(cpus=2, memory_bytes=24 * GiB)


def loaded(tmp_path: Path, text: str):  # type: ignore[no-untyped-def]
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return read_config(path, machine=MACHINE).config


def test_disk_with_mooncake_is_refused_naming_both_keys(tmp_path: Path) -> None:
    """Mooncake keeps its own SSD offload: store.disk beside it is a contradiction."""
    with pytest.raises(ConfigError, match=r"store\.disk.*store\.backend"):
        loaded(tmp_path, "store:\n  backend: mooncake\n  disk:\n    path: /tmp/x\n")


def test_the_tier_is_off_unless_a_path_is_given(tmp_path: Path) -> None:
    assert loaded(tmp_path, "store:\n  backend: embedded\n").store.disk.path == ""


@pytest.mark.parametrize(("budget", "capacity", "segment", "queued"), [
    (64 * MiB, 64 * MiB, 8 * MiB, 8 * MiB),
    (GiB, GiB, 128 * MiB, 128 * MiB),
    (64 * GiB, 8 * GiB, 256 * MiB, 256 * MiB),
])
def test_segments_and_the_queue_follow_the_budget_and_memory(
        tmp_path: Path, budget: int, capacity: int, segment: int, queued: int) -> None:
    """Segments are an eighth of the budget within [8, 256] MiB; the write queue an
    eighth of the memory tier within [8, 256] MiB."""
    disk = loaded(tmp_path, f"store:\n  capacity_bytes: {capacity}\n  disk:\n"
                            f"    path: /tmp/x\n    bytes: {budget}\n").store.disk
    assert (disk.segment_bytes, disk.max_queued_bytes) == (segment, queued)
    assert disk.bytes // disk.segment_bytes >= 2


def test_a_budget_under_64_mib_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"store\.disk\.bytes"):
        loaded(tmp_path, "store:\n  disk:\n    path: /tmp/x\n    bytes: 1000\n")

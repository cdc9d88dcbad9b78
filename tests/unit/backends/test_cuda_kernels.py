"""The GPU kernels in Triton's interpreter, on this machine's CPU: the device checksums
are xxh3's (``xxhash``, as the host seals) byte for byte, a flipped byte fails only its
row, and the page kernel copies a batch's pages and holds back a load's failed rows.
The GPU tests run the same kernels compiled, on a device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash

from pipeline.core.integrity import CHECKSUM_BYTES
from tests.kit import DIGEST_CASES

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[3]


def interpret(cases: dict[str, object], tmp_path: Path) -> dict[str, object]:
    source, target = tmp_path / "cases.pt", tmp_path / "made.pt"
    torch.save(cases, source)
    subprocess.run(
        [sys.executable, "-m", "tests.unit.backends.interpreted_kernels", source, target],
        cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"}, check=True, timeout=240)
    made: dict[str, object] = torch.load(target)
    return made


@pytest.fixture(scope="module")
def cases_and_made(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    generator = torch.Generator().manual_seed(11)
    digests = [
        {"rows": torch.randint(0, 256, (3, payload + CHECKSUM_BYTES + padding),
                               dtype=torch.uint8, generator=generator),
         "payload": payload, "seed": seed, "flip": (payload * 7) // 11}
        for payload, padding, seed in DIGEST_CASES
    ]
    segments = [torch.randint(0, 256, (6, size), dtype=torch.uint8, generator=generator)
                for size in (64, 40, 8)]
    pages = {"segments": segments, "ids": [4, 1, 5],
             "rows": torch.zeros((3, 128), dtype=torch.uint8),
             "ok": torch.tensor([1, 0, 1], dtype=torch.int8)}
    cases = {"digests": digests, "pages": pages}
    return cases, interpret(cases, tmp_path_factory.mktemp("kernels"))


def test_device_checksums_are_xxh3_seeded_as_the_host_seals(cases_and_made) -> None:
    cases, made = cases_and_made
    for case, result in zip(cases["digests"], made["digests"], strict=True):
        payload, sealed = case["payload"], result["sealed"]
        for row, before in zip(sealed, case["rows"], strict=True):
            want = xxhash.xxh3_64_intdigest(row[:payload].numpy().tobytes(), case["seed"])
            trailer = row[payload : payload + CHECKSUM_BYTES].numpy().tobytes()
            assert int.from_bytes(trailer, sys.byteorder) == want, (payload, case["seed"])
            assert torch.equal(row[:payload], before[:payload])
            assert torch.equal(row[payload + CHECKSUM_BYTES :],
                               before[payload + CHECKSUM_BYTES :])  # padding untouched
        assert result["ok"].tolist() == [1, 1, 1]
        assert result["ok_corrupted"].tolist() == [1, 0, 1]


def test_the_page_kernel_moves_pages_and_holds_back_failed_rows(cases_and_made) -> None:
    cases, made = cases_and_made
    pages, result = cases["pages"], made["pages"]
    for row, block in enumerate(pages["ids"]):
        expected = torch.cat([segment[block] for segment in pages["segments"]])
        assert torch.equal(result["gathered"][row, :112], expected)
    assert not result["gathered"][:, 112:].any()  # past the value: untouched
    for row, block in enumerate(pages["ids"]):
        now = torch.cat([segment[block] for segment in result["segments"]])
        before = torch.cat([segment[block] for segment in pages["segments"]])
        wanted = result["changed"][row, :112] if pages["ok"][row] else before
        assert torch.equal(now, wanted), (row, block)
    untouched = [block for block in range(6) if block not in pages["ids"]]
    for before, now in zip(pages["segments"], result["segments"], strict=True):
        assert torch.equal(before[untouched], now[untouched])


def kernel_builds() -> list[object]:
    """(kernel, argument types, constants, options) of every compile the sidecar asks for."""
    from pipeline.backends import cuda_digests, cuda_pages

    digests = {"rows": "*u8", "sums": "*i64", "keys": "*i64", "row_words": "i32",
               "blocks": "i32"}
    finish = {**digests, "ok": "*i8", "payload_words": "i32", "tail": "i32"}
    pages = {"table": "*i64", "ok": "*i8", "pages_at": "i32", "rows_at": "i32",
             "segments": "i32", "row_stride": "i32"}
    warps = {"num_warps": cuda_digests.WARPS}
    builds = [
        pytest.param("cuda_digests._block_sums", digests, {"BLOCKS": cuda_digests.BLOCKS},
                     warps, id="block_sums"),
        *[pytest.param("cuda_digests._finish", finish,
                       {"CHECK": check, "CHUNK": cuda_digests.CHUNK}, warps,
                       id=f"finish-{'check' if check else 'seal'}")
          for check in (False, True)],
    ]
    for word in ("*i64", "*i32", "*i16", "*u8"):
        for to_rows, checked, name in ((True, False, "gather"), (False, False, "scatter"),
                                       (False, True, "checked_scatter")):
            builds.append(pytest.param(
                "cuda_pages._copy_pages", {**pages, "rows": word},
                {"TO_ROWS": to_rows, "CHECKED": checked, "BLOCK": cuda_pages.BLOCK}, {},
                id=f"copy_pages-{name}-{word[1:]}"))
    return builds


@pytest.mark.parametrize(("kernel", "types", "constants", "options"), kernel_builds())
def test_the_kernels_compile_for_a_hopper_gpu(kernel: str, types: dict[str, str],
                                             constants: dict[str, object],
                                             options: dict[str, object]) -> None:
    """Each kernel, in each form the sidecar launches, compiles to a cubin for sm_90 on
    this machine (Triton carries its own ptxas): the interpreter runs Python, so what
    only the compiler refuses (a global that is not a constexpr, say) shows here."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget

    module, name = kernel.split(".")
    function = getattr(importlib.import_module(f"pipeline.backends.{module}"), name)
    signature = {arg: "constexpr" if arg in constants else types[arg]
                 for arg in function.arg_names}
    source = triton.compiler.ASTSource(fn=function, signature=signature,
                                       constexprs=constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert compiled.asm["cubin"]

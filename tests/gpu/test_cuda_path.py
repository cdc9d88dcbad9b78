"""The GPU path end to end: an engine's KV tensors in GPU memory, shared by CUDA IPC
handle with a real sidecar process that copies on CUDA streams. Marked ``gpu``; skipped
where torch sees no CUDA device (``benchmarks/gpu_check.sh`` runs them on a GPU host)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import anyio
import pytest
import torch

from pipeline.app.launcher import SidecarProcess, run_sidecar_process
from pipeline.core.layout import KVCacheLayout
from tests.kit import DIGEST_CASES, KVEngine, hybrid_layout, random_tokens
from transport.client import EngineClient

pytestmark = pytest.mark.gpu

TIMEOUT = 60.0
PAGE_BYTES = 64 * 1024
NUM_BLOCKS = 64
GPU_SIDECAR = {
    "stages": {"transfer": {"device": "cuda", "cuda_streams": 2}},
    "staging": {"pool_bytes": 256 << 20, "slot_bytes": 32 << 20},
    "store": {"embedded": {"capacity_bytes": 512 << 20}},
}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gpu_caches(layout: KVCacheLayout, *, kv_first: bool = False) -> dict[str, torch.Tensor]:
    """Random bf16 KV tensors on cuda:0, one per layer: blocks-first
    ``[blocks, page]`` or K/V-first ``[2, blocks, page / 2]`` (vLLM's attention)."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    caches = {}
    for group in layout.groups:
        elements = group.page_bytes // 2
        shape = (2, NUM_BLOCKS, elements // 2) if kv_first else (NUM_BLOCKS, elements)
        for layer in group.layers:
            caches[layer] = torch.randn(shape, generator=generator, device="cuda",
                                        dtype=torch.bfloat16)
    return caches


def block(tensor: torch.Tensor, block_id: int) -> torch.Tensor:
    """One block's bytes, as int16 (exact comparison; bf16 NaNs compare unequal)."""
    page = tensor[:, block_id] if tensor.dim() == 3 and tensor.shape[0] == 2 else tensor[block_id]
    return page.view(torch.int16)


@pytest.fixture
def gpu_sidecar() -> Iterator[SidecarProcess]:
    with run_sidecar_process(GPU_SIDECAR, startup_timeout_s=120) as sidecar:
        yield sidecar


@pytest.mark.parametrize("kv_first", [False, True], ids=["blocks_first", "kv_first"])
async def test_gpu_blocks_are_saved_and_loaded_byte_exact(
    gpu_sidecar: SidecarProcess, kv_first: bool
) -> None:
    """Blocks saved from GPU tensors come back byte for byte into other GPU blocks; the
    ring's layers are never touched."""
    layout = KVCacheLayout.from_dict(hybrid_layout(page_bytes=PAGE_BYTES))
    caches = gpu_caches(layout, kv_first=kv_first)
    ring = {layer: caches[layer].clone() for layer in layout.groups[1].layers}
    tokens = random_tokens(4 * 16, seed=1)
    with anyio.fail_after(TIMEOUT):
        async with await EngineClient.connect(gpu_sidecar.endpoint, layout=layout,
                                              kv_caches=caches) as client:
            saved = await client.save("r", tokens, [[1, 2, 3, 4], [5], [1, 2, 3, 4]])
            assert saved.stored == 8 and saved.failed == 0
            loaded = await client.load("r", tokens, [[11, 12, 13, 14], [15], [21, 22, 23, 24]],
                                       64)
            assert loaded.loaded_tokens == 64
    for layer in layout.groups[0].layers:
        for source, target in zip((1, 2, 3, 4), (11, 12, 13, 14), strict=True):
            assert torch.equal(block(caches[layer], source), block(caches[layer], target))
    for layer in layout.groups[2].layers:  # mamba, align mode: the last block's state
        assert torch.equal(block(caches[layer], 4), block(caches[layer], 24))
    for layer, before in ring.items():
        assert torch.equal(caches[layer], before)
    # The engine's kernels were compiled off the event loop as it registered.
    log = gpu_sidecar.wait_log(lambda log: "cuda.kernels." in log, timeout_s=TIMEOUT)
    assert "cuda.kernels.compiled" in log and "cuda.kernels.failed" not in log


async def test_a_save_waits_for_the_forward_that_wrote_the_blocks(
    gpu_sidecar: SidecarProcess,
) -> None:
    """KV written by work still queued on the engine's stream when the save is asked
    for is saved as written: the sidecar's copy waits on the engine's step event."""
    layout = KVCacheLayout.from_dict(hybrid_layout(page_bytes=PAGE_BYTES))
    caches = gpu_caches(layout)
    tokens = random_tokens(4 * 16, seed=2)
    with anyio.fail_after(TIMEOUT):
        async with await EngineClient.connect(gpu_sidecar.endpoint, layout=layout,
                                              kv_caches=caches) as client:
            for tensor in caches.values():
                tensor[1:5].zero_()
            torch.cuda.synchronize()
            torch.cuda._sleep(2_000_000_000)  # ~1 s of spinning ahead of the writes
            for tensor in caches.values():
                tensor[1:5].fill_(7.0)
            saved = await client.save("r", tokens, [[1, 2, 3, 4], [5], [1, 2, 3, 4]])
            assert saved.stored == 8
            loaded = await client.load("r", tokens, [[11, 12, 13, 14], [15], [21, 22, 23, 24]],
                                       64)
            assert loaded.loaded_tokens == 64
    for layer in layout.groups[0].layers:
        assert bool((caches[layer][11:15] == 7.0).all())
    for layer in layout.groups[2].layers:
        assert bool((caches[layer][24] == 7.0).all())


async def test_a_cpu_engine_is_served_by_a_gpu_sidecar(gpu_sidecar: SidecarProcess) -> None:
    """Engines with KV in CPU memory are still copied by threads on a CUDA sidecar."""
    engine = KVEngine(hybrid_layout())
    tokens = random_tokens(2 * 16, seed=3)
    with anyio.fail_after(TIMEOUT):
        async with await engine.connect(gpu_sidecar.endpoint) as client:
            assert (await client.save("c", tokens, [[1, 2], [3], [1, 2]])).stored == 4
            loaded = await client.load("c", tokens, [[5, 6], [7], [8, 9]], 32)
            assert loaded.loaded_tokens == 32
    assert engine.same_block(0, 1, engine, 5) and engine.same_block(2, 2, engine, 9)


ENGINE = textwrap.dedent("""
    import sys, time, anyio, torch
    from pipeline.core.layout import KVCacheLayout
    from tests.gpu.test_cuda_path import gpu_caches
    from tests.kit import hybrid_layout, random_tokens
    from transport.client import EngineClient

    async def main():
        layout = KVCacheLayout.from_dict(hybrid_layout(page_bytes=int(sys.argv[2])))
        caches = gpu_caches(layout)
        client = await EngineClient.connect(sys.argv[1], layout=layout, kv_caches=caches)
        await client.save("r", random_tokens(64), [[1, 2, 3, 4], [5], [1, 2, 3, 4]])
        print("registered", flush=True)
        await anyio.sleep(3600)

    anyio.run(main)
""")


def free_gpu_bytes() -> int:
    return int(torch.cuda.mem_get_info()[0])


def test_a_sigkilled_gpu_engine_leaves_no_memory_mapped(gpu_sidecar: SidecarProcess) -> None:
    """SIGKILL an engine whose GPU KV the sidecar has open: the sidecar sees the exit,
    closes the engine's allocations, and the driver gets all of that memory back."""
    page_bytes = 8 << 20  # 6 layers x 64 blocks x 8 MiB: 3 GiB of KV
    free_before = free_gpu_bytes()
    engine = subprocess.Popen([sys.executable, "-c", ENGINE, gpu_sidecar.endpoint,
                               str(page_bytes)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert engine.stdout is not None
        assert engine.stdout.readline().strip() == "registered", gpu_sidecar.log()
        held = free_before - free_gpu_bytes()
        assert held >= 6 * NUM_BLOCKS * page_bytes
    finally:
        engine.send_signal(signal.SIGKILL)
        engine.wait()
        if engine.stdout is not None:
            engine.stdout.close()
    deadline = time.monotonic() + 30
    while b"session.owner_exited" not in gpu_sidecar.log_path.read_bytes():
        assert time.monotonic() < deadline, gpu_sidecar.log()
        time.sleep(0.1)
    while free_before - free_gpu_bytes() > 512 << 20:
        assert time.monotonic() < deadline, (
            f"{(free_before - free_gpu_bytes()) >> 20} MiB still held after the engine died"
        )
        time.sleep(0.2)




@pytest.mark.parametrize(("page_bytes", "kv_first"), [
    (64 << 10, False), (64 << 10, True), (1028, False), (1030, True), (1031, False),
], ids=["words_8", "kv_first_8", "words_4", "kv_first_1", "words_1"])
def test_one_launch_moves_the_bytes_of_a_call_per_segment(page_bytes: int,
                                                          kv_first: bool) -> None:
    """The page kernel (one launch a batch) gathers exactly what an ``index_select`` per
    segment gathers, at every word it can copy in, and scatters only the rows kept into
    their blocks, touching no other byte."""
    pytest.importorskip("triton")
    from pipeline.backends import cuda_copy, cuda_kernels
    from pipeline.core.geometry import build_store_groups

    assert cuda_kernels.triton_kernels() is not None
    layout = KVCacheLayout.from_dict(hybrid_layout(page_bytes=page_bytes))
    generator = torch.Generator(device="cuda").manual_seed(page_bytes)
    shape = (2, NUM_BLOCKS, page_bytes // 2) if kv_first else (NUM_BLOCKS, page_bytes)
    caches = {layer: torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda",
                                   generator=generator)
              for group in layout.groups for layer in group.layers}
    device = torch.device("cuda")
    for geometry in build_store_groups(
        layout, {layer: (tensor, int(kv_first)) for layer, tensor in caches.items()}
    ):
        ids = [5, 9, 2, 40]
        stride = -(-geometry.stored_bytes // 64) * 64
        rows = torch.zeros((len(ids), stride), dtype=torch.uint8, device=device)
        cuda_copy._move_pages(geometry, ids, range(len(ids)), rows, device, to_rows=True)
        expected = torch.zeros_like(rows)
        cuda_copy.gather_blocks(geometry.segments, torch.tensor(ids, device=device),
                                expected[:, : geometry.stored_bytes])
        assert torch.equal(rows, expected)

        before = [segment.blocks.clone() for segment in geometry.segments]
        cuda_copy._move_pages(geometry, [50, 51], [0, 2], rows, device, to_rows=False)
        for segment, old in zip(geometry.segments, before, strict=True):
            old[[50, 51]] = old[[5, 2]]
            assert torch.equal(segment.blocks, old)


KERNELS = textwrap.dedent("""
    import json, sys, anyio, torch
    from pipeline.backends import cuda_copy, cuda_kernels
    from pipeline.backends.cpu_copy import CopyThreads
    from pipeline.backends.threads import WorkerThreads
    from pipeline.core.geometry import build_store_groups
    from pipeline.core.layout import KVCacheLayout
    from pipeline.core.runs import Run, value_span
    from tests.gpu.test_cuda_path import PAGE_BYTES, gpu_caches
    from tests.kit import hybrid_layout

    layout = KVCacheLayout.from_dict(hybrid_layout(page_bytes=PAGE_BYTES))
    caches = gpu_caches(layout)
    geometries = build_store_groups(layout, {layer: (t, 0) for layer, t in caches.items()})
    if sys.argv[1] == "compiled":
        cuda_kernels.compile_kernels(cuda_kernels.kernel_forms(geometries))
    compiled = []

    def hook(**info):  # Triton's: a kernel not compiled in this process yet
        compiled.append(info["repr"])

    try:
        from triton import knobs
        knobs.runtime.jit_cache_hook = hook
    except ImportError:  # Triton before 3.4
        from triton.runtime.jit import JITFunction
        JITFunction.cache_hook = hook
    engine = cuda_copy.CudaCopyEngine(CopyThreads(WorkerThreads(1, name="test")),
                                      anyio.CapacityLimiter(2), streams=2)

    async def round_trip():
        for geometry in geometries:
            memory = torch.zeros((2, value_span(geometry.stored_bytes)), dtype=torch.uint8)
            runs = [Run(0, memory[:, : geometry.stored_bytes])]
            await engine.gather(geometry, [1, 2], runs)
            assert await engine.scatter(geometry, [3, 4], runs) == [True, True]

    anyio.run(round_trip)
    print(json.dumps(compiled))
""")


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "control"])
def test_a_registered_engines_first_copies_compile_no_kernel(compiled: bool) -> None:
    """``compile_kernels`` (which the sidecar runs in a worker thread as an engine
    registers) compiles every kernel a save and a load of the engine's groups launch: in
    a fresh process, such a round trip after it compiles nothing, and without it the
    same round trip compiles (the check can fail)."""
    pytest.importorskip("triton")
    done = subprocess.run([sys.executable, "-c", KERNELS, "compiled" if compiled else "cold"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    kernels = json.loads(done.stdout.strip().splitlines()[-1])
    if compiled:
        assert kernels == []
    else:
        assert kernels


@pytest.mark.parametrize(("payload", "padding", "seed"), DIGEST_CASES)
def test_checksums_on_the_device_are_those_the_host_seals(payload: int, padding: int,
                                                          seed: int) -> None:
    """The checksum kernels, compiled, seal what ``integrity.seal_rows`` seals on the host
    and fail exactly the row with a flipped byte."""
    pytest.importorskip("triton")
    from pipeline.backends.cuda_digests import check_on_device, seal_on_device
    from pipeline.core.integrity import CHECKSUM_BYTES, seal_rows

    generator = torch.Generator().manual_seed(payload)
    host = torch.randint(0, 256, (5, payload + CHECKSUM_BYTES + padding), dtype=torch.uint8,
                         generator=generator)
    rows = host.cuda()
    seal_on_device(rows, payload, seed)
    seal_rows(host, payload, seed)
    assert torch.equal(rows.cpu(), host)
    rows[3, payload // 3] ^= 1
    assert check_on_device(rows, payload, seed).tolist() == [1, 1, 1, 0, 1]


@pytest.mark.parametrize("on_device", [True, False], ids=["device_checksums", "host_checksums"])
async def test_gpu_values_are_sealed_as_the_host_seals_and_a_failed_one_never_lands(
    on_device: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Values saved from GPU blocks into two runs of padded host rows carry the checksums
    the host seals; loaded into other blocks, the one with a flipped byte is reported and
    its block left as it was, and the others land byte for byte. Alike with checksums on
    the device and on the host."""
    from pipeline.backends import cuda_copy
    from pipeline.backends.cpu_copy import CopyThreads
    from pipeline.backends.threads import WorkerThreads
    from pipeline.core.geometry import build_store_groups
    from pipeline.core.integrity import seal_rows
    from pipeline.core.runs import Run

    if not on_device:
        monkeypatch.setattr(cuda_copy, "checksums_on_device", lambda *args: None)
    layout = KVCacheLayout.from_dict(hybrid_layout(page_bytes=PAGE_BYTES))
    caches = gpu_caches(layout, kv_first=True)
    geometry = build_store_groups(layout, {layer: (tensor, 1)
                                           for layer, tensor in caches.items()})[0]
    assert geometry.checksum_seed is not None
    stride = geometry.stored_bytes + 64
    memory = torch.zeros((6, stride), dtype=torch.uint8)
    runs = [Run(0, memory[0:3, : geometry.stored_bytes]),
            Run(3, memory[4:6, : geometry.stored_bytes])]  # a gap at 3: two runs
    engine = cuda_copy.CudaCopyEngine(CopyThreads(WorkerThreads(1, name="test")),
                                      anyio.CapacityLimiter(2), streams=2)
    with anyio.fail_after(TIMEOUT):
        await engine.gather(geometry, [1, 2, 3, 4, 5], runs)
    expected = memory[[0, 1, 2, 4, 5], : geometry.stored_bytes].clone()
    seal_rows(expected, geometry.value_bytes, geometry.checksum_seed)
    assert torch.equal(memory[[0, 1, 2, 4, 5], : geometry.stored_bytes], expected)
    assert not memory[3].any() and not memory[:, geometry.stored_bytes :].any()

    memory[4, 100] ^= 1  # value 3
    before = {layer: caches[layer].clone() for layer in geometry.group.layers}
    with anyio.fail_after(TIMEOUT):
        intact = await engine.scatter(geometry, [11, 12, 13, 14, 15], runs)
    torch.cuda.synchronize()
    assert intact == [True, True, True, False, True]
    for layer in geometry.group.layers:
        for source, target in ((1, 11), (2, 12), (3, 13), (5, 15)):
            assert torch.equal(block(caches[layer], target), block(before[layer], source))
        assert torch.equal(block(caches[layer], 14), block(before[layer], 14))

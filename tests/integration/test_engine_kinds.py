"""What vLLM's two processes need from a sidecar: a lookup-only session, hashes the
sidecar cannot compute, tensors shared in place, loads past the engine's own hit."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence

import anyio
import pytest
import torch

from pipeline.core.errors import RequestRejected
from pipeline.testing import SidecarProcess, run_sidecar_process
from tests.kit import KVEngine, hybrid_layout, random_tokens, shm_names
from transport.client import EngineClient
from transport.handover import Handed
from transport.tensors import MappedTensors, Segments, tensor_handle

TIMEOUT = 30


@pytest.fixture(scope="module")
def sidecar() -> Iterator[SidecarProcess]:
    with run_sidecar_process() as process:
        yield process


def other_hashes(tokens: Sequence[int], size: int) -> list[bytes]:
    """An engine's own chained hashes with an algorithm the sidecar does not compute."""
    parent, out = b"seed", []
    for start in range(0, len(tokens) - size + 1, size):
        parent = hashlib.blake2b(parent + repr(tokens[start:start + size]).encode()).digest()
        out.append(parent)
    return out


async def test_a_lookup_only_session_finds_what_the_kv_session_saved(
    sidecar: SidecarProcess,
) -> None:
    """vLLM's scheduler registers without tensors and sees the worker's saves; it may
    not save or load itself."""
    engine = KVEngine(hybrid_layout())
    tokens = random_tokens(3 * 16 + 1, seed=4)
    with anyio.fail_after(TIMEOUT):
        async with await engine.connect(sidecar.endpoint) as worker, \
                await EngineClient.connect(sidecar.endpoint, layout=engine.layout,
                                           kv_caches={}, lookup_only=True) as scheduler:
            assert scheduler.registered is not None
            assert scheduler.registered.store_group_ids == (0, 2)
            assert await scheduler.lookup(tokens) == 0
            await worker.save("r", tokens, [[1, 2, 3], [4], [1, 2, 3]])
            assert await scheduler.lookup(tokens) == 48
            with pytest.raises(RequestRejected, match="lookups only"):
                await scheduler.save("r", tokens, [[1, 2, 3], [4], [1, 2, 3]])
            with pytest.raises(RequestRejected, match="lookups only"):
                await scheduler.load("r", tokens, [[5, 6, 7], [8], [5, 6, 7]], 48)


async def test_a_lookup_only_registration_with_tensors_is_refused(
    sidecar: SidecarProcess,
) -> None:
    engine = KVEngine(hybrid_layout())
    with anyio.fail_after(TIMEOUT), pytest.raises(RequestRejected, match="must not share"):
        await EngineClient.connect(sidecar.endpoint, layout=engine.layout,
                                   kv_caches=engine.kv_caches, lookup_only=True)


async def test_hashes_the_sidecar_cannot_compute_are_required_and_used(
    sidecar: SidecarProcess,
) -> None:
    """With an algorithm other than sha256_cbor (vLLM's default sha256, xxhash) the
    engine's hashes are the keys: required with every request, never second-guessed."""
    a, b = KVEngine(hybrid_layout()), KVEngine(hybrid_layout())
    tokens = random_tokens(4 * 16, seed=5)
    hashes = other_hashes(tokens, 16)
    with anyio.fail_after(TIMEOUT):
        async with await a.connect(sidecar.endpoint, hash_algo="sha256",
                                   block_hasher=other_hashes) as ca, \
                await b.connect(sidecar.endpoint, hash_algo="sha256",
                                block_hasher=other_hashes) as cb:
            with pytest.raises(RequestRejected, match="send block_hashes"):
                await ca.lookup(tokens)
            saved = await ca.save("r", tokens, [[1, 2, 3, 4], [5], [1, 2, 3, 4]],
                                  block_hashes=hashes)
            assert saved.stored == 8
            assert await cb.lookup(tokens, block_hashes=hashes) == 48
            # Other hashes of the same tokens name other blocks.
            assert await cb.lookup(tokens, block_hashes=other_hashes(tokens[::-1], 16)) == 0
            loaded = await cb.load("r", tokens, [[9, 10, 11, 12], [13], [9, 10, 11, 12]], 48,
                                   block_hashes=hashes)
    assert loaded.loaded_tokens == 48
    assert all(a.same_block(0, 1 + j, b, 9 + j) for j in range(3))


async def test_an_unknown_hash_algorithm_is_refused(sidecar: SidecarProcess) -> None:
    with anyio.fail_after(TIMEOUT), pytest.raises(RequestRejected, match="hash_algo 'md5'"):
        await KVEngine(hybrid_layout()).connect(sidecar.endpoint, hash_algo="md5")


async def test_a_load_leaves_the_engines_own_hit_alone(sidecar: SidecarProcess) -> None:
    """``computed_tokens``: blocks the engine already holds are neither needed (null ids
    are fine there) nor written."""
    a, b = KVEngine(hybrid_layout()), KVEngine(hybrid_layout())
    tokens = random_tokens(4 * 16 + 1, seed=6)
    before = b.pages(0, 10)
    with anyio.fail_after(TIMEOUT):
        async with await a.connect(sidecar.endpoint) as ca, \
                await b.connect(sidecar.endpoint) as cb:
            await ca.save("r", tokens, [[1, 2, 3, 4], [5], [1, 2, 3, 4]])
            loaded = await cb.load("r", tokens, [[0, 10, 11, 12], [13], [0, 10, 11, 12]], 64,
                                   computed_tokens=32)
    assert loaded.loaded_tokens == 64 and loaded.invalid_block_ids == ()
    assert {(r.group_id, r.block_index) for r in loaded.blocks} == {(0, 2), (0, 3), (2, 3)}
    assert all(torch.equal(x, y) for x, y in zip(b.pages(0, 10), before, strict=True))
    assert a.same_block(0, 3, b, 11) and a.same_block(0, 4, b, 12)


# -- memory the engine allocated, shared in place ------------------------------------------


def test_an_engine_tensor_shared_in_place_keeps_its_bytes_and_leaves_no_name() -> None:
    """Every view follows the move; the sidecar's mapping sees the engine's writes."""
    buffer = torch.randn(8, 1024)
    view = buffer[2:]
    expected = buffer.clone()
    names = shm_names()
    segments = Segments()
    handle = tensor_handle("layer", view, segments, share_in_place=True)
    [fd] = segments.fds
    assert handle.segment == 0 and os.fstat(fd).st_nlink == 0  # a file with no name
    assert handle.offset == 2 * 1024 * 4
    assert torch.equal(buffer, expected) and buffer.is_shared()
    assert shm_names() == names
    handed = Handed(os.getpid(), os.pidfd_open(os.getpid()), [os.dup(fd)])
    with MappedTensors(handed=handed) as mapped:
        peer = mapped.map_tensor(handle)
        buffer[3].fill_(7.0)
        assert torch.equal(peer[1], buffer[3])
        peer[0].fill_(-1.0)
        assert bool((view[0] == -1.0).all())
        del peer


def test_a_plain_tensor_is_still_refused_unless_shared_in_place() -> None:
    """Memory outside shared memory is never moved into it without being asked."""
    with pytest.raises(Exception, match="not in shared memory"):
        tensor_handle("layer", torch.zeros(4, 16), Segments())


def test_another_process_maps_a_tensor_shared_in_place_through_its_descriptor() -> None:
    """The sidecar side, from a second process given the engine's descriptor."""
    import msgspec

    tensor = torch.arange(4 * 256, dtype=torch.float32).reshape(4, 256)
    segments = Segments()
    handle = tensor_handle("layer", tensor, segments, share_in_place=True)
    script = (
        "import os, sys, msgspec\n"
        "from pipeline.core.messages import TensorHandle\n"
        "from transport.handover import Handed\n"
        "from transport.tensors import MappedTensors\n"
        "h = msgspec.json.decode(sys.argv[1], type=TensorHandle)\n"
        "owner = os.getppid()\n"
        "handed = Handed(owner, os.pidfd_open(owner), [int(sys.argv[2])])\n"
        "t = MappedTensors(handed=handed, owner_pid=owner).map_tensor(h)\n"
        "print(float(t.sum()))\n"
        "t[1].fill_(0)\n"
    )
    [fd] = segments.fds
    done = subprocess.run([sys.executable, "-c", script, msgspec.json.encode(handle).decode(),
                           str(fd)], pass_fds=[fd], capture_output=True, text=True,
                          timeout=60, check=True)
    assert float(done.stdout) == float(torch.arange(4 * 256).sum())
    assert bool((tensor[1] == 0).all())

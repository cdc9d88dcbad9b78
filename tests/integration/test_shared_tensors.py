"""KV tensors shared by descriptor between real processes: the engine allocates, the sidecar
maps, and nothing is left in /dev/shm."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch

from pipeline.core.errors import TransportError
from pipeline.core.messages import TensorHandle
from tests.kit import shm_names
from transport.tensors import SHM_DIR, MappedTensors, block_pieces, shared_kv_tensor, tensor_handle

REPLY_TIMEOUT_S = 60.0

# A peer process driven by JSON lines on stdin; one JSON reply line per command.
PEER = r"""
import gc, json, sys
import msgspec, torch
from pipeline.core.messages import TensorHandle
from transport.tensors import MappedTensors, shared_kv_tensor, tensor_handle

mapped = MappedTensors()
tensor = None
handle = None
owned = None

def mapped_lines(inode):
    with open("/proc/self/maps") as maps:
        return sum(line.split()[4] == str(inode) for line in maps)

for line in sys.stdin:
    command = json.loads(line)
    op = command["op"]
    if op == "map":
        handle = msgspec.json.decode(command["handle"], type=TensorHandle)
        tensor = mapped.map_tensor(handle)
        reply = {"ok": True}
    elif op == "read":
        reply = {"values": tensor.float().flatten().tolist()}
    elif op == "fill":
        tensor.select(handle.block_dim, command["block"]).fill_(command["value"])
        reply = {"ok": True}
    elif op == "close":
        inode = command["inode"]
        tensor = None
        gc.collect()
        mapped.close()
        reply = {"mapped_lines": mapped_lines(inode)}
    elif op == "allocate":
        owned = shared_kv_tensor(command["shape"], getattr(torch, command["dtype"]))
        owned.copy_(torch.arange(owned.numel()).reshape(owned.shape))
        reply = {"handle": msgspec.json.encode(
            tensor_handle("peer.layer", owned, block_dim=command["block_dim"])).decode()}
    else:
        reply = {"error": op}
    print(json.dumps(reply), flush=True)
"""


class Peer:
    """A second Python process that maps or allocates shared tensors on command."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", PEER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ask(self, **command: Any) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], REPLY_TIMEOUT_S)
        assert ready, f"peer did not answer {command['op']!r} within {REPLY_TIMEOUT_S}s"
        line = self.process.stdout.readline()
        assert line, f"peer exited with {self.process.wait(REPLY_TIMEOUT_S)}"
        reply: dict[str, Any] = json.loads(line)
        return reply

    def map(self, handle: TensorHandle) -> None:
        assert self.ask(op="map", handle=msgspec.json.encode(handle).decode()) == {"ok": True}

    def read(self) -> torch.Tensor:
        return torch.tensor(self.ask(op="read")["values"])

    def finish(self) -> int:
        assert self.process.stdin is not None
        self.process.stdin.close()
        return self.process.wait(REPLY_TIMEOUT_S)


@pytest.fixture
def peer() -> Iterator[Peer]:
    process = Peer()
    yield process
    if process.process.poll() is None:
        process.process.kill()
        process.process.wait(REPLY_TIMEOUT_S)
    for stream in (process.process.stdin, process.process.stdout):
        if stream is not None:
            stream.close()


def inode(handle: TensorHandle) -> int:
    """The inode of the memory a handle names (its owner's descriptor)."""
    assert handle.owner_fd is not None and handle.shm_name == ""
    pid, fd = handle.owner_fd
    return os.stat(f"/proc/{pid}/fd/{fd}").st_ino


def memfds() -> set[int]:
    """The inodes of this process's open shared KV memory files."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:kvsidecar"):
                found.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
    return found


@pytest.fixture(autouse=True)
def no_leaked_segments() -> Iterator[None]:
    """Every file a test allocated is closed once its tensors are gone, and none ever
    had a name in /dev/shm."""
    before, names = memfds(), shm_names()
    yield
    gc.collect()
    assert memfds() <= before
    assert shm_names() <= names


def mapped_lines(inode: int) -> int:
    with open("/proc/self/maps") as maps:
        return sum(line.split()[4] == str(inode) for line in maps)


def filled(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    tensor = shared_kv_tensor(shape, dtype)
    tensor.copy_(torch.arange(tensor.numel()).reshape(shape))
    return tensor


# -- two processes -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "dtype", "block_dim"),
    [((4, 2, 1, 3), torch.bfloat16, 0), ((2, 4, 2, 1, 3), torch.float16, 1)],
    ids=["blocks_first", "kv_first"],
)
def test_peer_and_owner_see_each_others_writes(
    peer: Peer, shape: tuple[int, ...], dtype: torch.dtype, block_dim: int
) -> None:
    """A peer mapping the handle reads the owner's writes and its writes reach the owner."""
    tensor = filled(shape, dtype)
    peer.map(tensor_handle("model.layers.0", tensor, block_dim=block_dim))
    assert torch.equal(peer.read(), tensor.float().flatten())

    tensor.select(block_dim, 1).fill_(7)
    assert torch.equal(peer.read(), tensor.float().flatten())

    expected = tensor.clone()
    expected.select(block_dim, 2).fill_(-3)
    assert peer.ask(op="fill", block=2, value=-3) == {"ok": True}
    assert torch.equal(tensor, expected)
    handle = tensor_handle("model.layers.0", tensor, block_dim=block_dim)
    assert peer.ask(op="close", inode=inode(handle)) == {"mapped_lines": 0}
    assert peer.finish() == 0


def test_view_handle_maps_to_the_same_elements_in_the_peer(peer: Peer) -> None:
    """A handle for a view carries its byte offset and strides across processes."""
    tensor = filled((6, 4), torch.float32)
    view = tensor[2:, 1:3]
    handle = tensor_handle("v", view)
    assert handle.offset == (2 * 4 + 1) * 4
    assert handle.strides == (4, 1)
    peer.map(handle)
    assert torch.equal(peer.read(), view.flatten())
    assert peer.finish() == 0


def test_owner_exit_is_seen_and_the_mapping_keeps_its_data(peer: Peer) -> None:
    """When the owning process exits, the mapping still reads and says its owner is gone."""
    reply = peer.ask(op="allocate", shape=[3, 2, 4], dtype="int32", block_dim=0)
    handle = msgspec.json.decode(reply["handle"], type=TensorHandle)
    assert handle.owner_fd is not None and handle.owner_fd[0] == peer.process.pid
    with MappedTensors() as mapped:
        tensor = mapped.map_tensor(handle)
        assert torch.equal(tensor, torch.arange(24, dtype=torch.int32).reshape(3, 2, 4))
        assert not mapped.owner_exited()
        assert peer.finish() == 0
        assert mapped.owner_exited()
        assert torch.equal(tensor, torch.arange(24, dtype=torch.int32).reshape(3, 2, 4))
        del tensor


def test_sigkilled_owner_leaves_nothing_once_unmapped(peer: Peer) -> None:
    """A SIGKILLed owner leaves no name behind, and its memory is gone with the last
    mapping: the mapper sees the exit and closing it frees the memory."""
    names = shm_names()
    reply = peer.ask(op="allocate", shape=[64, 1024], dtype="int32", block_dim=0)
    handle = msgspec.json.decode(reply["handle"], type=TensorHandle)
    memory = inode(handle)
    mapped = MappedTensors()
    tensor = mapped.map_tensor(handle)
    peer.process.kill()
    peer.process.wait(REPLY_TIMEOUT_S)
    assert shm_names() == names
    assert mapped.owner_exited()
    assert tensor.view(-1)[:4].tolist() == [0, 1, 2, 3]
    del tensor
    mapped.close()
    assert mapped_lines(memory) == 0


def test_a_handle_of_a_process_that_is_gone_is_refused(peer: Peer) -> None:
    """A handle whose owner has exited cannot be mapped: its pid names nothing (or
    someone else)."""
    reply = peer.ask(op="allocate", shape=[2, 4], dtype="int32", block_dim=0)
    handle = msgspec.json.decode(reply["handle"], type=TensorHandle)
    assert peer.finish() == 0
    with MappedTensors() as mapped, pytest.raises(TransportError, match="is not running"):
        mapped.map_tensor(handle)


# -- registry and lifetimes in one process -----------------------------------------------


def test_segment_is_mapped_once_and_close_unmaps_it() -> None:
    """Many handles into one segment share one mapping, and close removes it."""
    tensor = filled((4, 8), torch.float32)
    handle = tensor_handle("x", tensor)
    memory = inode(handle)
    assert mapped_lines(memory) == 1  # the owner's own mapping
    mapped = MappedTensors()
    first = mapped.map_tensor(tensor_handle("layer.0", tensor[:2]))
    second = mapped.map_tensor(tensor_handle("layer.1", tensor[2:]))
    assert mapped.segment_names == {f"/proc/{os.getpid()}/fd/{handle.owner_fd[1]}"}
    assert mapped_lines(memory) == 2
    first.fill_(1)
    second.fill_(2)
    assert tensor[:2].eq(1).all() and tensor[2:].eq(2).all()
    del first, second
    mapped.close()
    assert mapped_lines(memory) == 1
    assert mapped.segment_names == frozenset()


def test_close_with_live_tensor_defers_unmapping_safely() -> None:
    """A tensor alive at close stays readable; its mapping goes when it is freed."""
    tensor = filled((4, 8), torch.float32)
    handle = tensor_handle("x", tensor)
    mapped = MappedTensors()
    alias = mapped.map_tensor(handle)
    mapped.close()
    assert torch.equal(alias, tensor)
    assert mapped_lines(inode(handle)) == 2
    del alias
    gc.collect()
    assert mapped_lines(inode(handle)) == 1
    with pytest.raises(TransportError, match="closed"):
        mapped.map_tensor(handle)


def test_segment_lives_while_any_view_lives_then_is_closed() -> None:
    """The owner's file stays open while a view is alive and is closed after the last."""
    tensor = shared_kv_tensor((4, 16), torch.bfloat16)
    handle = tensor_handle("x", tensor)
    memory = inode(handle)
    view = tensor[1]
    del tensor
    gc.collect()
    assert memory in memfds()
    assert tensor_handle("x", view).owner_fd == handle.owner_fd
    del view
    gc.collect()
    assert memory not in memfds()
    assert mapped_lines(memory) == 0


def test_a_segment_an_engine_named_itself_is_mapped_and_left_to_it() -> None:
    """A handle may name a segment its engine created in /dev/shm: it maps like any
    other, and unmapping leaves the name, which is its owner's to unlink."""
    path = SHM_DIR / f"kvsidecar-test-{os.getpid()}"
    path.write_bytes(torch.arange(16, dtype=torch.int32).numpy().tobytes())
    try:
        handle = TensorHandle(layer="x", shm_name=path.name, offset=0, shape=(4, 4),
                              strides=(4, 1), dtype="int32")
        with MappedTensors() as mapped:
            tensor = mapped.map_tensor(handle)
            assert torch.equal(tensor, torch.arange(16, dtype=torch.int32).reshape(4, 4))
            assert not mapped.owner_exited()  # no owner process to watch
            del tensor
        assert path.exists()
    finally:
        path.unlink()


def test_handle_of_plain_tensor_is_refused() -> None:
    """A tensor outside shared memory (or a copy of one) has no handle."""
    with pytest.raises(TransportError, match="'plain': tensor is not in shared memory"):
        tensor_handle("plain", torch.zeros(4, 4))
    shared = shared_kv_tensor((4, 4), torch.float32)
    with pytest.raises(TransportError, match="not in shared memory"):
        tensor_handle("copy", shared.clone())


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"dtype": "complex32"}, "unknown dtype 'complex32'"),
        ({"device": "cuda:0"}, "a tensor on cuda:0 is named by its CUDA IPC handle alone"),
        ({"device": "tpu:0"}, "device 'tpu:0' is not supported"),
        ({"strides": (8, -1)}, "must all be positive"),
        ({"strides": (0, 1)}, "must all be positive"),
        ({"strides": (4, 1)}, "overlap"),
        ({"strides": (8,)}, "differ in length"),
        ({"block_dim": 2}, "block_dim 2 is out of range"),
        ({"block_dim": 1}, "K/V-first tensor has shape [2, num_blocks"),
        ({"shape": (4, 0)}, "empty or negative"),
        ({"offset": 2}, "not a multiple of 4 bytes"),
        ({"offset": 4}, "but segment"),
        ({"shape": (5, 8)}, "but segment"),
        ({"owner_fd": (os.getpid(), 1 << 20)}, "does not exist"),
        ({"shm_name": "kvsidecar-elsewhere"}, "by shm_name or owner_fd, not both"),
        ({"shm_name": "kvsidecar-no-such-segment", "owner_fd": None}, "does not exist"),
        ({"shm_name": "../etc/passwd", "owner_fd": None}, "is not a shared memory segment name"),
        ({"shm_name": "", "owner_fd": None}, "is not a shared memory segment name"),
    ],
)
def test_bad_handle_is_refused_naming_layer_and_problem(
    change: dict[str, Any], problem: str
) -> None:
    """Each malformed handle raises TransportError naming the layer and what is wrong."""
    tensor = shared_kv_tensor((4, 8), torch.float32)
    handle = msgspec.structs.replace(tensor_handle("model.layers.3", tensor), **change)
    with MappedTensors() as mapped:
        with pytest.raises(TransportError) as caught:
            mapped.map_tensor(handle)
        assert str(caught.value).startswith("layer 'model.layers.3': ")
        assert problem in str(caught.value)
        assert len(mapped.segment_names) <= 1


def test_block_pieces_are_one_or_two_contiguous_byte_views() -> None:
    """Blocks-first blocks are one byte view; K/V-first blocks are K and V views."""
    blocks_first = shared_kv_tensor((4, 2, 3), torch.float16)
    [piece] = block_pieces(blocks_first, 2)
    assert piece.dtype == torch.uint8 and piece.numel() == 2 * 3 * 2
    piece.fill_(0xFF)
    assert torch.isnan(blocks_first[2]).all() and blocks_first[[0, 1, 3]].eq(0).all()

    kv_first = shared_kv_tensor((2, 4, 2, 3), torch.float16)
    key, value = block_pieces(kv_first, 1, block_dim=1)
    key.copy_(torch.full((2, 3), 1.0, dtype=torch.float16).flatten().view(torch.uint8))
    value.copy_(torch.full((2, 3), 2.0, dtype=torch.float16).flatten().view(torch.uint8))
    assert kv_first[0, 1].eq(1).all() and kv_first[1, 1].eq(2).all()
    assert kv_first[:, [0, 2, 3]].eq(0).all()


def test_block_pieces_refuses_non_contiguous_blocks() -> None:
    """A block whose bytes are strided cannot be handed out as a byte view."""
    transposed = torch.zeros(3, 4, 2).transpose(0, 2)
    with pytest.raises(TransportError, match="not contiguous"):
        block_pieces(transposed, 0)

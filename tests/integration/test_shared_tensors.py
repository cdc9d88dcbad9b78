"""KV tensors shared by descriptor between real processes: the engine allocates and hands
its descriptors over, the sidecar maps, and nothing is left in /dev/shm."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import pytest
import torch

from pipeline.core.errors import TransportError
from pipeline.core.messages import TensorHandle
from tests.kit import shm_names
from transport.handover import Handed
from transport.tensors import (
    MappedTensors,
    Segments,
    block_pieces,
    shared_kv_tensor,
    tensor_handle,
)

REPLY_TIMEOUT_S = 60.0

# A peer process driven by JSON lines on stdin; one JSON reply line per command. Memory
# files pass over the unix socket whose descriptor is argv[1], with SCM_RIGHTS.
PEER = r"""
import gc, json, os, socket, sys
import msgspec, torch
from pipeline.core.messages import TensorHandle
from transport.handover import Handed
from transport.tensors import MappedTensors, Segments, shared_kv_tensor, tensor_handle

channel = socket.socket(fileno=int(sys.argv[1]))
mapped = None
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
        _, fds, _, _ = socket.recv_fds(channel, 1, 64, socket.MSG_CMSG_CLOEXEC)
        owner = command["owner"]
        mapped = MappedTensors(handed=Handed(owner, os.pidfd_open(owner), fds),
                               owner_pid=owner)
        handle = msgspec.json.decode(command["handle"], type=TensorHandle)
        tensor = mapped.map_tensor(handle)
        mapped.done_mapping()
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
        segments = Segments()
        reply = {"handle": msgspec.json.encode(tensor_handle(
            "peer.layer", owned, segments, block_dim=command["block_dim"])).decode()}
        socket.send_fds(channel, [b"\0"], segments.fds)
    else:
        reply = {"error": op}
    print(json.dumps(reply), flush=True)
"""


class Peer:
    """A second Python process that maps or allocates shared tensors on command,
    receiving or sending their descriptors over a unix socket."""

    def __init__(self) -> None:
        self.channel, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.channel.settimeout(REPLY_TIMEOUT_S)
        with child:
            self.process = subprocess.Popen(
                [sys.executable, "-c", PEER, str(child.fileno())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                pass_fds=[child.fileno()],
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

    def map(self, handle: TensorHandle, fds: Sequence[int]) -> None:
        """Hand ``fds`` (this process's) over and have the peer map ``handle`` in them."""
        socket.send_fds(self.channel, [b"\0"], fds)
        assert self.ask(op="map", owner=os.getpid(),
                        handle=msgspec.json.encode(handle).decode()) == {"ok": True}

    def allocate(self, shape: list[int], dtype: str) -> tuple[TensorHandle, Handed]:
        """A tensor the peer allocates: its handle, and its memory handed over to this
        process (the pidfd opened while the peer runs, as the sidecar's is)."""
        reply = self.ask(op="allocate", shape=shape, dtype=dtype, block_dim=0)
        _, fds, _, _ = socket.recv_fds(self.channel, 1, 64, socket.MSG_CMSG_CLOEXEC)
        handed = Handed(self.process.pid, os.pidfd_open(self.process.pid), fds)
        return msgspec.json.decode(reply["handle"], type=TensorHandle), handed

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
    process.channel.close()


def inode(fds: Sequence[int], handle: TensorHandle) -> int:
    """The inode of the memory file a handle names among ``fds`` (its owner's
    descriptors, or those handed over)."""
    return os.fstat(fds[handle.segment]).st_ino


def handed(segments: Segments) -> Handed:
    """This process's memory files, handed over to itself: copies of its descriptors,
    as the sidecar would receive them."""
    return Handed(os.getpid(), os.pidfd_open(os.getpid()), [os.dup(fd) for fd in segments.fds])


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
    """Every file a test allocated or was handed is closed once its tensors are gone,
    and none ever had a name in /dev/shm."""
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
    segments = Segments()
    handle = tensor_handle("model.layers.0", tensor, segments, block_dim=block_dim)
    peer.map(handle, segments.fds)
    assert torch.equal(peer.read(), tensor.float().flatten())

    tensor.select(block_dim, 1).fill_(7)
    assert torch.equal(peer.read(), tensor.float().flatten())

    expected = tensor.clone()
    expected.select(block_dim, 2).fill_(-3)
    assert peer.ask(op="fill", block=2, value=-3) == {"ok": True}
    assert torch.equal(tensor, expected)
    assert peer.ask(op="close", inode=inode(segments.fds, handle)) == {"mapped_lines": 0}
    assert peer.finish() == 0


def test_view_handle_maps_to_the_same_elements_in_the_peer(peer: Peer) -> None:
    """A handle for a view carries its byte offset and strides across processes."""
    tensor = filled((6, 4), torch.float32)
    view = tensor[2:, 1:3]
    segments = Segments()
    handle = tensor_handle("v", view, segments)
    assert handle.offset == (2 * 4 + 1) * 4
    assert handle.strides == (4, 1)
    peer.map(handle, segments.fds)
    assert torch.equal(peer.read(), view.flatten())
    assert peer.finish() == 0


def test_owner_exit_is_seen_and_the_mapping_keeps_its_data(peer: Peer) -> None:
    """When the owning process exits, the mapping still reads and says its owner is gone."""
    handle, memory = peer.allocate([3, 2, 4], "int32")
    assert handle.segment == 0 and len(memory.fds) == 1
    with MappedTensors(handed=memory, owner_pid=peer.process.pid) as mapped:
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
    handle, memory = peer.allocate([64, 1024], "int32")
    file = inode(memory.fds, handle)
    mapped = MappedTensors(handed=memory, owner_pid=peer.process.pid)
    tensor = mapped.map_tensor(handle)
    mapped.done_mapping()
    peer.process.kill()
    peer.process.wait(REPLY_TIMEOUT_S)
    assert shm_names() == names
    assert mapped.owner_exited()
    assert tensor.view(-1)[:4].tolist() == [0, 1, 2, 3]
    del tensor
    mapped.close()
    assert mapped_lines(file) == 0
    assert file not in memfds()


def test_memory_of_a_process_that_is_gone_maps_and_is_seen_gone(peer: Peer) -> None:
    """Memory handed over before its owner exited is the mapper's own (nothing is opened
    through the owner's pid): it still maps, and the exit shows as soon as it is mapped."""
    handle, memory = peer.allocate([2, 4], "int32")
    assert peer.finish() == 0
    with MappedTensors(handed=memory, owner_pid=peer.process.pid) as mapped:
        assert not mapped.owner_exited()  # nothing of it is mapped yet
        tensor = mapped.map_tensor(handle)
        assert mapped.owner_exited()
        assert torch.equal(tensor, torch.arange(8, dtype=torch.int32).reshape(2, 4))
        del tensor


# -- registry and lifetimes in one process -----------------------------------------------


def test_segment_is_mapped_once_and_close_unmaps_it() -> None:
    """Many handles into one segment share one mapping, and close removes it."""
    tensor = filled((4, 8), torch.float32)
    segments = Segments()
    handle = tensor_handle("x", tensor, segments)
    memory = inode(segments.fds, handle)
    assert mapped_lines(memory) == 1  # the owner's own mapping
    first_handle = tensor_handle("layer.0", tensor[:2], segments)
    second_handle = tensor_handle("layer.1", tensor[2:], segments)
    mapped = MappedTensors(handed=handed(segments))
    first = mapped.map_tensor(first_handle)
    second = mapped.map_tensor(second_handle)
    assert mapped.segment_names == {"memory file 0"}
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
    segments = Segments()
    handle = tensor_handle("x", tensor, segments)
    memory = inode(segments.fds, handle)
    mapped = MappedTensors(handed=handed(segments))
    alias = mapped.map_tensor(handle)
    mapped.close()
    assert torch.equal(alias, tensor)
    assert mapped_lines(memory) == 2
    del alias
    gc.collect()
    assert mapped_lines(memory) == 1
    with pytest.raises(TransportError, match="closed"):
        mapped.map_tensor(handle)


def test_segment_lives_while_any_view_lives_then_is_closed() -> None:
    """The owner's file stays open while a view is alive and is closed after the last."""
    tensor = shared_kv_tensor((4, 16), torch.bfloat16)
    segments = Segments()
    handle = tensor_handle("x", tensor, segments)
    memory = inode(segments.fds, handle)
    view = tensor[1]
    del tensor
    gc.collect()
    assert memory in memfds()
    assert tensor_handle("x", view, segments).segment == handle.segment
    assert len(segments.fds) == 1
    del view
    gc.collect()
    assert memory not in memfds()
    assert mapped_lines(memory) == 0


def test_a_segment_that_was_not_handed_over_is_refused() -> None:
    """A handle can name only a memory file its engine handed over: any other index is
    refused before anything is mapped, and nothing maps where nothing was handed over."""
    tensor = filled((4, 8), torch.float32)
    segments = Segments()
    handle = tensor_handle("x", tensor, segments)
    with MappedTensors(handed=handed(segments)) as mapped:
        with pytest.raises(TransportError,
                           match="memory file 1 was not handed over with this registration"):
            mapped.map_tensor(msgspec.structs.replace(handle, segment=1))
        assert mapped.segment_names == frozenset()
    with MappedTensors() as mapped, pytest.raises(TransportError, match="not handed over"):
        mapped.map_tensor(handle)


def test_handle_of_plain_tensor_is_refused() -> None:
    """A tensor outside shared memory (or a copy of one) has no handle."""
    with pytest.raises(TransportError, match="'plain': tensor is not in shared memory"):
        tensor_handle("plain", torch.zeros(4, 4), Segments())
    shared = shared_kv_tensor((4, 4), torch.float32)
    with pytest.raises(TransportError, match="not in shared memory"):
        tensor_handle("copy", shared.clone(), Segments())


def test_a_cpu_handle_needs_the_segments_it_is_handed_over_with() -> None:
    """A CPU tensor is described only by index into the files handed over with it."""
    with pytest.raises(TransportError, match="'x': a CPU tensor is described with the Segments"):
        tensor_handle("x", shared_kv_tensor((4, 4), torch.float32))


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
        ({"offset": 4}, "but its memory file 0 has 128 bytes"),
        ({"shape": (5, 8)}, "but its memory file 0 has 128 bytes"),
        ({"segment": 3}, "memory file 3 was not handed over with this registration"),
        ({"segment": -1}, "a CPU tensor is named by the index of a memory file handed over, "
                          "and no CUDA IPC handle"),
    ],
)
def test_bad_handle_is_refused_naming_layer_and_problem(
    change: dict[str, Any], problem: str
) -> None:
    """Each malformed handle raises TransportError naming the layer and what is wrong."""
    tensor = shared_kv_tensor((4, 8), torch.float32)
    segments = Segments()
    handle = msgspec.structs.replace(tensor_handle("model.layers.3", tensor, segments), **change)
    with MappedTensors(handed=handed(segments)) as mapped:
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

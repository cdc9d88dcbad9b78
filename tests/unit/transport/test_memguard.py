"""memguard: reads and writes of a memory file shrunk under its mapping survive (SIGBUS).

Every access that may fault runs in a child interpreter, so that a failure is an exit
status rather than a dead pytest.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from transport import _memguard as memguard

REPO = Path(__file__).resolve().parents[3]
SIZE = 1 << 20

PRELUDE = f"""
import faulthandler, json, mmap, os, signal, sys, threading
from transport import _memguard as memguard
SIZE = {SIZE}

def shrunk(watch=True):
    '''A 1 MiB memfd mapping filled with 0xAB, then the file truncated to nothing.'''
    fd = os.memfd_create("memguard-test")
    os.ftruncate(fd, SIZE)
    mapping = mmap.mmap(fd, SIZE, mmap.MAP_SHARED)
    token = memguard.watch(mapping) if watch else None
    mapping[:] = b"\\xab" * SIZE
    os.ftruncate(fd, 0)
    return mapping, token
"""


def child(code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=60, cwd=REPO, env=env)


def printed(result: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert result.returncode == 0, result.stderr
    out: dict[str, object] = json.loads(result.stdout.splitlines()[-1])
    return out


def test_reads_and_writes_of_a_shrunk_watched_mapping_survive_as_zeros() -> None:
    """After the file is truncated, a watched mapping read by bytes() or by a torch sum
    gives zeros and turns lost, and a write to it reads back."""
    result = child("""
        import torch
        mapping, token = shrunk()
        before = memguard.lost(token)
        head, tail = bytes(mapping[:4096]), bytes(mapping[-4096:])
        mapping[:4] = b"abcd"
        by_torch, torch_token = shrunk()  # its first fault inside a torch kernel
        view = torch.frombuffer(memoryview(by_torch), dtype=torch.uint8)
        print(json.dumps({"before": before, "lost": memguard.lost(token),
                          "zeros": head + tail == bytes(8192), "written": mapping[:6].hex(),
                          "torch_sum": int(view.sum()), "torch_lost": memguard.lost(torch_token)}))
        del view
        for m, t in ((mapping, token), (by_torch, torch_token)):
            memguard.unwatch(t)
            m.close()
        assert memguard.watched() == 0
    """)
    assert printed(result) == {"before": False, "lost": True, "zeros": True,
                               "written": b"abcd\0\0".hex(), "torch_sum": 0,
                               "torch_lost": True}


def test_an_unwatched_shrunk_mapping_still_dies_by_sigbus() -> None:
    """Control: the same truncation without watch() kills the reader with SIGBUS."""
    result = child("""
        mapping, _ = shrunk(watch=False)
        print(bytes(mapping[:4096])[:1])
    """)
    assert result.returncode == -signal.SIGBUS
    assert result.stdout == ""


def test_faults_outside_watched_mappings_chain_to_faulthandler() -> None:
    """With faulthandler enabled first, a watched mapping survives its fault and an
    unwatched one still gets faulthandler's traceback and dies by SIGBUS."""
    result = child("""
        faulthandler.enable()
        watched, token = shrunk()
        print(bytes(watched[:1]).hex(), memguard.lost(token), flush=True)
        unwatched, _ = shrunk(watch=False)
        print(bytes(unwatched[:1]).hex(), flush=True)
    """)
    assert result.returncode == -signal.SIGBUS
    assert result.stdout == "00 True\n"
    assert result.stderr.count("Fatal Python error: Bus error") == 1
    assert 'File "<string>"' in result.stderr


def test_a_loop_through_faulthandler_still_ends_in_sigbus() -> None:
    """faulthandler enabled after a watch, then another watch installing ours over it:
    an unwatched fault goes round the two handlers once and then dies by SIGBUS."""
    result = child("""
        first, _ = shrunk()
        faulthandler.enable()
        second, token = shrunk()
        print(bytes(second[:1]).hex(), memguard.lost(token), flush=True)
        unwatched, _ = shrunk(watch=False)
        print(bytes(unwatched[:1]).hex(), flush=True)
    """)
    assert result.returncode == -signal.SIGBUS
    assert result.stdout == "00 True\n"
    assert result.stderr.count("Fatal Python error: Bus error") == 1


def test_a_sigbus_sent_by_kill_still_kills() -> None:
    """A SIGBUS sent with kill() is no fault: it goes to the default action and kills."""
    result = child("""
        mapping, token = shrunk()
        os.kill(os.getpid(), signal.SIGBUS)
        print("survived", flush=True)
    """)
    assert result.returncode == -signal.SIGBUS
    assert result.stdout == ""


def test_unwatch_frees_the_slot_and_a_stale_token_frees_nothing() -> None:
    """unwatch() gives the slot back and is idempotent; a stale token leaves a newer watch
    of the same slot alone, and watch() keeps no buffer export (close() works)."""
    before = memguard.watched()
    fd = os.memfd_create("memguard-test")
    try:
        os.ftruncate(fd, SIZE)
        first = mmap.mmap(fd, SIZE, mmap.MAP_SHARED)
        token = memguard.watch(first)
        assert memguard.watched() == before + 1
        memguard.unwatch(token)
        first.close()
        assert memguard.watched() == before

        second = mmap.mmap(fd, SIZE, mmap.MAP_SHARED)
        newer = memguard.watch(second)
        assert newer != token
        memguard.unwatch(token)
        assert memguard.watched() == before + 1
        assert memguard.lost(token) is False
        assert memguard.lost(newer) is False
        memguard.unwatch(newer)
        memguard.unwatch(newer)
        assert memguard.watched() == before
        second.close()
    finally:
        os.close(fd)


def test_watch_refuses_an_unaligned_or_empty_buffer() -> None:
    """watch() raises ValueError for a buffer that does not start on a page, or is empty."""
    before = memguard.watched()
    with pytest.raises(ValueError):
        memguard.watch(bytearray())
    fd = os.memfd_create("memguard-test")
    try:
        os.ftruncate(fd, SIZE)
        mapping = mmap.mmap(fd, SIZE, mmap.MAP_SHARED)
        with memoryview(mapping) as view, view[1:] as unaligned, pytest.raises(ValueError):
            memguard.watch(unaligned)
        assert memguard.watched() == before
        mapping.close()
    finally:
        os.close(fd)


def test_a_gil_free_torch_fill_from_a_thread_survives() -> None:
    """tensor.fill_(1) from another thread (GIL released, torch's own workers too) on a
    shrunk watched mapping survives and marks it lost. What the fill wrote is forfeit:
    torch's two workers fault at once, and the second replacement of the mapping may
    wipe what the first worker wrote after the first; every byte reads as written or
    zero, never anything else."""
    result = child("""
        import torch
        torch.set_num_threads(2)
        mapping, token = shrunk()
        view = torch.frombuffer(memoryview(mapping), dtype=torch.uint8)
        worker = threading.Thread(target=view.fill_, args=(1,))
        worker.start()
        worker.join()
        print(json.dumps({"lost": memguard.lost(token),
                          "values": sorted(set(view.unique().tolist()))}))
    """)
    out = printed(result)
    assert out["lost"] is True, out
    assert out["values"] in ([0], [1], [0, 1]), out

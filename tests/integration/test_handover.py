"""The handover desk on a real unix socket: descriptors are taken only with a live
ticket, from the process it was issued to, and claimed once on its connection."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from pipeline.core.errors import RequestRejected, TransportError
from pipeline.core.tenancy import Peer
from transport import handover
from transport.handover import HandoverDesk, hand_over

TIMEOUT = 30
ME = Peer("uid:0", pid=os.getpid(), uid=os.getuid())


@contextlib.asynccontextmanager
async def serving(path: Path) -> AsyncIterator[HandoverDesk]:
    """A desk serving its socket at ``path`` for the block."""
    with HandoverDesk(path) as opened:
        async with anyio.create_task_group() as group:
            group.start_soon(opened.run)
            yield opened
            group.cancel_scope.cancel()


def memory_file(size: int = 4096) -> int:
    fd = os.memfd_create("handover-test", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return fd


async def pass_fds(desk: HandoverDesk, token: bytes, fds: list[int]) -> None:
    await anyio.to_thread.run_sync(lambda: hand_over(str(desk.path), token, fds))


async def test_the_process_a_ticket_was_issued_to_hands_its_files_over(tmp_path: Path) -> None:
    """The ticket's own process passes two files; the claim on its connection yields
    descriptors of the same files, and a second claim finds nothing."""
    async with serving(tmp_path / "handover") as desk:
        await _hands_over(desk)


async def _hands_over(desk: HandoverDesk) -> None:
    fds = [memory_file(), memory_file(8192)]
    try:
        token = desk.issue(b"conn", ME)
        with anyio.fail_after(TIMEOUT):
            await pass_fds(desk, token, fds)
        handed = desk.claim(token, b"conn", ME)
        try:
            assert [os.fstat(fd).st_ino for fd in handed.fds] == [
                os.fstat(fd).st_ino for fd in fds]
            assert handed.pid == os.getpid()
        finally:
            handed.close()
        with pytest.raises(RequestRejected, match="no memory was handed over"):
            desk.claim(token, b"conn", ME)
    finally:
        for fd in fds:
            os.close(fd)


PASS_FROM_ANOTHER_PROCESS = r"""
import os, sys
from transport.handover import hand_over
fd = os.memfd_create("other", 0)
os.ftruncate(fd, 4096)
try:
    hand_over(sys.argv[1], bytes.fromhex(sys.argv[2]), [fd])
except Exception as exc:
    print(exc)
"""


async def test_a_ticket_is_good_only_for_its_process_and_connection(tmp_path: Path) -> None:
    """Another process holding the token is refused; the token claimed on another
    connection, or by another identity, is refused too."""
    async with serving(tmp_path / "handover") as desk:
        await _bound_to_its_process(desk)


async def _bound_to_its_process(desk: HandoverDesk) -> None:
    token = desk.issue(b"conn", ME)
    with anyio.fail_after(TIMEOUT):
        done = await anyio.run_process(
            [sys.executable, "-c", PASS_FROM_ANOTHER_PROCESS, str(desk.path), token.hex()],
            check=False)
    assert b"no ticket of this process has this token" in done.stdout, done.stdout
    fd = memory_file()
    try:
        with anyio.fail_after(TIMEOUT):
            await pass_fds(desk, token, [fd])
    finally:
        os.close(fd)
    for connection, peer in ((b"other", ME), (b"conn", Peer("uid:7", pid=ME.pid, uid=7))):
        with pytest.raises(RequestRejected):
            desk.claim(token, connection, peer)
    desk.claim(token, b"conn", ME).close()


async def test_pipes_stale_tickets_and_tcp_peers_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A descriptor that is not a memory file is refused whole; a ticket past its time
    takes nothing; a peer without peer credentials (tcp) gets no ticket."""
    async with serving(tmp_path / "handover") as desk:
        await _refusals(desk, monkeypatch)


async def _refusals(desk: HandoverDesk, monkeypatch: pytest.MonkeyPatch) -> None:
    read, write = os.pipe()
    try:
        token = desk.issue(b"conn", ME)
        with anyio.fail_after(TIMEOUT), pytest.raises(TransportError, match="not a memory"):
            await pass_fds(desk, token, [read])
        monkeypatch.setattr(handover, "TICKET_TTL_S", 0.0)
        stale = desk.issue(b"conn", ME)
        fd = memory_file()
        try:
            with anyio.fail_after(TIMEOUT), pytest.raises(TransportError, match="no ticket"):
                await pass_fds(desk, stale, [fd])
        finally:
            os.close(fd)
    finally:
        os.close(read)
        os.close(write)
    with pytest.raises(RequestRejected, match="ipc://"):
        desk.issue(b"tcp", Peer("curve:" + "x" * 40))


def test_the_handover_socket_takes_the_endpoints_permissions(tmp_path: Path) -> None:
    """The handover socket is created with the permissions it is given, from the start."""
    with HandoverDesk(tmp_path / "handover", permissions=0o600) as desk:
        assert desk.path.stat().st_mode & 0o777 == 0o600
    assert not (tmp_path / "handover").exists()


def test_descriptors_in_flight_are_bounded(tmp_path: Path) -> None:
    """The desk's descriptor budget is at least what one engine may hand over."""
    with HandoverDesk(tmp_path / "handover") as desk:
        assert desk.max_fds >= handover.MAX_SEGMENTS

"""The disk tier's directory and segment files, and the I/O on them.

The directory belongs to one sidecar at a time: it is created 0700, must be owned by
this process's user and closed to others, and is held by an exclusive ``flock`` on its
``lock`` file for as long as the tier is open. Every file in it is created 0600 and
opened relative to the directory with ``O_NOFOLLOW``, so a symlink planted in it is
never followed.

A segment is a file of fixed size, allocated whole when it is created (so that a full
disk is found then, not halfway through a write), filled with records from its start
and never rewritten. I/O is direct (``O_DIRECT``) where the file system allows it, so
values do not also sit in the page cache; elsewhere (tmpfs, say) it is buffered, and
written pages are dropped from the cache once synced.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import stat
import threading
from pathlib import Path

from pipeline.backends.stores.disk.records import BLOCK
from pipeline.core.errors import StoreError
from pipeline.core.private import not_private

__all__ = ["AlignedBuffers", "Segment", "TierDirectory", "aligned"]

SEGMENT_NAME = re.compile(r"segment-(\d{10})\.kv")
LOCK_NAME = "lock"
SECRET_NAME = "secret"
SECRET_BYTES = 32


def aligned(size: int) -> mmap.mmap:
    """Zeroed memory of ``size`` bytes (rounded up to ``BLOCK``), page-aligned as direct
    I/O needs."""
    return mmap.mmap(-1, max(BLOCK, -(-size // BLOCK) * BLOCK))


class AlignedBuffers:
    """One aligned buffer per thread, grown to the largest size asked of it."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, size: int) -> mmap.mmap:
        buffer: mmap.mmap | None = getattr(self._local, "buffer", None)
        if buffer is None or len(buffer) < size:
            # The old buffer is dropped, not closed: views of it may still be alive.
            buffer = self._local.buffer = aligned(max(size, 1 << 20))
        return buffer


class Segment:
    """One segment file, open for reading and writing."""

    def __init__(self, number: int, fd: int, size: int, *, direct: bool) -> None:
        self.number = number
        self.fd = fd
        self.size = size
        self.direct = direct
        self.users = 0
        """Reads and writes in flight (counted on the event loop); a removed segment's
        file is closed when the last one ends."""
        self.removed = False
        self.closed = False

    def write(self, buffer: memoryview, offset: int) -> None:
        """Write ``buffer`` (BLOCK-aligned in memory and length) at ``offset`` and make it
        durable (``fdatasync``). Raises ``OSError``."""
        written = 0
        while written < len(buffer):
            count = os.pwrite(self.fd, buffer[written:], offset + written)
            if count <= 0:
                raise OSError(errno.EIO, f"short write to segment {self.number}")
            written += count
        os.fdatasync(self.fd)
        if not self.direct:
            os.posix_fadvise(self.fd, offset, len(buffer), os.POSIX_FADV_DONTNEED)

    def read(self, buffer: memoryview, offset: int) -> int:
        """Read up to ``len(buffer)`` bytes at ``offset``; the bytes read (fewer at the
        file's end). Raises ``OSError``."""
        done = 0
        while done < len(buffer):
            count = os.preadv(self.fd, [buffer[done:]], offset + done)
            if count == 0:
                break
            done += count
        return done

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self.fd)


class TierDirectory:
    """The tier's directory, locked for this process until ``close``.

    ``secret``: the tier's secret (``records``), made with the tier."""

    def __init__(self, path: Path, *, create: bool = True) -> None:
        """``create``: make the directory and its secret if they are missing (else a
        missing one is an error: an operator's command never makes a tier)."""
        self.path = path
        if create:
            _make_directory(path)
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise StoreError(f"cannot open the disk tier's directory {path} (a symlink is not "
                             f"followed): {exc}") from exc
        self._lock = -1
        try:
            _check_private(path, os.fstat(self._fd))
            self.secret = self._secret(create=create)  # made whole, or not: no lock needed
            self._lock = self._open_checked(LOCK_NAME, os.O_RDWR | os.O_CREAT)
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                holder = os.pread(self._lock, 32, 0).decode(errors="replace").strip()
                raise StoreError(
                    f"the disk tier at {path} belongs to another sidecar (pid "
                    f"{holder or '?'}), which holds its lock; give each sidecar a "
                    "store.disk.path of its own, or stop that one first") from exc
            os.ftruncate(self._lock, 0)
            os.pwrite(self._lock, f"{os.getpid()}\n".encode(), 0)
        except BaseException as exc:
            self.close()
            if isinstance(exc, OSError):
                raise StoreError(f"cannot open the disk tier at {path}: {exc}") from exc
            raise

    def _secret(self, *, create: bool) -> bytes:
        """The tier's secret: random bytes in a 0600 file, made once. It is written
        under a temporary name, synced, then linked into place, so that it is whole or
        absent whatever stops the process."""
        try:
            fd = self._open_checked(SECRET_NAME, os.O_RDONLY)
        except FileNotFoundError:
            if not create:
                raise StoreError(f"{self.path} is not a disk tier (no {SECRET_NAME} file)"
                                 ) from None
            self._make_secret()
            fd = self._open_checked(SECRET_NAME, os.O_RDONLY)
        try:
            secret = os.pread(fd, SECRET_BYTES + 1, 0)
        finally:
            os.close(fd)
        if len(secret) != SECRET_BYTES:
            raise OSError(errno.EINVAL, f"{SECRET_NAME} is not {SECRET_BYTES} bytes")
        return secret

    def _make_secret(self) -> None:
        temporary = f"{SECRET_NAME}.{os.getpid()}"
        fd = self._open_file(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            os.write(fd, os.urandom(SECRET_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(temporary, SECRET_NAME, src_dir_fd=self._fd, dst_dir_fd=self._fd,
                    follow_symlinks=False)
        except FileExistsError:
            pass
        finally:
            os.unlink(temporary, dir_fd=self._fd)
        os.fsync(self._fd)

    def segment_numbers(self) -> list[int]:
        """The numbers of the segment files present, in order."""
        found = []
        for name in os.listdir(self._fd):
            match = SEGMENT_NAME.fullmatch(name)
            if match is not None:
                found.append(int(match.group(1)))
        return sorted(found)

    def create_segment(self, number: int, size: int) -> Segment:
        """A new segment file of ``size`` bytes, allocated whole. Raises ``OSError``
        (``ENOSPC`` when the file system cannot hold it)."""
        name = _segment_name(number)
        fd, direct = self._open_segment(name, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            os.posix_fallocate(fd, 0, size)
            os.fsync(self._fd)  # the new name survives a power loss
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=self._fd)
            raise
        return Segment(number, fd, size, direct=direct)

    def open_segment(self, number: int) -> Segment:
        """An existing segment file. Raises ``OSError``."""
        fd, direct = self._open_segment(_segment_name(number), os.O_RDWR)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            os.close(fd)
            raise OSError(errno.EPERM, f"segment {number} is not a file this user owns")
        return Segment(number, fd, info.st_size // BLOCK * BLOCK, direct=direct)

    def remove_segment(self, number: int) -> None:
        """Unlink a segment file (a symlink under its name is unlinked, not followed)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_segment_name(number), dir_fd=self._fd)
        os.fsync(self._fd)

    def close(self) -> None:
        """Unlock and close the directory."""
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _open_file(self, name: str, flags: int) -> int:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self._fd)

    def _open_checked(self, name: str, flags: int) -> int:
        """A file of the directory that must be a regular file of this user's."""
        fd = self._open_file(name, flags)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            os.close(fd)
            raise OSError(errno.EPERM, f"{name} is not a regular file this user owns")
        return fd

    def _open_segment(self, name: str, flags: int) -> tuple[int, bool]:
        try:
            return self._open_file(name, flags | os.O_DIRECT), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
        return self._open_file(name, flags), False


def _segment_name(number: int) -> str:
    return f"segment-{number:010d}.kv"


def _make_directory(path: Path) -> None:
    """Create ``path`` 0700 (its parents as needed) unless it exists."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise StoreError(f"cannot create the disk tier's directory {path}: {exc}") from exc


def _check_private(path: Path, info: os.stat_result) -> None:
    """The opened directory must be this user's and closed to others."""
    problem = not_private(info)
    if problem is not None:
        raise StoreError(f"the disk tier's directory {path} {problem}")

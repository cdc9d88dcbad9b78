"""One sidecar per endpoint, and proof that a sidecar is gone.

A sidecar holds an exclusive ``flock`` on ``<socket path>.lock`` for its whole life and
refuses to start without it: an ipc bind would otherwise replace the socket of a sidecar
that is stalled but alive, and still maps engine memory. The lock goes with the process
(the kernel drops it on exit, however the process ends), so an engine that finds the
lock free knows that no sidecar of that endpoint can still touch its memory, and one
that sees a reply of a new epoch knows that the sidecar it registered with is gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

from pipeline.core.errors import ConfigError

__all__ = ["hold_endpoint", "lock_path", "sidecar_gone"]

LOCK_SUFFIX = ".lock"
LOCK_WAIT_S = 2.0
"""How long a starting sidecar retries a lock held briefly (an engine's probe)."""


def lock_path(endpoint: str) -> Path | None:
    """The lock file of an ``ipc://`` endpoint at an absolute path (None for any other:
    another transport, an abstract socket, which no second bind can replace, or a path
    relative to a working directory the engine may not share)."""
    if not endpoint.startswith("ipc://"):
        return None
    path = Path(endpoint.removeprefix("ipc://"))
    if not path.is_absolute():
        return None
    return _lock_file(path)


def _lock_file(socket_path: Path) -> Path:
    """The lock beside a socket file."""
    return socket_path.with_name(socket_path.name + LOCK_SUFFIX)


@contextlib.contextmanager
def hold_endpoint(socket_path: Path) -> Iterator[None]:
    """Hold the exclusive lock beside ``socket_path`` while inside; ``ConfigError`` if
    another process holds it (another sidecar serves the endpoint). It is created owner-only,
    never through a symbolic link, and left in place: removing it would let a second
    sidecar lock a new file while the first still holds the old one."""
    path = _lock_file(socket_path)
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        raise ConfigError(f"cannot open the endpoint's lock {path}: {exc}") from exc
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ConfigError(
                        f"another sidecar holds {path}: it serves this endpoint (stop it "
                        "first, or choose another server.endpoint)") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


def sidecar_gone(endpoint: str) -> bool:
    """Whether no sidecar can still be serving ``endpoint``: an ipc endpoint whose lock
    file exists and is held by no process. False wherever that cannot be told (another
    transport, no lock file, no permission to open it): the engine then waits for a
    reply, or a new epoch."""
    path = lock_path(endpoint)
    if path is None:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    finally:
        os.close(fd)

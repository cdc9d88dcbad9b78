"""Directories private to the sidecar's user: where it puts its sockets and its disk
tier, which another user who made them first could otherwise take."""

from __future__ import annotations

import os
import stat

__all__ = ["not_private"]


def not_private(status: os.stat_result) -> str | None:
    """Why a directory with ``status`` (of the directory itself, a link not followed)
    is not private to this process's user, or None if it is: it must be a directory,
    owned by this user, and closed to others."""
    if not stat.S_ISDIR(status.st_mode):
        return "is not a directory (a symlink is not followed)"
    if status.st_uid != os.geteuid():
        return f"belongs to uid {status.st_uid}, not to this user ({os.geteuid()})"
    if status.st_mode & 0o077:
        return (f"is open to other users (mode {stat.S_IMODE(status.st_mode):o}); "
                "make it 0700")
    return None

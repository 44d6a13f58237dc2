"""How programs talk to a running acpfs mount: the ``acpfs`` command (``cli``) and
``acpfs.torch`` both go through here.

Owns: the mount table (one parser of ``/proc/self/mountinfo``), reading the control
attributes whose names ``control`` defines (the status document, a path's sequence number,
the pending files, preloading a file), telling a stale mount (its daemon is gone) from a live
one, waiting until a mount has persisted a sequence number, and the one error type for an
operation on a mount that failed (``Failure``).

Every function that reads the mount table takes its text as an argument too (``None``: read
``/proc/self/mountinfo``), so it can be tested without a mount. Nothing here imports numpy,
pyfuse3 or torch, or starts a thread: ``cli`` forks the daemon after importing this, and
training processes import it through ``acpfs.torch``.
"""

from __future__ import annotations

import errno
import json
import os
import time
from typing import Any, Callable

from ..core import control
from ..errors import Failure

DEAD_ERRNOS = (errno.ENOTCONN, errno.ECONNABORTED)   # the daemon of the mount is gone
POLL_FAST, POLL_SLOW, FAST_FOR = 0.02, 0.2, 2.0       # status polling: fast for FAST_FOR seconds


class StaleMount(Failure):
    """The daemon of the mount is gone (ENOTCONN or ECONNABORTED): a stale mount."""


class WaitTimeout(Failure):
    """``wait_applied`` gave up; ``status`` is the last status document it read."""

    def __init__(self, message: str, status: dict[str, Any]) -> None:
        super().__init__(message)
        self.status = status


# -- the control attributes ----------------------------------------------------------------------
def _getxattr(path: str, name: bytes, failed: str, stale: str | None = None) -> bytes:
    """``os.getxattr``; an error raises Failure("``failed``: strerror"), or StaleMount (with
    the message ``stale`` if given) when the mount's daemon is gone."""
    try:
        return os.getxattr(path, name)
    except OSError as e:
        if e.errno in DEAD_ERRNOS:
            raise StaleMount(stale or f"{failed}: {e.strerror}", e) from None
        raise Failure(f"{failed}: {e.strerror}", e) from None


def read_status(mountpoint: str) -> dict[str, Any]:
    """The status document of the mount (schema in docs/status.md)."""
    return json.loads(_getxattr(
        mountpoint, control.STATUS, f"cannot read the status of {mountpoint}",
        f"the acpfs daemon of {mountpoint} is gone (stale mount); "
        f"run 'acpfs umount {mountpoint}' to clean it up"))


def is_stale(mountpoint: str) -> bool:
    """Whether ``mountpoint`` is an acpfs mount whose daemon is gone (asks the status
    attribute: never answered from the kernel's caches, and never waits on the backing)."""
    try:
        _getxattr(mountpoint, control.STATUS, "")
    except StaleMount:
        return True
    except Failure:
        return False
    return False


def read_seq(path: str) -> tuple[int, int]:
    """(seq, open_dirty) of ``path`` on a mount: everything under it is durable once the
    mount's ``queue.applied_seq`` reaches seq, except the ``open_dirty`` files still open with
    unsaved data (persisted at their last close). A symbolic link is asked through the
    directory holding it (symbolic links carry no user xattrs)."""
    target = os.path.dirname(os.path.abspath(path)) if os.path.islink(path) else path
    info = json.loads(_getxattr(target, control.SEQ, f"cannot read the sequence number of {path}"))
    return info["seq"], info["open_dirty"]


def read_files(mountpoint: str) -> dict[str, Any]:
    """The files of the mount not yet persisted, with their state, sorted by path: one
    listing, read page by page (``control.Listings``)."""
    what = f"cannot read the pending files of {mountpoint}"
    for attempt in range(3):
        try:
            page = json.loads(_getxattr(mountpoint, control.FILES, what))
            files = page["files"]
            while page.get("next"):
                page = json.loads(_getxattr(mountpoint, page["next"].encode(), what))
                files.extend(page["files"])
            return {"files": files, "total": len(files), "truncated": False}
        except Failure as e:
            if e.errno != errno.EAGAIN or attempt == 2:   # EAGAIN: the listing expired
                raise
    raise AssertionError("not reached")


def preload(path: str) -> bool:
    """Read the file ``path`` into its mount's cache; False when the cache cannot hold it."""
    try:
        _getxattr(path, control.PRELOAD, f"cannot preload {path}")
    except Failure as e:
        if e.errno == errno.ENOSPC:
            return False
        raise
    return True


# -- waiting for durability ----------------------------------------------------------------------
def wait_applied(mountpoint: str, seq: int, timeout: float | None = None,
                 progress: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Block until the mount has applied ``seq`` (its status's ``queue.applied_seq`` reaches
    it): every change numbered up to ``seq`` is durable in the backing.

    ``progress`` is called with each status document read while ``seq`` is not applied yet.
    Raises WaitTimeout once ``timeout`` seconds have passed without it (a status is read at
    least once), StaleMount when the daemon is gone, Failure when the status cannot be read.
    """
    start = time.monotonic()
    while True:
        st = read_status(mountpoint)
        if st["queue"]["applied_seq"] >= seq:
            return
        if progress is not None:
            progress(st)
        if timeout is not None and time.monotonic() - start > timeout:
            raise WaitTimeout(f"{mountpoint}: sequence number {seq} not persisted after "
                              f"{timeout:g}s", st)
        time.sleep(POLL_FAST if time.monotonic() - start < FAST_FOR else POLL_SLOW)

"""How programs talk to a running acpfs mount: the ``acpfs`` command (``cli``) and
``acpfs.torch`` both go through here.

Owns: reading the control attributes whose names ``core.control`` defines (the status
document, a path's sequence number, the pending files, preloading a file), telling a stale
mount (its daemon is gone) from a live one and the one line for a path on it (``gone``),
preloading files and directories into their mount's cache (``preload``), and waiting until a
mount has persisted a sequence number. The mount table is ``acpfs.mounttable``; the error
type is ``acpfs.errors.Failure``.

Nothing here imports numpy, pyfuse3 or torch, or starts a thread on import (``preload`` asks
in threads of its own while it runs): ``cli`` forks the daemon after importing this, and
training processes import it through ``acpfs.torch``.
"""

from __future__ import annotations

import concurrent.futures
import errno
import json
import os
import stat
import time
from typing import Any, Callable, NamedTuple

from .. import mounttable
from ..config import format_size
from ..core import control
from ..errors import Failure, UsageError
from .progress import Progress, bar

DEAD_ERRNOS = (errno.ENOTCONN, errno.ECONNABORTED)   # the daemon of the mount is gone
POLL_FAST, POLL_SLOW, FAST_FOR = 0.02, 0.2, 2.0       # status polling: fast for FAST_FOR seconds


class StaleMount(Failure):
    """The daemon of the mount is gone (ENOTCONN or ECONNABORTED): a stale mount."""


class WaitTimeout(Failure):
    """``wait_applied`` gave up; ``status`` is the last progress document it read."""

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


def read_progress(mountpoint: str) -> dict[str, Any]:
    """The progress document of the mount (docs/status.md, "Progress"): what a wait for
    durability shows, cheap to ask for at any rate. A daemon older than it answers ENODATA:
    its whole status document then, which holds the same keys."""
    try:
        return json.loads(_getxattr(
            mountpoint, control.PROGRESS, f"cannot read the progress of {mountpoint}",
            f"the acpfs daemon of {mountpoint} is gone (stale mount); "
            f"run 'acpfs umount {mountpoint}' to clean it up"))
    except Failure as e:
        if isinstance(e, StaleMount) or e.errno != errno.ENODATA:
            raise
        return read_status(mountpoint)


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


def _read_listing(mountpoint: str, attr: bytes, key: str, what: str) -> tuple[dict, list]:
    """One listing read page by page (``control.Listings``): its first page, and every
    entry of every page under ``key``. A listing that expired meanwhile is started again."""
    for attempt in range(3):
        try:
            first = page = json.loads(_getxattr(mountpoint, attr, what))
            entries = page[key]
            while page.get("next"):
                page = json.loads(_getxattr(mountpoint, page["next"].encode(), what))
                entries.extend(page[key])
            return first, entries
        except Failure as e:
            if e.errno != errno.EAGAIN or attempt == 2:   # EAGAIN: the listing expired
                raise
    raise AssertionError("not reached")


def read_files(mountpoint: str) -> dict[str, Any]:
    """The files of the mount not yet persisted, with their state, sorted by path."""
    _, files = _read_listing(mountpoint, control.FILES, "files",
                             f"cannot read the pending files of {mountpoint}")
    return {"files": files, "total": len(files), "truncated": False}


def read_peers(mountpoint: str) -> dict[str, Any]:
    """The status's ``peers`` with every other node's record (``user.acpfs.peers``; the
    status holds only the records that fit in it)."""
    first, records = _read_listing(mountpoint, control.PEERS, "peers",
                                   f"cannot read the node records of {mountpoint}")
    return {**first["doc"], "peers": records}


def preload_file(path: str) -> bool:
    """Read the file ``path`` into its mount's cache; False when the cache cannot hold it."""
    try:
        _getxattr(path, control.PRELOAD, f"cannot preload {path}")
    except Failure as e:
        if e.errno == errno.ENOSPC:
            return False
        raise
    return True


# -- paths on a mount, preloading ------------------------------------------------------------
def gone(path: str, mount: str | None = None) -> Failure:
    """The one line every command gives for a path on a stale mount (its daemon is gone)."""
    if mount is None:
        try:
            mount = mounttable.mount_of(path)
        except Failure:
            mount = path
    return Failure(f"{path}: the daemon of the acpfs mount {mount} is gone; run "
                   f"'acpfs umount {mount}'")


def existing(path: str) -> None:
    """``path`` exists (a UsageError if not); one on a mount whose daemon is gone is named
    as such (a Failure), not as a missing path."""
    try:
        os.lstat(path)
    except OSError as e:
        if e.errno in DEAD_ERRNOS:
            raise gone(path) from None
        raise UsageError(f"{path} does not exist") from None


def live_mount(path: str) -> str:
    """The live acpfs mount holding ``path``, which exists. A stale mount is a Failure
    (``gone``) even when the kernel still answers ``lstat`` from its caches: the status
    attribute asked here never is."""
    existing(path)
    mount = mounttable.mount_of(path)
    if is_stale(mount):
        raise gone(path, mount)
    return mount


def files_under(paths: list[str]) -> list[tuple[str, int]]:
    """Regular files named by ``paths`` (directories walked, symlinks not followed), with sizes."""
    out = []

    def unreadable(e: OSError) -> None:   # os.walk skips what it cannot list unless told
        if e.errno in DEAD_ERRNOS:
            raise gone(e.filename or path) from None
        raise e
    for path in paths:
        live_mount(path)
        if os.path.isdir(path) and not os.path.islink(path):
            for dirpath, _, names in os.walk(path, onerror=unreadable):
                for name in sorted(names):
                    p = os.path.join(dirpath, name)
                    st = os.lstat(p)
                    if stat.S_ISREG(st.st_mode):
                        out.append((p, st.st_size))
        else:
            st = os.stat(path)
            if not stat.S_ISREG(st.st_mode):
                raise UsageError(f"{path} is not a regular file or a directory")
            out.append((path, st.st_size))
    return out


PRELOAD_FILES = 4   # files ``preload`` asks for at once (the daemon fetches each in ranges)


class Preloaded(NamedTuple):
    """What ``preload`` did: files and bytes now in the cache, files left out for want of
    room (with the reason), files not tried because the byte budget was spent."""
    files: int
    nbytes: int
    left_out: list[str]
    over_budget: list[str]


def preload(paths: list[str], quiet: bool = False, max_bytes: int | None = None) -> Preloaded:
    """Read files into their mount's cache, PRELOAD_FILES at once, in the order given, at
    most what the cache holds and at most ``max_bytes`` (files from the first one past the
    budget on are not tried). A file that does not fit is left out and the rest still
    tried. Progress (unless ``quiet``): bytes fetched from the backing and their rate, from
    the mounts' ``cold_reads.fetched_bytes``."""
    files = files_under(paths)
    limits: dict[str, int] = {}
    planned: list[tuple[str, int]] = []
    left_out: list[str] = []
    over_budget: list[str] = []
    budget = max_bytes
    for i, (path, size) in enumerate(files):
        if budget is not None and size > budget:
            over_budget = [p for p, _ in files[i:]]
            break
        mount = mounttable.mount_of(path)
        if mount not in limits:
            limits[mount] = read_status(mount)["cache"]["limit_bytes"]
        if size > limits[mount]:
            left_out.append(f"{path}: {format_size(size)}, but only {format_size(limits[mount])} of "
                            f"the cache is left for preloading")
            continue
        limits[mount] -= size
        if budget is not None:
            budget -= size
        planned.append((path, size))
    done_files, done_bytes, full = _preload_all(planned, limits, quiet)
    left_out += [f"{path}: the cache is full" for path in full]
    return Preloaded(done_files, done_bytes, left_out, over_budget)


def _fetched(mounts) -> int:
    return sum(read_status(m)["cold_reads"].get("fetched_bytes", 0) for m in mounts)


def _preload_all(planned: list[tuple[str, int]], mounts: dict[str, int], quiet: bool) -> tuple[int, int, list[str]]:
    """``preload_file`` of each, PRELOAD_FILES at once; (files loaded, their bytes, files
    the cache had no room for). The first error stops the rest and is raised."""
    total = sum(size for _, size in planned)
    prog = Progress() if not quiet and planned else None
    before = _fetched(mounts) if prog else 0
    start = time.monotonic()
    done_files = done_bytes = 0
    full: list[str] = []
    with concurrent.futures.ThreadPoolExecutor(PRELOAD_FILES, thread_name_prefix="acpfs-preload") as pool:
        futures = {pool.submit(preload_file, path): (path, size) for path, size in planned}
        pending = set(futures)
        try:
            while pending:
                finished, pending = concurrent.futures.wait(pending, timeout=0.5)
                for f in finished:
                    path, size = futures[f]
                    if f.result():
                        done_files += 1
                        done_bytes += size
                    else:
                        full.append(path)
                if prog:
                    fetched = _fetched(mounts) - before
                    shown = min(total, max(done_bytes, fetched))
                    rate = fetched / max(1e-6, time.monotonic() - start)
                    prog.update(f"preload: {bar(shown / max(1, total))} {done_files}/{len(planned)} files, "
                                f"{format_size(shown)} of {format_size(total)}, "
                                f"fetched at {format_size(rate)}/s")
        except BaseException:
            for f in pending:
                f.cancel()
            raise
        finally:
            if prog:
                prog.done()
    return done_files, done_bytes, full


# -- waiting for durability ----------------------------------------------------------------------
def wait_applied(mountpoint: str, seq: int, timeout: float | None = None,
                 progress: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Block until the mount has applied ``seq`` (its progress document's
    ``queue.applied_seq`` reaches it): every change numbered up to ``seq`` is durable in the
    backing.

    ``progress`` is called with each progress document read while ``seq`` is not applied yet.
    Raises WaitTimeout once ``timeout`` seconds have passed without it (a status is read at
    least once), StaleMount when the daemon is gone, Failure when the status cannot be read.
    """
    start = time.monotonic()
    while True:
        st = read_progress(mountpoint)
        if st["queue"]["applied_seq"] >= seq:
            return
        if progress is not None:
            progress(st)
        if timeout is not None and time.monotonic() - start > timeout:
            raise WaitTimeout(f"{mountpoint}: sequence number {seq} not persisted after "
                              f"{timeout:g}s", st)
        time.sleep(POLL_FAST if time.monotonic() - start < FAST_FOR else POLL_SLOW)

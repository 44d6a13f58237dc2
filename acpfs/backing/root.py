"""The backing root: its descriptor, how every directory is reached from it, and a backing
that went away and came back.

What it owns (``RootDir``, a piece of ``Backing``): the root descriptor ``root_fd``, the
descriptors of roots that went stale (closed at ``close``), and the count of reopens that
``status`` shows. Every directory is reached from the root one name at a time
(``open_dir``: ``openat(O_NOFOLLOW | O_DIRECTORY)``, names checked), never through a symlink
and never out of the root; ``with self.dir(comps) as dfd:`` is how the other pieces use one
(closed when the block ends). Where the kernel has openat2 (and the extension
acpfs/backing/_beneath.c is built) the whole path is opened in one call that promises the
same (``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``); after any error of it the walk runs, and
tells which name was missing. A backing that is itself a mount (NFS, SFS, a FUSE store) can go away and be
mounted again at the same path; its descriptors then answer ENOTCONN/ESTALE/ENODEV, and the
root is opened again by path (``reopen``), but only once a filesystem is mounted there
again: never the empty directory under it. ``_stale_retry`` is the convention every other
piece follows: a call that met a stale root is made once more after a reopen.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from typing import Iterator, overload

from .. import mounttable
from .names import STALE, Comps, MissingDir, check_name

try:
    from . import _beneath
except ImportError:   # not built: every directory is walked to
    _beneath = None
HAVE_BENEATH = _beneath is not None

log = logging.getLogger("acpfs.backing")
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# errors of opening a directory that mean "not there" to a caller of ``RootDir.dir``
Absent = type[OSError] | tuple[type[OSError], ...]


class RootDir:
    """The root of the backing directory at ``root`` and the directories under it."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        # A backing that is itself a mount can be mounted again (module docstring): the root
        # is opened again only once a filesystem is mounted there again
        self._root_is_mount = self._is_mount_point(self.root_fd)
        # a local filesystem with nothing mounted below: calls to it need no worker thread
        # (core/backcalls.py); None where a call may wait for a server
        self.local_fstype = mounttable.local_fstype(root)
        self._old_roots: list[int] = []   # closed at close(): another thread may hold one
        self._reopen_lock = threading.Lock()
        self.reopened = 0
        self.last_reopen: dict | None = None
        self.beneath = HAVE_BENEATH   # openat2 works here (False after ENOSYS)

    def close(self) -> None:
        for fd in [self.root_fd, *self._old_roots]:
            os.close(fd)

    def _is_mount_point(self, fd: int) -> bool:
        parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
        try:
            return os.fstat(parent).st_dev != os.fstat(fd).st_dev
        finally:
            os.close(parent)

    def reopen(self, why: BaseException) -> bool:
        """The root descriptor went stale (``why``): open the root again by path. True if it
        was; False while nothing is mounted there again (the caller retries later)."""
        stale = self.root_fd
        with self._reopen_lock:
            if self.root_fd != stale:
                return True                    # another thread did it meanwhile
            try:
                os.fstat(self.root_fd)
                return True                    # the root is fine: another descriptor was stale
            except OSError:
                pass
            try:
                fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as e:
                log.warning("the backing %s is not reachable (%s); trying again later", self.root, e)
                return False
            try:
                if self._root_is_mount and not self._is_mount_point(fd):
                    log.warning("the backing %s is not mounted again yet (%s); trying again later",
                                self.root, why)
                    os.close(fd)
                    return False
            except OSError:
                os.close(fd)
                return False
            self._old_roots.append(self.root_fd)
            self.root_fd = fd
            self.reopened += 1
            self.last_reopen = {"at": round(time.time(), 3), "why": str(why)}
            log.warning("the backing %s went away and is back (%s): opened it again by path",
                        self.root, why)
            return True

    def _stale_retry(self, fn, *args):
        try:
            return fn(*args)
        except OSError as e:
            if e.errno not in STALE or not self.reopen(e):
                raise
            return fn(*args)

    def open_dir(self, comps: Comps) -> int:
        """Open the directory at ``comps`` (names from the root) without following symlinks.
        Raises MissingDir when a component does not exist. A stale root is opened again."""
        return self._stale_retry(self._open_dir, comps)

    def _open_dir(self, comps: Comps) -> int:
        for name in comps:
            check_name(name)
        if self.beneath:
            try:
                return self._open_beneath(comps, DIR_FLAGS)
            except OSError as e:
                if e.errno == errno.ENOSYS:
                    self.beneath = False
                    log.info("openat2 is not available here: directories of the backing are "
                             "opened one name at a time")
            # the walk tells which name is missing or blocked, and meets a stale root
        return self._walk(comps)

    def _open_beneath(self, comps: Comps, flags: int) -> int:
        """``comps`` (checked names) opened from the root in one call (module docstring)."""
        return _beneath.open(self.root_fd, b"/".join(comps) or b".", flags)

    def open_in(self, comps: Comps, name: bytes, flags: int) -> int:
        """``name`` in the directory at ``comps`` opened with ``flags`` (O_NOFOLLOW and
        O_CLOEXEC added): one call where openat2 works, else the directory opened first.
        Errors as ``open_dir`` and ``os.open`` give them."""
        check_name(name)
        flags |= os.O_NOFOLLOW | os.O_CLOEXEC
        if self.beneath:
            for c in comps:
                check_name(c)
            try:
                return self._open_beneath([*comps, name], flags)
            except OSError:
                pass   # as the steps below say it (MissingDir, ELOOP, a stale root)
        with self.dir(comps) as dfd:
            return os.open(name, flags, dir_fd=dfd)

    def _walk(self, comps: Comps) -> int:
        # a new open file description, not a dup: a listing reads from its own offset (a
        # dup shares the root's, and a second listing of the root came back empty), and a
        # stale root shows here
        fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.root_fd)
        try:
            for depth, name in enumerate(comps):
                try:
                    nfd = os.open(name, DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    raise MissingDir(comps, depth) from None
                except OSError as e:
                    if e.errno not in (errno.ENOTDIR, errno.ELOOP):
                        raise
                    raise MissingDir(comps, depth, blocked=True) from None
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        return fd

    @overload
    def dir(self, comps: Comps) -> contextlib.AbstractContextManager[int]: ...
    @overload
    def dir(self, comps: Comps, absent: Absent) -> contextlib.AbstractContextManager[int | None]: ...

    def dir(self, comps: Comps, absent: Absent = ()) -> contextlib.AbstractContextManager[int | None]:
        """``with self.dir(comps) as dfd:`` the descriptor of the directory at ``comps``
        (``open_dir``: MissingDir, a stale root opened again), closed when the block ends,
        however it ends. An error of opening it that is one of ``absent`` makes ``dfd`` None
        (nothing to close) rather than propagate; errors of the block always do."""
        return self._dir(comps, absent)

    @contextlib.contextmanager
    def _dir(self, comps: Comps, absent: Absent) -> Iterator[int | None]:
        try:
            fd: int | None = self.open_dir(comps)
        except absent:
            fd = None
        if fd is None:
            yield None
            return
        try:
            yield fd
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _two_dirs(self, scomps: Comps, dcomps: Comps) -> Iterator[tuple[int, int]]:
        """Descriptors of two directories (one, twice, if they are the same), closed after."""
        with self.dir(scomps) as sfd:
            if dcomps == scomps:
                yield sfd, sfd
            else:
                with self.dir(dcomps) as dfd:
                    yield sfd, dfd

    def stat_root(self) -> os.stat_result:
        return self._stale_retry(lambda: os.fstat(self.root_fd))

    def statvfs(self) -> os.statvfs_result:
        return self._stale_retry(lambda: os.fstatvfs(self.root_fd))

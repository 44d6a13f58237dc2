"""Memory files: the content store of the passthrough path (see api.py).

Each cached file's bytes live in a file of their own, ``<cache dir>/files/<id>`` (tmpfs by
default). The kernel reads, writes and maps them directly for opens that the daemon passes
through (``Handles.open``: FUSE_PASSTHROUGH, ``backing_id``), and the daemon uses the same
descriptor for what it still does itself (reads and writes of opens it serves, uploads,
truncate, fallocate). Memory files are named files, not memfds, so that the journal can
name them (``ref``: ``[id]``) and a daemon killed with SIGKILL leaves them for the next one.

Sharing: a handle (``MemFile``) is reference counted. A snapshot or a journal record holds
one reference while it needs the bytes; content with two references is never written in
place: a write through the daemon copies the file first, and an open for writing that the
kernel will pass through copies it at the open (``private``), so the holders keep theirs.

Accounting: ``used`` is the sum of what each memory file holds (pages, as ``st_blocks``
says). Writes the kernel passes through are counted when the daemon next looks at the file
(``sync``: at getattr, close and release), so the bound is applied when files are opened
and when the daemon is asked for space, not at every write.

Invariant: every memory file on disk is either referenced by a live handle, or (after a
crash) named by the journal and claimed by recovery; anything else is removed at mount.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import threading
from typing import Callable, Iterator

from ..config import ram_filesystem
from .api import CacheFull, copy_fd, copy_range, in_ranges

log = logging.getLogger(__name__)

PAGE = os.sysconf("SC_PAGE_SIZE")
DIRNAME = "files"
UPLOAD_PIECE = 64 << 20
OPEN_FDS = 256   # descriptors of memory files kept open for the FUSE thread (``_fd``)


class MemFile:
    """One memory file: who holds it, and its descriptor while one is open (``MemFiles._fd``)."""
    __slots__ = ("id", "fd", "refs", "charged", "backing_id", "seen", "snapped")

    def __init__(self, id: int, fd: int) -> None:
        self.id = id
        self.fd = fd           # -1: closed; opened again by name when needed
        self.refs = 1          # (lock) handles given out: the node's, snapshots', records'
        self.charged = 0       # (lock) bytes counted in MemFiles.used
        self.backing_id = 0    # the kernel's id for it (FUSE_DEV_IOC_BACKING_OPEN); 0: none
        self.seen: tuple[int, int, int] | None = None   # (size, mtime, ctime) at the last look
                                                         # (Files.sync_content)
        self.snapped: tuple[int, int, int] | None = None   # seen, at the last snapshot of
                                                           # its file while open (Files.snapshot)


def _pages(n: int) -> int:
    return -(-n // PAGE) * PAGE


class MemFiles:
    kind = "memory files"
    unit = 0

    def __init__(self, cache_dir: str, limit: int,
                 unregister: Callable[[int], None] | None = None) -> None:
        self.dir = os.path.join(cache_dir, DIRNAME)
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        self.dir_fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.limit = limit
        self.peak = 0
        self.in_ram = ram_filesystem(self.dir) is not None
        self._used = 0
        self._next_id = 1
        self._claimed: dict[int, MemFile] = {}
        # The FUSE thread's open descriptors, least recently used first: a mount caches
        # more files than a process may have descriptors. Worker threads open their own
        # (``_opened``), so that none is closed under them.
        self._fds: collections.OrderedDict[int, MemFile] = collections.OrderedDict()
        self._lock = threading.Lock()    # ids, the used counter and _fds: uploads drop files too
        self.unregister = unregister

    @property
    def used(self) -> int:
        return self._used

    def free_bytes(self) -> int:
        return max(0, self.limit - self._used)

    def _charge(self, mf: MemFile, nbytes: int) -> None:
        with self._lock:
            self._used += nbytes - mf.charged
            mf.charged = nbytes
            if self._used > self.peak:
                self.peak = self._used

    # -- files -------------------------------------------------------------------------
    def _new(self, keep_fd: bool = True) -> MemFile:
        """A new empty memory file; its descriptor kept for the FUSE thread, or (any other
        thread: ``keep_fd`` False) closed at once."""
        with self._lock:
            id = self._next_id
            self._next_id += 1
        fd = os.open(str(id), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=self.dir_fd)
        mf = MemFile(id, fd)
        if keep_fd:
            self._keep_fd(mf)
        else:
            os.close(fd)
            mf.fd = -1
        return mf

    def _open_by_name(self, mf: MemFile) -> int:
        return os.open(str(mf.id), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.dir_fd)

    def _keep_fd(self, mf: MemFile) -> None:
        with self._lock:
            self._fds[mf.id] = mf
            while len(self._fds) > OPEN_FDS:
                _, old = self._fds.popitem(last=False)
                os.close(old.fd)
                old.fd = -1

    def _fd(self, mf: MemFile) -> int:
        """FUSE thread: a descriptor of ``mf``, valid until the next call here."""
        if mf.fd < 0:
            mf.fd = self._open_by_name(mf)
            self._keep_fd(mf)
        else:
            with self._lock:
                self._fds.move_to_end(mf.id)
        return mf.fd

    @contextlib.contextmanager
    def _opened(self, mf: MemFile) -> Iterator[int]:
        """Any thread: a descriptor of its own, closed at the end."""
        fd = self._open_by_name(mf)
        try:
            yield fd
        finally:
            os.close(fd)

    def _free(self, mf: MemFile) -> None:
        self._charge(mf, 0)
        if mf.backing_id and self.unregister is not None:
            try:
                self.unregister(mf.backing_id)
            except OSError as e:
                log.debug("backing id %d of memory file %d: %s", mf.backing_id, mf.id, e)
        mf.backing_id = 0
        with self._lock:
            if self._fds.pop(mf.id, None) is not None:
                os.close(mf.fd)
            mf.fd = -1
        try:
            os.unlink(str(mf.id), dir_fd=self.dir_fd)
        except FileNotFoundError:
            pass

    def sync(self, mf: MemFile) -> os.stat_result:
        """The file as it is now (the kernel may have written it); counts its pages."""
        st = os.fstat(self._fd(mf))
        self._charge(mf, st.st_blocks * 512)
        return st

    def descriptor(self, mf: MemFile) -> int:
        """FUSE thread: a descriptor of the memory file, valid until the next call into the
        store (the attribute table duplicates it: fuse/attrtable.py)."""
        return self._fd(mf)

    def shared(self, mf: MemFile) -> bool:
        return mf.refs > 1

    def private(self, mf: MemFile, size: int) -> MemFile:
        """A handle nobody else holds with the same bytes: ``mf`` itself, or a copy."""
        if mf.refs == 1:
            return mf
        new = self.copy(mf, size)
        self.drop(mf)
        return new

    def copy(self, mf: MemFile, size: int) -> MemFile:
        """Any thread: a new memory file with the first ``size`` bytes of ``mf``."""
        new = self._new(keep_fd=False)
        try:
            with self._opened(mf) as src, self._opened(new) as dst:
                copy_fd(src, dst, size)
                os.ftruncate(dst, size)
        except BaseException:
            self._free(new)
            raise
        self._charge(new, _pages(size))
        return new

    # -- the store interface (api.Store) ------------------------------------------------
    def empty(self) -> MemFile:
        return self._new()

    def alloc(self, size: int) -> MemFile:
        if _pages(size) > self.free_bytes():
            raise CacheFull()
        mf = self._new()
        self._charge(mf, _pages(size))
        return mf

    def fill(self, mf: MemFile, src_fd: int, size: int, backing, fast=None, progress=None,
             drop=None) -> None:
        with self._opened(mf) as fd:
            os.ftruncate(fd, size)
            in_ranges(size, lambda off, n: copy_range(src_fd, fd, off, n), fast=fast,
                      progress=progress, src=src_fd, drop=drop)

    @contextlib.contextmanager
    def sink(self, mf: MemFile, size: int) -> Iterator[Callable[[int, memoryview], None]]:
        with self._opened(mf) as fd:
            os.ftruncate(fd, size)

            def put(off: int, data: memoryview) -> None:
                done = 0
                while done < len(data):
                    done += os.pwrite(fd, data[done:], off + done)
            yield put

    def need(self, mf: MemFile, off: int, end: int) -> int:
        size = os.fstat(self._fd(mf)).st_size
        grow = max(0, _pages(end) - max(mf.charged, _pages(size)))
        return grow + (_pages(size) if mf.refs > 1 else 0)

    def need_truncate(self, mf: MemFile, size: int, new: int) -> int:
        return _pages(min(size, new)) if mf.refs > 1 else 0

    def read(self, mf: MemFile, off: int, end: int) -> bytes:
        return os.pread(self._fd(mf), end - off, off)

    def write(self, mf: MemFile, off: int, data) -> MemFile:
        if mf.refs != 1:   # (its size only matters for a copy)
            mf = self.private(mf, os.fstat(self._fd(mf)).st_size)
        view = memoryview(data)
        fd = self._fd(mf)
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], off + done)
        end = off + len(view)
        if _pages(end) > mf.charged:
            self._charge(mf, _pages(end))
        return mf

    def truncate(self, mf: MemFile, size: int, new: int) -> MemFile:
        mf = self.private(mf, min(size, new))
        os.ftruncate(self._fd(mf), new)
        if new < size:
            self._charge(mf, _pages(new))
        return mf

    def share(self, mf: MemFile) -> MemFile:
        mf.refs += 1
        return mf

    def drop(self, mf: MemFile) -> None:
        mf.refs -= 1
        if mf.refs == 0:
            self._free(mf)

    def nbytes(self, mf: MemFile) -> int:
        return mf.charged

    @contextlib.contextmanager
    def source(self, mf: MemFile, size: int) -> Iterator[tuple[int, Iterator[tuple[int, int, int]]]]:
        # in pieces, so that an upload told to stop stops soon
        with self._opened(mf) as fd:
            yield fd, ((off, off, min(UPLOAD_PIECE, size - off)) for off in range(0, size, UPLOAD_PIECE))

    def ref(self, mf: MemFile) -> list[int]:
        return [mf.id]

    def claim_refs(self, refs: list[list[int]]) -> None:
        """Hold the memory files the records to replay name (one reference per record); the
        rest, left by a dead daemon, are removed."""
        for ref in refs:
            if not ref:
                continue   # no content here: a file written through to the backing
            if len(ref) != 1:
                raise ValueError(f"journal names {ref!r}, not one memory file")
            id = ref[0]
            mf = self._claimed.get(id)
            if mf is None:
                mf = self._claimed[id] = MemFile(id, -1)
                mf.refs = 0
                try:
                    self.sync(mf)
                except FileNotFoundError:
                    raise OSError(errno.ENOENT, f"memory file {id} named by the journal is gone "
                                  f"from {self.dir}") from None
            mf.refs += 1
        for name in os.listdir(self.dir_fd):
            if not name.isdigit():
                continue
            if int(name) not in self._claimed:
                os.unlink(name, dir_fd=self.dir_fd)
            self._next_id = max(self._next_id, int(name) + 1)

    def adopt(self, ref: list[int]) -> MemFile:
        return self._claimed[ref[0]] if ref else self.empty()

    def backing(self, mf: MemFile, register: Callable[[int], int]) -> int:
        """The kernel's id for ``mf``, registered at the first open passed through to it and
        kept until the file is freed."""
        if not mf.backing_id:
            mf.backing_id = register(self._fd(mf))
        return mf.backing_id

    def close(self) -> None:
        """At unmount: the descriptors go; the files stay for a journal that names them."""
        for mf in self._fds.values():
            os.close(mf.fd)
            mf.fd = -1
        self._fds.clear()
        os.close(self.dir_fd)

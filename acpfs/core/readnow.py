"""READs answered at once: ``ReadsNow``.

Owns the buffer that READs of backing files are read into, reused from READ to READ (the
extension copies the reply into the device before the next request is read), and the
choice of which READs are answered without a coroutine, from the extension's hook
(acpfs/fuse/_atonce.c, by way of ``AtOnce.read``, acpfs/fuse/atonce.py).

Why: on the daemon's path (no passthrough: kernels before 6.9, no root) every byte a program
reads goes through a READ request. Each was a coroutine, and each READ of a backing file (a
file the cache does not hold) a trip to a worker thread that returned a new 1 MiB ``bytes``,
whose pages, fresh each time, cost page faults (docs/benchmarks.md, "Reads the daemon
serves, answered at once").

What: a cached file's bytes, as ``Handles.read`` gives them; a backing file's where the
backing is local (``BackingCalls``' rule: a read from NFS may wait for the server before it
looks at the page cache) and its page cache holds the whole range (``preadv2`` with
RWF_NOWAIT, which never waits for the disk). A read it cuts short is answered only where it
ends at the end of the file: the kernel takes a short reply as the end of the file and fills
the rest of a page-cache page with zeros. Anything else returns None, and ``Handles.read``
takes the request from the start (a staged file, a version to reopen, bytes the backing must
fetch: in a worker thread there).

Threads: the trio thread (the hook runs inside pyfuse3's request loop, with the GIL held).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..cache.files import Files
    from .backcalls import BackingCalls


class ReadsNow:
    def __init__(self, files: Files, calls: BackingCalls) -> None:
        self.files = files
        self.backing = files.backing
        self.calls = calls
        self._buf = bytearray(0)

    def read(self, h, off: int, size: int) -> bytes | memoryview | None:
        """READ of handle ``h`` (``Handles.handle``): the bytes, or None."""
        if not h.cold:
            if h.node.staged is not None:
                return None
            data = self.from_cache(h.node, off, size)
            if data is not None:
                return data
            if self.to_reopen(h):
                return None
        return self._cached_backing(h.backing_fd, off, size)

    def from_cache(self, node, off: int, size: int) -> bytes | memoryview | None:
        """A cached file's bytes (it moves to the end of the eviction order), or None where
        only the backing holds them (``Files.read``)."""
        data = self.files.read(node, off, size)
        if data is not None:
            self.files.touch(node)
        return data

    @staticmethod
    def to_reopen(h) -> bool:
        """Whether ``h`` must (re)open its file's backing copy before reading it: none open
        yet, or the file got a new version since (unless it has no name left)."""
        return h.backing_fd < 0 or (h.generation != h.node.generation and h.node.nlink)

    def _cached_backing(self, fd: int, off: int, size: int) -> memoryview | None:
        """``size`` bytes at ``off`` of backing file ``fd`` (fewer only at its end) where the
        backing is local and its page cache holds them all; else None."""
        if self.calls.fstype is None:
            return None
        if len(self._buf) < size:
            self._buf = bytearray(size)
        view = memoryview(self._buf)[:size]
        n = self.backing.read_cached(fd, view, off)
        if n is None or (n < size and off + n < self.backing.stat_fd(fd).st_size):
            return None   # some of it is not in the page cache
        return view[:n]

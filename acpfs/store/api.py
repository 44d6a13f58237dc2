"""The content store: where the bytes of cached files live, behind one narrow interface.

Two implementations, chosen once per mount (``daemon``):

    pool.Pool           one pre-faulted file cut into blocks; a file is a list of block
                        numbers, shared block by block with its snapshots (copy on write).
                        Every read and write goes through the daemon.
    filestore.MemFiles   one file per cached file in the cache directory; the kernel passes
                        reads, writes and mmap of an open file straight to it (FUSE
                        passthrough), so the daemon sees none of them.

The cache, the flusher, write-through and recovery hold a file's content only as an opaque
``Content`` handle (``Node.content``, ``Snapshot.content``, ``Node.journal_content``) and
call the store for everything else. A handle is one reference: ``share`` makes another
(what a snapshot or a journal record holds while it needs the bytes as they are), ``drop``
gives one back. Bytes that a second reference holds never change: a write to shared
content goes to a copy (the pool copies the blocks it writes; memory files copy the file).

Every call that takes or frees space, or changes a reference count, is made with
``OpLog.lock`` held; ``read`` and ``source`` may run in worker threads on a handle they hold.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from typing import Any, Callable, ContextManager, Iterator, Protocol

Content = Any   # a store's handle: list[int] for the pool, filestore.MemFile for memory files


class CacheFull(Exception):
    """The store has no room for what was asked; the caller evicts, waits or writes through."""


class Store(Protocol):
    kind: str    # "pool" or "memory files": for status and logs
    unit: int    # the journal header's block size: the pool's; 0 for memory files
    limit: int   # bytes the store may hold
    peak: int    # the most it held
    in_ram: bool  # held in RAM (the pool, memory files on tmpfs), not in a disk's page cache

    @property
    def used(self) -> int: ...
    def free_bytes(self) -> int: ...

    def empty(self) -> Content:
        """The content of an empty file."""
    def alloc(self, size: int) -> Content:
        """Room for ``size`` bytes, to be filled (``fill``); raises CacheFull."""
    def fill(self, c: Content, src_fd: int, size: int, backing: Any,
             fast: bool | None = None, progress: Callable[[int, int], None] | None = None,
             drop: Callable[[], bool] | None = None) -> None:
        """Worker thread: copy ``size`` bytes from ``src_fd``, a file of ``backing``, into ``c``,
        several ranges at once where it is slow (``in_ranges``; ``fast``: known already;
        ``progress(off, n)``: told of each range copied; ``drop``: asked after each range
        whether the source's page cache over it is dropped: ``in_ranges``)."""
    def sink(self, c: Content, size: int) -> ContextManager[Callable[[int, memoryview], None]]:
        """Worker thread: ``put(off, bytes)`` writes bytes at ``off`` of ``c`` (room for
        ``size``, from ``alloc``), from any number of threads at disjoint offsets, until the
        block ends (how a copy from another node's RAM lands: core/peerreads.py)."""
    def need(self, c: Content, off: int, end: int) -> int:
        """Bytes a write of [off, end) would take from the free space."""
    def need_truncate(self, c: Content, size: int, new: int) -> int:
        """Bytes a truncate from ``size`` to ``new`` would take."""
    def read(self, c: Content, off: int, end: int) -> bytes | memoryview: ...
    def write(self, c: Content, off: int, data: bytes | memoryview) -> Content:
        """Write; returns the handle to keep (a copy when ``c`` was shared)."""
    def truncate(self, c: Content, size: int, new: int) -> Content: ...
    def shared(self, c: Content) -> bool:
        """Whether an open the kernel writes itself must get a copy first (``private``)."""
    def private(self, c: Content, size: int) -> Content:
        """A handle with the first ``size`` bytes of ``c`` that nobody else holds."""
    def descriptor(self, c: Content) -> int:
        """A descriptor of the file that holds ``c`` alone, valid until the next call into
        the store; -1 where there is none."""
    def backing(self, c: Content, register: Any) -> int:
        """The kernel's id for ``c`` (passthrough), registered with ``register(fd)`` once."""
    def share(self, c: Content) -> Content:
        """Another reference to the bytes as they are now (no writer changes them later,
        but one the kernel is passing through: ``copy`` for that)."""
    def copy(self, c: Content, size: int) -> Content:
        """The first ``size`` bytes of ``c`` as they are now, whatever writes them next."""
    def drop(self, c: Content) -> None: ...
    def nbytes(self, c: Content) -> int:
        """Bytes of the store that ``c`` holds."""
    def source(self, c: Content, size: int) -> ContextManager[tuple[int, Iterator[tuple[int, int, int]]]]:
        """For an upload, in any thread: a descriptor and runs of (file offset, offset in
        it, length), valid until the block ends."""
    def ref(self, c: Content) -> list[int]:
        """What a journal record names to find ``c`` again after a crash."""
    def claim_refs(self, refs: list[list[int]]) -> None:
        """At recovery, before anything else: hold what each listed ref names."""
    def adopt(self, ref: list[int]) -> Content:
        """At recovery: the handle of a ref claimed before (one of its references)."""
    def close(self) -> None: ...


def status_of(store: Store) -> dict[str, Any]:
    """A store's part of the status document's ``cache`` (docs/status.md), from what every
    store has: its use, limit, peak, block size and kind."""
    return {"used_bytes": store.used, "limit_bytes": store.limit, "peak_used_bytes": store.peak,
            "over_limit_bytes": max(0, store.used - store.limit), "block_size": store.unit,
            "store": store.kind}


FILL_STREAMS = 8          # ranges of one file copied into the cache at once (``in_ranges``);
# over a backing answering 2 ms late, 4 gave a preload 1.8-2.0x of one stream, 8 gave 2.3-2.5x
# and 16 no more (docs/benchmarks.md, "Eight streams")
FILL_CHUNK = 16 << 20     # bytes each range takes at a time
# a first chunk that came at least this fast came from memory (the backing's page cache, a
# local disk): more streams would only take CPU from the programs; slower, it came over a
# network, where each request waits a round trip, and the other streams start
FILL_FAST = 1 << 30       # bytes/s


PROBE = 1 << 20           # bytes ``fast_source`` reads


def fast_source(fd: int, size: int) -> bool:
    """Whether ``fd`` reads at FILL_FAST or faster (from memory: the page cache, a local
    disk): PROBE bytes from the middle of the file, timed (away from where a reader that
    just opened it reads ahead)."""
    n = min(PROBE, size)
    off = (size - n) // 2 // 4096 * 4096
    buf = memoryview(bytearray(n))
    start = time.monotonic()
    got = 0
    while got < n:
        k = os.preadv(fd, [buf[got:]], off + got)
        if k == 0:
            break
        got += k
    return got >= FILL_FAST * (time.monotonic() - start)


def in_ranges(size: int, copy: Callable[[int, int], None], unit: int = 1,
              streams: int = FILL_STREAMS, fast: bool | None = None,
              progress: Callable[[int, int], None] | None = None, src: int = -1,
              drop: Callable[[], bool] | None = None) -> None:
    """Call ``copy(off, n)`` over [0, ``size``) in chunks of FILL_CHUNK (a multiple of
    ``unit``): first PROBE bytes alone and timed, the rest by one thread when they came
    fast (FILL_FAST; ``fast``: known already), else by ``streams`` at once: a backing that
    answers each request after a round trip (NFS, Lustre) delivers several ranges in the
    time of one. (The probe is small: over a backing answering each 128 KiB 2 ms late, a
    whole first chunk alone took 0.25 s of a 256 MiB file's 0.9 s.) The first error stops
    the others and is raised. ``progress(off, n)`` after each chunk of ``n`` bytes at ``off``
    copied (any of the threads).

    ``drop``: after each chunk, and over the whole file at the end, the page cache of
    ``src`` (what ``copy`` reads) is dropped where ``drop()`` says nobody reads it there: the
    cache then holds the only copy in RAM, not a second one beside the backing's. (A copy
    into fresh memory is also slower while the backing's pages take the rest: on a VM that
    returns free pages to its host, a 256 MiB preload over a slow backing fell from 2.5x to
    1.5x of one stream once the cache held 1.5 GiB; docs/benchmarks.md.) Mapped and dirty
    pages stay: the kernel drops only clean pages nobody maps; the end drops the large
    folios that straddle two chunks.

    ``src`` is also read sequentially (POSIX_FADV_SEQUENTIAL: the kernel's readahead window
    of that open doubles, so each request to a backing that answers after a round trip
    brings twice the bytes: 8 ranges over a FUSE view answering each READ 2 ms late went
    from 315 to 631 MB/s; docs/benchmarks.md)."""
    if src >= 0:
        with contextlib.suppress(OSError):   # a descriptor without a page cache
            os.posix_fadvise(src, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    _in_ranges(size, _dropping(copy, src, drop), unit, streams, fast, progress)
    if drop is not None and drop():
        _drop(src, 0, 0)


def _drop(src: int, off: int, n: int) -> None:
    try:
        os.posix_fadvise(src, off, n, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass   # a filesystem without a page cache: nothing to drop


def _dropping(copy: Callable[[int, int], None], src: int,
              drop: Callable[[], bool] | None) -> Callable[[int, int], None]:
    if drop is None:
        return copy

    def copied(off: int, n: int) -> None:
        copy(off, n)
        if drop():
            _drop(src, off, n)
    return copied


def _in_ranges(size: int, copy: Callable[[int, int], None], unit: int, streams: int,
               fast: bool | None, progress: Callable[[int, int], None] | None) -> None:
    if progress is not None:
        inner = copy

        def copy(off: int, n: int) -> None:
            inner(off, n)
            progress(off, n)
    chunk = max(unit, FILL_CHUNK // unit * unit)
    first = 0
    if fast is None:
        first = min(max(unit, PROBE // unit * unit), size)
        start = time.monotonic()
        copy(0, first)
        fast = first >= FILL_FAST * (time.monotonic() - start)
    if size <= first:
        return
    if streams <= 1 or fast:
        for off in range(first, size, chunk):
            copy(off, min(chunk, size - off))
        return
    offsets = iter(range(first, size, chunk))
    lock = threading.Lock()
    failed: list[BaseException] = []

    def work() -> None:
        while not failed:
            with lock:
                off = next(offsets, None)
            if off is None:
                return
            try:
                copy(off, min(chunk, size - off))
            except BaseException as e:   # noqa: BLE001 (raised in the caller's thread)
                failed.append(e)
    threads = [threading.Thread(target=work, name="acpfs-fill", daemon=True)
               for _ in range(min(streams, -(-(size - first) // chunk)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        raise failed[0]


def copy_range(src: int, dst: int, off: int, n: int) -> None:
    """Copy bytes [off, off + n) of ``src`` to the same offsets of ``dst`` (any thread:
    no file position is used): copy_file_range where the two filesystems allow it, else
    pread and pwrite. Stops early at the end of ``src``."""
    end = off + n
    try:
        while off < end:
            got = os.copy_file_range(src, dst, end - off, off, off)
            if got == 0:
                return
            off += got
        return
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            raise
    buf = memoryview(bytearray(min(n, 4 << 20)))
    while off < end:
        got = os.preadv(src, [buf[:min(len(buf), end - off)]], off)
        if got == 0:
            return
        done = 0
        while done < got:
            done += os.pwritev(dst, [buf[done:got]], off + done)
        off += got


def copy_fd(src: int, dst: int, size: int) -> None:
    """Copy the first ``size`` bytes of ``src`` to the same offsets of ``dst``, in the
    kernel: copy_file_range (server-side where the filesystem can), else sendfile. Stops
    early at the end of ``src``."""
    done = 0
    while done < size:
        try:
            n = os.copy_file_range(src, dst, size - done, done, done)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.lseek(dst, done, os.SEEK_SET)
            n = os.sendfile(dst, src, done, size - done)
        if n == 0:
            break
        done += n

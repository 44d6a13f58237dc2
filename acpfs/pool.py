"""The block pool: all cached file data lives here.

One file in the cache directory (``pool``), mapped shared into the daemon and viewed as
numpy arrays. It is cut into fixed-size blocks; files hold lists of block numbers. The
pool is allocated and pre-faulted once at mount so that the write path only copies into
memory that is already there (fresh pages cost 4-20x more per request), and blocks are
reused after eviction.

Blocks are reference counted so that an upload can hold an immutable snapshot of a file
while the file keeps being written: a write to a block whose count is above one copies
it first (copy on write, see ``cache.FileData.write``).

Invariant: ``used_blocks == count of refcount > 0 == nblocks - len(free)``; the caller
holds ``Cache.lock`` for every alloc/incref/decref.
"""

from __future__ import annotations

import logging
import mmap
import os
from typing import Callable

import numpy as np

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 64 * 1024
VECTOR_MIN = 32   # block lists longer than this are counted with numpy, not a Python loop


class PoolFull(Exception):
    """No free block is left; the caller evicts or waits."""


class Pool:
    def __init__(self, path: str, size: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 progress: Callable[[int, int], None] | None = None, mlock: bool = False) -> None:
        if size < block_size:
            raise ValueError(f"cache size {size} is smaller than one block ({block_size})")
        self.block_size = block_size
        self.nblocks = size // block_size
        self.size = self.nblocks * block_size
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, self.size)
            # Allocate the backing pages up front, in chunks so that progress can be shown.
            step = 256 << 20
            for off in range(0, self.size, step):
                n = min(step, self.size - off)
                try:
                    os.posix_fallocate(fd, off, n)
                except OSError as e:
                    raise OSError(e.errno, f"cannot allocate {self.size} bytes for the cache in {path}: "
                                  f"{os.strerror(e.errno)}") from None
                if progress:
                    progress(off + n, self.size)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self.mm = mmap.mmap(fd, self.size, flags=flags)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        if mlock:
            self._mlock()
        self.mem = np.frombuffer(self.mm, dtype=np.uint8)
        self.view = memoryview(self.mm)
        self.refcount = np.zeros(self.nblocks, dtype=np.int32)
        # LIFO free list: recently freed blocks are the ones most likely still hot.
        self.free: list[int] = list(range(self.nblocks - 1, -1, -1))
        self.peak_used = 0

    def _mlock(self) -> None:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        buf = (ctypes.c_char * self.size).from_buffer(self.mm)
        if libc.mlock(ctypes.addressof(buf), ctypes.c_size_t(self.size)) != 0:
            log.warning("mlock of the cache pool failed (%s); it may be paged out",
                        os.strerror(ctypes.get_errno()))
        del buf

    @staticmethod
    def size_for(size: int, block_size: int) -> int:
        """The size of a pool asked to be ``size`` bytes (whole blocks)."""
        return size // block_size * block_size

    @property
    def used_blocks(self) -> int:
        return self.nblocks - len(self.free)

    def alloc(self) -> int:
        """Take a free block (refcount 1). Its content is undefined."""
        if not self.free:
            raise PoolFull()
        b = self.free.pop()
        self.refcount[b] = 1
        used = self.nblocks - len(self.free)
        if used > self.peak_used:
            self.peak_used = used
        return b

    def claim(self, blocks: list[int]) -> None:
        """At recovery, before any alloc: take one reference per listed block (repeats count),
        whose content a dead daemon's journal still needs."""
        for b in blocks:
            if not 0 <= b < self.nblocks:
                raise ValueError(f"journal names block {b}, outside the pool of {self.nblocks}")
            self.refcount[b] += 1
        self.free = [b for b in range(self.nblocks - 1, -1, -1) if self.refcount[b] == 0]
        self.peak_used = self.used_blocks

    def incref(self, blocks: list[int]) -> None:
        if len(blocks) > VECTOR_MIN:
            arr = np.asarray(blocks, dtype=np.int64)
            np.add.at(self.refcount, arr[arr >= 0], 1)
            return
        for b in blocks:
            if b >= 0:
                self.refcount[b] += 1

    def decref(self, blocks: list[int]) -> None:
        """Drop one reference per listed block; freed blocks go back so that the next
        allocations take them in ascending order (contiguous runs copy and upload in one go)."""
        rc = self.refcount
        if len(blocks) > VECTOR_MIN:
            arr = np.asarray(blocks, dtype=np.int64)
            arr = arr[arr >= 0]
            np.subtract.at(rc, arr, 1)
            freed = np.unique(arr[rc[arr] == 0])
            self.free.extend(freed[::-1].tolist())
            return
        freed_small = []
        for b in blocks:
            if b >= 0:
                rc[b] -= 1
                if rc[b] == 0:
                    freed_small.append(b)
        if freed_small:
            freed_small.sort(reverse=True)
            self.free.extend(freed_small)

    def close(self) -> None:
        self.view.release()
        del self.mem
        self.mm.close()
        os.close(self.fd)

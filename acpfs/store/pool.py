"""The block pool: the content store of the path every request takes (see api.py).

One file in the cache directory (``pool``), mapped shared into the daemon and viewed as
numpy arrays. It is cut into fixed-size blocks; a file's content is a list of block
numbers (-1: a hole that reads as zeros). The pool is allocated and pre-faulted once at
mount so that the write path only copies into memory that is already there (fresh pages
cost 4-20x more per request), and blocks are reused after eviction.

Blocks are reference counted so that an upload can hold an immutable snapshot of a file
while the file keeps being written: a write to a block whose count is above one copies
it first (copy on write, ``write``).

Invariants: ``used_blocks == count of refcount > 0 == nblocks - len(free)``; the caller
holds ``OpLog.lock`` for every call but ``read``, ``fill`` and ``source``. A byte of a
block past the end of its file is zero (``truncate`` and ``_new_block``), so growing a
file never exposes stale data.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
from typing import Callable, Iterator

import numpy as np

from ..config import DEFAULT_BLOCK_SIZE
from .api import CacheFull, in_ranges

log = logging.getLogger(__name__)

VECTOR_MIN = 32   # block lists longer than this are counted with numpy, not a Python loop


def iter_extents(blocks: list[int], size: int, block_size: int) -> Iterator[tuple[int, int, int]]:
    """Runs of (file offset, pool offset, length) for a block list, merging adjacent blocks."""
    start_f = start_p = length = 0
    for i, b in enumerate(blocks):
        foff = i * block_size
        if foff >= size:
            break
        n = min(block_size, size - foff)
        if b < 0:
            continue
        poff = b * block_size
        if length and start_f + length == foff and start_p + length == poff:
            length += n
            continue
        if length:
            yield start_f, start_p, length
        start_f, start_p, length = foff, poff, n
    if length:
        yield start_f, start_p, length


class Pool:
    kind = "pool"
    in_ram = True   # its file is mapped and pre-faulted, wherever it is
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
        self.unit = block_size
        self.limit = self.size

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

    def alloc_block(self) -> int:
        """Take a free block (refcount 1). Its content is undefined."""
        if not self.free:
            raise CacheFull()
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

    # -- the store interface (api.Store); a file's content is a list of blocks ------
    @property
    def used(self) -> int:
        return self.used_blocks * self.block_size

    @property
    def peak(self) -> int:
        return self.peak_used * self.block_size

    def free_bytes(self) -> int:
        return len(self.free) * self.block_size

    def empty(self) -> list[int]:
        return []

    def alloc(self, size: int) -> list[int]:
        n = -(-size // self.block_size)
        if n > len(self.free):
            raise CacheFull()
        return [self.alloc_block() for _ in range(n)]

    def fill(self, blocks: list[int], src_fd: int, size: int, backing, fast=None, progress=None,
             drop=None) -> None:
        bs = self.block_size
        view = self.view

        def blocks_of(off: int, n: int) -> None:
            for i in range(off // bs, -(-(off + n) // bs)):
                b = blocks[i]
                want = min(bs, size - i * bs)
                got = backing.read_into(src_fd, view[b * bs:b * bs + want], i * bs)
                if got < bs:
                    self.mem[b * bs + got:(b + 1) * bs] = 0
        in_ranges(min(size, len(blocks) * bs), blocks_of, unit=bs, fast=fast, progress=progress,
                  src=src_fd, drop=drop)

    @contextlib.contextmanager
    def sink(self, blocks: list[int], size: int) -> Iterator[Callable[[int, memoryview], None]]:
        bs = self.block_size
        view = self.view

        def put(off: int, data: memoryview) -> None:
            pos = 0
            while pos < len(data):
                i, within = divmod(off + pos, bs)
                n = min(bs - within, len(data) - pos)
                at = blocks[i] * bs + within
                view[at:at + n] = data[pos:pos + n]
                pos += n
        yield put
        if size % bs and size // bs < len(blocks):   # past the end of the file: zeros
            b = blocks[size // bs]
            self.mem[b * bs + size % bs:(b + 1) * bs] = 0

    def need(self, blocks: list[int], off: int, end: int) -> int:
        bs = self.block_size
        first, last = off // bs, (end - 1) // bs
        have = len(blocks)
        rc = self.refcount
        n = max(0, last + 1 - max(first, have))   # blocks past the end
        for i in range(first, min(last + 1, have)):
            b = blocks[i]
            if b < 0 or rc[b] > 1:
                n += 1
        return n * bs

    def need_truncate(self, blocks: list[int], size: int, new: int) -> int:
        bs = self.block_size
        keep = -(-new // bs)
        if new < size and new % bs and keep <= len(blocks) and blocks[keep - 1] >= 0 \
                and self.refcount[blocks[keep - 1]] > 1:
            return bs
        return 0

    def read(self, blocks: list[int], off: int, end: int):
        bs = self.block_size
        view = self.view
        i = off // bs
        if i == (end - 1) // bs:
            b = blocks[i] if i < len(blocks) else -1
            if b < 0:
                return bytes(end - off)
            base = b * bs - i * bs
            return view[base + off:base + end]
        j = (end - 1) // bs
        if j < len(blocks) and blocks[i] >= 0 and blocks[j] - blocks[i] == j - i \
                and all(blocks[k + 1] == blocks[k] + 1 for k in range(i, j)):
            base = blocks[i] * bs - i * bs     # contiguous in the pool: one view, no copy
            return view[base + off:base + end]
        parts = []
        pos = off
        while pos < end:
            i = pos // bs
            stop = min(end, (i + 1) * bs)
            b = blocks[i] if i < len(blocks) else -1
            if b < 0:
                parts.append(bytes(stop - pos))
            else:
                base = b * bs - i * bs
                parts.append(view[base + pos:base + stop])
            pos = stop
        return b"".join(parts)

    def write(self, blocks: list[int], off: int, data) -> list[int]:
        """Copy ``data`` in at ``off``; the caller reserved ``need`` bytes."""
        bs = self.block_size
        end = off + len(data)
        first, last = off // bs, (end - 1) // bs
        rc = self.refcount
        view = self.view
        src = memoryview(data)
        have = len(blocks)
        if have <= last:
            blocks.extend([-1] * (last + 1 - have))
        for i in range(first, last + 1):
            b = blocks[i]
            if b < 0:
                blocks[i] = self._new_block(zero=off > i * bs or end < (i + 1) * bs)
            elif rc[b] > 1:
                blocks[i] = self._cow(b)
        # copy in runs of consecutive blocks: one slice copy for a contiguous write
        pos = off
        s = 0
        i = first
        while i <= last:
            j = i
            while j < last and blocks[j + 1] == blocks[j] + 1:
                j += 1
            take = min((j + 1) * bs, end) - pos
            base = blocks[i] * bs + (pos - i * bs)
            view[base:base + take] = src[s:s + take]
            s += take
            pos += take
            i = j + 1
        return blocks

    def truncate(self, blocks: list[int], size: int, new: int) -> list[int]:
        bs = self.block_size
        if new < size:
            keep = -(-new // bs)
            tail = new % bs
            self.decref(blocks[keep:])
            del blocks[keep:]
            if tail and keep == len(blocks) and blocks[keep - 1] >= 0:
                b = blocks[keep - 1]
                if self.refcount[b] > 1:
                    b = blocks[keep - 1] = self._cow(b)
                self.mem[b * bs + tail:(b + 1) * bs] = 0
        return blocks

    def descriptor(self, blocks: list[int]) -> int:
        """No file of its own (the kernel never passes a pool file through): -1."""
        return -1

    def shared(self, blocks: list[int]) -> bool:
        """Never in the sense of ``private``: a write copies each shared block it touches."""
        return False

    def private(self, blocks: list[int], size: int) -> list[int]:
        return blocks

    def backing(self, blocks: list[int], register) -> int:
        raise OSError(errno.EOPNOTSUPP, "pool content cannot be passed through")

    def copy(self, blocks: list[int], size: int) -> list[int]:
        """As good as a copy: a write to a shared block copies it first."""
        return self.share(blocks)

    def share(self, blocks: list[int]) -> list[int]:
        self.incref(blocks)
        return list(blocks)

    def drop(self, blocks: list[int]) -> None:
        self.decref(blocks)

    def nbytes(self, blocks: list[int]) -> int:
        return len(blocks) * self.block_size

    @contextlib.contextmanager
    def source(self, blocks: list[int], size: int) -> Iterator[tuple[int, Iterator[tuple[int, int, int]]]]:
        yield self.fd, iter_extents(blocks, size, self.block_size)

    def ref(self, blocks: list[int]) -> list[int]:
        return blocks

    def claim_refs(self, refs: list[list[int]]) -> None:
        self.claim([b for ref in refs for b in ref if b >= 0])

    def adopt(self, ref: list[int]) -> list[int]:
        return ref

    def _new_block(self, zero: bool) -> int:
        b = self.alloc_block()
        if zero:
            bs = self.block_size
            self.mem[b * bs:(b + 1) * bs] = 0
        return b

    def _cow(self, b: int) -> int:
        nb = self.alloc_block()
        bs = self.block_size
        self.view[nb * bs:(nb + 1) * bs] = self.view[b * bs:(b + 1) * bs]
        self.decref([b])
        return nb

    def close(self) -> None:
        self.view.release()
        del self.mem
        self.mm.close()
        os.close(self.fd)
